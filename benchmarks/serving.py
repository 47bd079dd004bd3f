"""Serving benchmark: an asyncio load generator on the openai client against `specserve serve`, plain
decoding vs speculative algorithms, at several concurrencies. Writes benchmarks/results/serving.json.

    .venv/bin/python benchmarks/serving.py [--algorithms none,ngram,dspark] [--concurrency 1,4,16]

Each algorithm gets its own server process. Per algorithm and concurrency C: C clients each send
--requests-per-client greedy streaming chat requests of --max-tokens tokens (EOS ignored, so every
algorithm decodes the same amount); recorded are output-token throughput, TTFT and TPOT p50/p99 and the
mean acceptance length (usage.spec). `dspark` on the embedded target is the shipped pair (serve's default:
the packaged drafter, n-gram hybrid on). An algorithm whose server does not start is recorded as unavailable.
Summary ratios are speedups over plain decoding (> 1: faster):
`<alg>_vs_plain_tpot_c1` = plain TPOT p50 / alg TPOT p50 at concurrency 1 and
`<alg>_vs_plain_throughput_c16` = alg throughput / plain throughput at concurrency 16; null when missing.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx
import numpy as np
import openai

from benchmarks.common import CHAT_PROMPTS as PROMPTS
from benchmarks.common import write_result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, algorithm: str, log) -> tuple[subprocess.Popen, str] | None:
    """A server for `algorithm`, once /health answers; None when it exits first (algorithm unavailable)."""
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "--port", str(port), "--threads", str(args.threads)]
    if not (algorithm == "dspark" and not args.model_path and not args.draft_model_path):
        cmd += ["--speculative-algorithm", algorithm.upper()]   # else serve's default: the shipped DSPARK pair
    if args.model_path:
        cmd += ["--model-path", args.model_path]
    if args.draft_model_path and algorithm != "none":
        cmd += ["--speculative-draft-model-path", args.draft_model_path]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    url = f"http://127.0.0.1:{port}"
    while proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    return None


async def one_request(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    first, usage = None, None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if first is None and any(c.delta.content for c in chunk.choices):
            first = time.perf_counter()
        usage = chunk.usage or usage
    end = time.perf_counter()
    first = first or end
    tokens = usage.completion_tokens
    return {"ttft": first - start, "tpot": (end - first) / (tokens - 1) if tokens > 1 else None, "tokens": tokens,
            "accept_length": usage.model_extra["spec"]["accept_length"]}


async def run_level(url: str, concurrency: int, args: argparse.Namespace) -> dict:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600) as client:
        model = (await client.models.list()).data[0].id
        await one_request(client, model, PROMPTS[0], 8)        # warm-up

        async def worker(w: int) -> list[dict]:
            return [await one_request(client, model, PROMPTS[(w * args.requests_per_client + i) % len(PROMPTS)],
                                      args.max_tokens) for i in range(args.requests_per_client)]

        start = time.perf_counter()
        done = await asyncio.gather(*(worker(w) for w in range(concurrency)))
        wall = time.perf_counter() - start
    reqs = [r for rs in done for r in rs]
    tokens = sum(r["tokens"] for r in reqs)
    ttft = [r["ttft"] * 1e3 for r in reqs]
    tpot = [r["tpot"] * 1e3 for r in reqs if r["tpot"] is not None]
    row = {"requests": len(reqs), "output_tokens": tokens, "wall_s": round(wall, 3),
           "throughput_tok_s": round(tokens / wall, 2)}
    for name, values in (("ttft", ttft), ("tpot", tpot)):
        for q in (50, 99):
            row[f"{name}_p{q}_ms"] = round(float(np.percentile(values, q)), 2)
    row["accept_length"] = round(float(np.mean([r["accept_length"] for r in reqs])), 3)
    return row


def speedups(rows: dict, algorithm: str) -> dict:
    def ratio(a: str, b: str, key: str) -> float | None:
        if a not in rows or b not in rows:
            return None
        return round(rows[a][key] / rows[b][key], 3)

    return {f"{algorithm}_vs_plain_tpot_c1": ratio("none_c1", f"{algorithm}_c1", "tpot_p50_ms"),
            f"{algorithm}_vs_plain_throughput_c16": ratio(f"{algorithm}_c16", "none_c16", "throughput_tok_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", default="none,ngram,dspark", help="comma-separated; none = plain decoding")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts")
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--model-path", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--draft-model-path", default=None, help="drafter for the speculative algorithms")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    algorithms = [a.strip().lower() for a in args.algorithms.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]

    rows, unavailable = {}, []
    for algorithm in algorithms:
        with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
            started = start_server(args, algorithm, log)
            if started is None:
                log.seek(0)
                print(f"{algorithm}: server did not start, skipped\n{log.read()[-2000:]}", file=sys.stderr)
                unavailable.append(algorithm)
                continue
            proc, url = started
            try:
                for c in levels:
                    rows[f"{algorithm}_c{c}"] = row = asyncio.run(run_level(url, c, args))
                    print(f"{algorithm:>8} c={c:<3} {row['throughput_tok_s']:8.1f} tok/s  "
                          f"TTFT p50 {row['ttft_p50_ms']:7.1f} ms p99 {row['ttft_p99_ms']:7.1f} ms  "
                          f"TPOT p50 {row['tpot_p50_ms']:6.1f} ms p99 {row['tpot_p99_ms']:6.1f} ms  "
                          f"accept {row['accept_length']:.2f}")
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait()

    summary = speedups(rows, "dspark")
    for algorithm in algorithms:
        if algorithm not in ("none", "dspark"):
            summary |= speedups(rows, algorithm)
    summary |= {f"{key}_throughput_tok_s": row["throughput_tok_s"] for key, row in rows.items()}
    path = write_result("serving", summary, {"config": vars(args), "unavailable": unavailable, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
