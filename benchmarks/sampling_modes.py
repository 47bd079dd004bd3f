"""Coupled sampling against rejection sampling on sampled workloads, side by side in one run: acceptance length
and tokens/s of the shipped DSPARK pair (a drafter that samples: the modes differ) and NGRAM (deterministic
drafts: the modes should accept alike) at temperature 0.7 and 1.0, the same prompts for every cell, batch 1,
the embedded SmolLM2 target (int8). Unseeded requests: `coupled` gives each a random seed, `rejection`
verifies them by rejection sampling. Writes benchmarks/results/sampling_modes.json.

    .venv/bin/python benchmarks/sampling_modes.py [--num-prompts 6] [--max-new-tokens 128]
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_result  # noqa: E402
from specserve.bench.run import run_algorithm  # noqa: E402
from specserve.datasets import load_workload, select_prompts  # noqa: E402
from specserve.drafters import embedded_pair  # noqa: E402
from specserve.engine import LLM  # noqa: E402
from specserve.types import SamplingParams, SpecStats  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="humaneval,mtbench,sharegpt")
    parser.add_argument("--num-prompts", type=int, default=6, help="per workload (first turns)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    algorithms = {"dspark": embedded_pair(), "ngram": {"speculative_algorithm": "NGRAM",
                                                       "speculative_num_draft_tokens": 8}}
    loaded = {name: [c[:1] for c in load_workload(name)] for name in args.workloads.split(",")}
    workloads = None
    rows = {}
    for algorithm, engine_args in algorithms.items():
        for mode in ("coupled", "rejection"):
            llm = LLM(disable_radix_cache=True, speculative_sampling=mode, **engine_args)
            workloads = workloads or select_prompts(llm.tokenizer, loaded, args.num_prompts, 512)
            for temperature in args.temperatures:
                params = SamplingParams(temperature=temperature, max_new_tokens=args.max_new_tokens)
                cells = run_algorithm(llm, f"{algorithm} {mode} T{temperature}", workloads, params, 1)
                stats = SpecStats()
                for cell in cells.values():
                    stats.merge(cell.stats)
                seconds = sum(cell.seconds for cell in cells.values())
                rows[f"{algorithm} {mode} T{temperature}"] = {
                    "accept_length": round(stats.accept_length, 4),
                    "tokens_per_s": round(stats.num_emitted_tokens / seconds, 2),
                    "tokens": stats.num_emitted_tokens}
            del llm
            gc.collect()

    summary = {}
    for algorithm in algorithms:
        for t in args.temperatures:
            coupled, rejection = rows[f"{algorithm} coupled T{t}"], rows[f"{algorithm} rejection T{t}"]
            summary[f"{algorithm}_T{t}_coupled_over_rejection_accept"] = round(
                coupled["accept_length"] / rejection["accept_length"], 3)
            summary[f"{algorithm}_T{t}_coupled_over_rejection_tokens_per_s"] = round(
                coupled["tokens_per_s"] / rejection["tokens_per_s"], 3)
    print(f"{'configuration':28s} {'accept':>7s} {'tok/s':>7s}")
    for label, row in rows.items():
        print(f"{label:28s} {row['accept_length']:7.3f} {row['tokens_per_s']:7.2f}")
    print(summary)
    path = write_result("sampling_modes", summary, {"config": vars(args), "rows": rows,
                                                    "prompts": {k: len(v) for k, v in workloads.items()}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
