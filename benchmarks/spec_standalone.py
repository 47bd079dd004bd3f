"""Speculative decoding on the real Qwen2.5-Coder pair, batch 1, greedy, HumanEval prompts: plain vs
STANDALONE (0.5B draft, best K of a short sweep) vs NGRAM, measured in one run.
Writes benchmarks/results/spec_standalone.json.

    .venv/bin/specserve fetch-model qwen2.5-coder-1.5b && .venv/bin/specserve fetch-model qwen2.5-coder-0.5b
    .venv/bin/python benchmarks/spec_standalone.py [--num-prompts 20] [--max-new-tokens 128]
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from tqdm import tqdm

from benchmarks.common import write_result
from specserve.datasets import humaneval_prompts
from specserve.engine import LLM
from specserve.types import SamplingParams

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


def run(prompts: list[str], new_tokens: int, desc: str, **engine_args) -> dict:
    llm = LLM(TARGET, **engine_args)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    llm.generate(prompts[0], SamplingParams(temperature=0.0, max_new_tokens=4), chat=True)   # warm-up
    tokens, seconds, texts, verify_ct, emitted = 0, 0.0, [], 0, 0
    for prompt in tqdm(prompts, desc=desc):
        start = time.perf_counter()
        out = llm.generate(prompt, params, chat=True)[0]
        seconds += time.perf_counter() - start
        tokens += len(out.token_ids)
        texts.append(out.token_ids)
        verify_ct += out.spec.verify_ct
        emitted += len(out.token_ids)
    del llm
    gc.collect()
    return {"tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 3),
            "accept_length": round(emitted / verify_ct, 3), "token_ids": texts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--sweep", type=int, nargs="+", default=[3, 5, 7], help="STANDALONE K values to try")
    parser.add_argument("--sweep-prompts", type=int, default=3)
    parser.add_argument("--ngram-k", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = humaneval_prompts(args.num_prompts)

    sweep = {k: run(prompts[:args.sweep_prompts], args.max_new_tokens, f"sweep K={k}",
                    speculative_algorithm="STANDALONE", speculative_draft_model_path=DRAFT,
                    speculative_num_draft_tokens=k)
             for k in args.sweep}
    best_k = max(sweep, key=lambda k: sweep[k]["tokens_per_s"])
    plain = run(prompts, args.max_new_tokens, "plain")
    standalone = run(prompts, args.max_new_tokens, f"STANDALONE K={best_k}", speculative_algorithm="STANDALONE",
                     speculative_draft_model_path=DRAFT, speculative_num_draft_tokens=best_k)
    ngram = run(prompts, args.max_new_tokens, "NGRAM", speculative_algorithm="NGRAM",
                speculative_num_draft_tokens=args.ngram_k)
    mismatches = {name: sum(a != b for a, b in zip(plain["token_ids"], r["token_ids"]))
                  for name, r in (("standalone", standalone), ("ngram", ngram))}
    summary = {
        "standalone_speedup": round(standalone["tokens_per_s"] / plain["tokens_per_s"], 3),
        "standalone_accept_length": standalone["accept_length"],
        "standalone_best_k": best_k,
        "ngram_speedup": round(ngram["tokens_per_s"] / plain["tokens_per_s"], 3),
        "ngram_accept_length": ngram["accept_length"],
        "plain_tokens_per_s": plain["tokens_per_s"],
        "prompts_differing_from_plain": mismatches,
    }
    print(f"{'config':<18} {'tok/s':>7} {'accept':>7} {'speedup':>8}")
    for name, r in (("plain", plain), (f"STANDALONE K={best_k}", standalone), ("NGRAM", ngram)):
        print(f"{name:<18} {r['tokens_per_s']:>7.2f} {r['accept_length']:>7.2f} "
              f"{r['tokens_per_s'] / plain['tokens_per_s']:>8.2f}")
    for r in (plain, standalone, ngram, *sweep.values()):
        r.pop("token_ids")
    path = write_result("spec_standalone", summary, {
        "config": vars(args), "target": TARGET, "draft": DRAFT, "workload": "HumanEval (chat, first N prompts)",
        "plain": plain, "standalone": standalone, "ngram": ngram, "sweep": {str(k): v for k, v in sweep.items()}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
