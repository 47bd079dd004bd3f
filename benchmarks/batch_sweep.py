"""Throughput against batch size on the embedded SmolLM2-135M target: plain decoding, DSPARK as shipped
(budget planner sizes every window from the drafter's confidences and the measured cost table), and
DSPARK verifying full windows (confidence threshold 0). B distinct chat prompts are submitted at once,
greedy, the same prompts for every engine; tokens/s = generated tokens / wall time.

    python benchmarks/batch_sweep.py
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, write_result  # noqa: E402
from specserve.datasets import load_workload, messages  # noqa: E402
from specserve.drafters import embedded_pair  # noqa: E402
from specserve.engine import LLM  # noqa: E402
from specserve.loader.tokenizer import chat_token_ids  # noqa: E402
from specserve.types import SamplingParams  # noqa: E402

BATCHES = (1, 2, 4, 8, 16, 32)


def engines() -> dict[str, dict]:
    pair = embedded_pair()
    if not pair:
        raise SystemExit("no shipped DSPARK drafter: train one first (see README, Training)")
    return {"plain": {}, "dspark_budget": pair, "dspark_full": {**pair, "speculative_dspark_confidence_threshold": 0.0}}


def sweep(label: str, engine_args: dict, prompts: list[list[int]], batches: tuple[int, ...],
          params: SamplingParams, threads: int) -> dict[int, dict]:
    llm = LLM(num_threads=threads, disable_radix_cache=True, max_running_requests=max(batches), **engine_args)
    llm.generate(prompts[:2], SamplingParams(max_new_tokens=8, temperature=0.0))
    rows = {}
    for b in tqdm(batches, desc=label, unit="batch"):
        start = time.perf_counter()
        outs = llm.generate(prompts[:b], params)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outs)
        verify = sum(o.spec.verify_ct for o in outs)
        rows[b] = {"tokens_per_s": round(tokens / seconds, 2), "tokens": tokens, "seconds": round(seconds, 3),
                   "accept_length": round(tokens / verify, 3) if verify else 0.0,
                   "token_ids": [o.token_ids for o in outs]}
    del llm
    gc.collect()
    return rows


def plot(results: dict[str, dict[int, dict]], batches: tuple[int, ...], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for label, rows in results.items():
        ax.plot(batches, [rows[b]["tokens_per_s"] for b in batches], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size (requests decoded together)")
    ax.set_ylabel("generated tokens / s")
    ax.set_title("SmolLM2-135M, 2 CPU threads, greedy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    batches = tuple(int(b) for b in args.batches.split(","))
    configs = engines()
    tokenizer = LLM(num_threads=args.threads).tokenizer
    conversations = load_workload("sharegpt") + load_workload("mtbench")
    prompts = [ids for ids in (chat_token_ids(tokenizer, messages(c[:1], [])) for c in conversations)
               if len(ids) <= 512]
    prompts = prompts[:max(batches)]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    results = {label: sweep(label, engine_args, prompts, batches, params, args.threads)
               for label, engine_args in configs.items()}

    print(f"{'batch':>5} " + " ".join(f"{label:>14}" for label in results) + "  budget/plain  full/plain")
    ratios = {}
    for b in batches:
        plain = results["plain"][b]["tokens_per_s"]
        ratios[b] = {"budget": round(results["dspark_budget"][b]["tokens_per_s"] / plain, 3),
                     "full": round(results["dspark_full"][b]["tokens_per_s"] / plain, 3)}
        print(f"{b:>5} " + " ".join(f"{results[label][b]['tokens_per_s']:>14.1f}" for label in results)
              + f"  {ratios[b]['budget']:>12.2f}  {ratios[b]['full']:>10.2f}")
    differs = sum(a != p for label in ("dspark_budget", "dspark_full") for b in batches
                  for a, p in zip(results[label][b]["token_ids"], results["plain"][b]["token_ids"]))
    for rows in results.values():
        for row in rows.values():
            row.pop("token_ids")
    summary = {"ratio_b1": ratios[batches[0]]["budget"],
               "min_ratio_vs_plain": min(r["budget"] for r in ratios.values()),
               "full_window_min_ratio_vs_plain": min(r["full"] for r in ratios.values()), "text_differs": differs}
    print(summary)
    plot(results, batches, RESULTS / "batch_sweep.png")
    path = write_result("batch_sweep", summary, {"config": vars(args), "results": results, "ratios": ratios})
    print(f"wrote {path} and {RESULTS / 'batch_sweep.png'}")


if __name__ == "__main__":
    main()
