"""`specserve bench`: acceptance length and speed of each algorithm over the workloads of datasets.py."""
