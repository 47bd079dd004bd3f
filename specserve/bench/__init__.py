"""Benchmark workloads and runners."""
