"""What every benchmark records next to its numbers: machine, versions, git sha; and the JSON writer."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"

# Chat prompts shared by the decode and serving benchmarks.
CHAT_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash map works to a new programmer.",
    "What are the main causes of the French Revolution?",
    "Give me a recipe for a vegetarian lasagna.",
    "Describe the water cycle in simple terms.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What is the difference between a virus and a bacterium?",
    "Plan a three-day trip to Rome for a family with two children.",
]


def simd() -> str:
    """The vector instructions our kernels use here: one model name covers hosts with and without AVX-512 VNNI."""
    from specserve import native

    if native.vnni():
        return "avx512vnni"
    return "avx2" if native.register() else "none (Python references)"


def machine_info() -> dict:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        sha = ""
    cpu, flags = "", set()
    if Path("/proc/cpuinfo").exists():
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
        flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    return {"cpu": cpu, "simd": simd(), "bf16_units": sorted(flags & {"avx512_bf16", "amx_bf16"}),
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "git_sha": sha,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def write_result(name: str, summary: dict, details: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"summary": summary, "machine": machine_info(), **details}, indent=2) + "\n")
    return path
