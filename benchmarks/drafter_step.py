"""A batch-1 DSPARK step's stages with the block drafter's native ops (the context write, native/context.cpp; a
greedy block's heads, native/markov.cpp) against the torch ops they replace, in one engine, taking turns.

The embedded pair on the chat prompts, greedy, every block row verified (threshold 0), so that the block runs at
every step; each variant switches one drafter flag (`native_context`, `native_heads`) or both. Each prompt runs once
per variant and round, in an order that alternates (ABBA), and the stages are timed around the engine's own calls:
milliseconds per step, summed over every prompt and round. The tokens must be the same in every variant.

    python benchmarks/drafter_step.py
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.common import CHAT_PROMPTS, write_result  # noqa: E402
from specserve.drafters import embedded_pair  # noqa: E402
from specserve.engine import LLM  # noqa: E402
from specserve.loader.tokenizer import chat_token_ids  # noqa: E402
from specserve.types import SamplingParams  # noqa: E402

FLAGS = ("native_context", "native_heads")


def timed(stages: collections.Counter, obj, name: str) -> None:
    """Wrap obj.name so that its seconds add up in stages[name]."""
    call = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            stages[name] += time.perf_counter() - start

    setattr(obj, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variant", choices=("both", *FLAGS), default="both",
                        help="which native op the torch path replaces (both: every flag)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(num_threads=args.threads, disable_radix_cache=True, **embedded_pair(),
              speculative_dspark_confidence_threshold=0.0)
    engine, proposer = llm.engine, llm.engine.proposer
    drafter = proposer.drafter
    flags = FLAGS if args.variant == "both" else (args.variant,)
    if not all(getattr(drafter, flag) for flag in flags):
        raise SystemExit(f"the drafter does not take the native path of {flags} on this machine")
    stages: collections.Counter = collections.Counter()
    timed(stages, proposer, "propose")
    timed(stages, proposer, "flush_context")
    timed(stages, proposer, "_run_block")
    timed(stages, engine.runner, "forward")
    prompts = [chat_token_ids(llm.tokenizer, [{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:args.prompts]]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    llm.generate([prompts[0]], params)                                # warm-up, untimed
    totals = {name: collections.Counter() for name in ("native", "torch ops")}
    tokens: dict[str, dict[int, list[int]]] = {name: {} for name in totals}
    for r in tqdm(range(args.rounds), desc="drafter step"):
        for i, prompt in enumerate(prompts):
            order = ("native", "torch ops") if (r + i) % 2 == 0 else ("torch ops", "native")
            for name in order:
                for flag in flags:
                    setattr(drafter, flag, name == "native")
                stages.clear()
                steps_before = engine.stats.verify_ct
                start = time.perf_counter()
                out = llm.generate([prompt], params)[0]
                totals[name]["step"] += time.perf_counter() - start
                totals[name]["steps"] += engine.stats.verify_ct - steps_before
                totals[name]["tokens"] += len(out.token_ids)
                totals[name].update(stages)
                tokens[name][i] = out.token_ids
    per_step = {name: {stage: round(seconds / t["steps"] * 1e3, 3) for stage, seconds in t.items()
                       if stage not in ("steps", "tokens")} for name, t in totals.items()}
    for name, stage_ms in per_step.items():
        print(f"{name:10s} ms/step {stage_ms}  tok/s {totals[name]['tokens'] / totals[name]['step']:.1f}")
    native, torch_ops = per_step["native"], per_step["torch ops"]
    summary = {"variant": args.variant,
               **{f"{stage}_ms_native": native[stage] for stage in native},
               **{f"{stage}_ms_torch_ops": torch_ops[stage] for stage in torch_ops},
               "step_ms_saved": round(torch_ops["step"] - native["step"], 3),
               "propose_ms_saved": round(torch_ops["propose"] - native["propose"], 3),
               "same_tokens": tokens["native"] == tokens["torch ops"]}
    print(summary)
    details = {"config": vars(args), "totals": {name: dict(t) for name, t in totals.items()}}
    result = "drafter_step" if args.variant == "both" else f"drafter_step_{args.variant}"
    print(f"wrote {write_result(result, summary, details)}")


if __name__ == "__main__":
    main()
