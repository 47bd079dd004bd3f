"""Tensor and data parallelism on this machine, side by side in one run (Qwen2.5-Coder-1.5B by default):
- TP 1 vs TP 2 (`LLM(tp_size=...)`, the cores split between the ranks): greedy decode tokens/s at batch 1 and 4,
  and a decode step split into compute and communication (torch.profiler on rank 0: time inside gloo
  collectives, which includes waiting for the slower rank, against the rest of the step);
- DP 1 vs DP 2 (`specserve serve --dp-size`, the cores split between the replicas): the tokens/s of 8
  concurrent requests through the HTTP API.
Every rank or replica shares this machine's memory bus, so expect little or no gain here: on separate GPUs or
machines each would bring its own bandwidth. Writes benchmarks/results/parallel.json.

    .venv/bin/python benchmarks/parallel.py [--model qwen2.5-coder-1.5b] [--max-new-tokens 32]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.common import CHAT_PROMPTS, write_result  # noqa: E402
from specserve.distributed import free_port  # noqa: E402
from specserve.engine import LLM  # noqa: E402
from specserve.loader import resolve_model_path  # noqa: E402
from specserve.types import SamplingParams  # noqa: E402


def decode_rate(llm: LLM, batch: int, new_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate(CHAT_PROMPTS[:batch], params, chat=True)
    start = time.perf_counter()
    outs = llm.generate(CHAT_PROMPTS[:batch], params, chat=True)
    return batch * new_tokens / (time.perf_counter() - start), [o.token_ids for o in outs]


def step_split(llm: LLM, new_tokens: int, tokens_per_s: float) -> dict:
    """A batch-1 decode step's milliseconds, unprofiled, split by the share of a profiled run spent inside gloo
    collectives (the profiler slows the step's many small ops, so its own times are not the step's)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    with torch.profiler.profile() as prof:
        llm.generate(CHAT_PROMPTS[:1], params, chat=True)
    elapsed = time.perf_counter() - start
    share = sum(e.cpu_time_total for e in prof.key_averages() if e.key.startswith("gloo:")) / 1e6 / elapsed
    step_ms = 1e3 / tokens_per_s
    return {"step_ms": round(step_ms, 2), "communication_ms": round(share * step_ms, 2),
            "compute_ms": round((1 - share) * step_ms, 2), "communication_share": round(share, 3)}


def tensor_parallel(model: str, new_tokens: int) -> dict:
    cores = os.cpu_count() or 1
    out = {}
    for tp in tqdm((1, 2), desc="tensor parallel"):
        with LLM(model, tp_size=tp, num_threads=max(1, cores // tp), disable_radix_cache=True) as llm:
            b1, tokens = decode_rate(llm, 1, new_tokens)
            b4, _ = decode_rate(llm, 4, new_tokens)
            out[f"tp{tp}"] = {"b1_tokens_per_s": round(b1, 2), "b4_tokens_per_s": round(b4, 2),
                              "step": step_split(llm, new_tokens, b1), "tokens": tokens[0]}
    return out


async def load(url: str, model_name: str, requests: int, new_tokens: int) -> float:
    bodies = [{"model": model_name, "messages": [{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}],
               "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True} for i in range(requests)]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        responses = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
        elapsed = time.perf_counter() - start
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    return sum(r.json()["usage"]["completion_tokens"] for r in responses) / elapsed


def data_parallel(model: str, new_tokens: int, requests: int) -> dict:
    cores = os.cpu_count() or 1
    out = {}
    for dp in tqdm((1, 2), desc="data parallel"):
        port = free_port()
        cmd = [sys.executable, "-m", "specserve.cli", "serve", "--model-path", model, "--port", str(port),
               "--dp-size", str(dp), "--threads", str(max(1, cores // dp)), "--speculative-algorithm", "NONE",
               "--served-model-name", "m", "--disable-radix-cache"]
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 600
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the --dp-size {dp} server did not start")
                time.sleep(1)
            asyncio.run(load(url, "m", dp, 4))          # first-call costs, untimed
            out[f"dp{dp}"] = {"tokens_per_s": round(asyncio.run(load(url, "m", requests, new_tokens)), 2)}
        finally:
            server.terminate()
            server.wait(60)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=8, help="concurrent requests for DP")
    args = parser.parse_args()
    model = str(resolve_model_path(args.model))
    tp = tensor_parallel(model, args.max_new_tokens)
    dp = data_parallel(model, args.max_new_tokens, args.requests)
    summary = {
        "tp2_over_tp1_b1": round(tp["tp2"]["b1_tokens_per_s"] / tp["tp1"]["b1_tokens_per_s"], 3),
        "tp2_over_tp1_b4": round(tp["tp2"]["b4_tokens_per_s"] / tp["tp1"]["b4_tokens_per_s"], 3),
        "tp2_communication_share": tp["tp2"]["step"]["communication_share"],
        "tp2_same_tokens_as_tp1": tp["tp2"]["tokens"] == tp["tp1"]["tokens"],
        "dp2_over_dp1": round(dp["dp2"]["tokens_per_s"] / dp["dp1"]["tokens_per_s"], 3),
    }
    for name, row in tp.items():
        print(f"{name}: b1 {row['b1_tokens_per_s']} tok/s, b4 {row['b4_tokens_per_s']} tok/s, step {row['step']}")
    for name, row in dp.items():
        print(f"{name}: {row['tokens_per_s']} tok/s over {args.requests} concurrent requests")
    print(summary)
    path = write_result("parallel", summary, {"model": Path(model).name, "max_new_tokens": args.max_new_tokens,
                                              "requests": args.requests, "tensor_parallel": tp,
                                              "data_parallel": dp})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
