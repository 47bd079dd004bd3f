"""Speculative decoding at batch 1 as a user runs it on the embedded target: plain decoding, NGRAM and the shipped
DSPARK pair (budget planner, n-gram hybrid), each with its default flags, on the 8 chat prompts and the first 3
prompts of HumanEval, MATH-500 and MT-Bench, 128 greedy tokens, one request at a time. The engines take turns in one
process (the order reversed every round; a ratio is the median over rounds of each round's), and every speculative
text must equal plain decoding's. Writes benchmarks/results/spec_b1.json.

    python benchmarks/spec_b1.py [--rounds 4] [--max-new-tokens 128]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm  # noqa: E402

from benchmarks.common import CHAT_PROMPTS, write_result  # noqa: E402
from specserve.datasets import load_workload, messages, select_prompts  # noqa: E402
from specserve.drafters import embedded_pair  # noqa: E402
from specserve.engine import LLM  # noqa: E402
from specserve.loader.tokenizer import chat_token_ids  # noqa: E402
from specserve.types import SamplingParams  # noqa: E402

WORKLOADS = ("humaneval", "math500", "mtbench")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--per-workload", type=int, default=3)
    args = parser.parse_args()
    engines = {"plain": LLM(disable_radix_cache=True, max_running_requests=1),
               "ngram": LLM(disable_radix_cache=True, max_running_requests=1, speculative_algorithm="NGRAM"),
               "dspark": LLM(disable_radix_cache=True, max_running_requests=1, **embedded_pair())}
    tokenizer = engines["plain"].tokenizer
    chosen = select_prompts(tokenizer, {name: load_workload(name) for name in WORKLOADS}, args.per_workload, 512)
    prompts = ([chat_token_ids(tokenizer, messages([p], [])) for p in CHAT_PROMPTS]
               + [chat_token_ids(tokenizer, messages(c[:1], [])) for convs in chosen.values() for c in convs])
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    for llm in engines.values():
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=4))
    rates: dict[str, list[float]] = {name: [] for name in engines}
    accept: dict[str, list[float]] = {name: [] for name in engines}
    texts: dict[str, list[list[int]]] = {}
    with tqdm(total=args.rounds * len(engines), desc="spec b1", unit="run") as bar:
        for r in range(args.rounds):
            for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                start = time.perf_counter()
                outs = engines[name].generate(prompts, params)
                seconds = time.perf_counter() - start
                tokens = sum(len(o.token_ids) for o in outs)
                rates[name].append(tokens / seconds)
                accept[name].append(tokens / sum(o.spec.verify_ct or len(o.token_ids) for o in outs))
                texts.setdefault(name, [o.token_ids for o in outs])
                bar.update()

    def over_plain(name: str) -> float:
        """The median over rounds of the engine's tokens/s over plain decoding's in the same round."""
        return round(statistics.median(a / b for a, b in zip(rates[name], rates["plain"])), 3)

    rows = {name: {"best_tokens_per_s": round(max(v), 1), "median_tokens_per_s": round(statistics.median(v), 1),
                   "accept_length": round(statistics.mean(accept[name]), 3), "tokens_per_s": [round(x, 1) for x in v]}
            for name, v in rates.items()}
    summary = {"dspark_vs_plain_b1": over_plain("dspark"), "ngram_vs_plain_b1": over_plain("ngram"),
               "dspark_accept_length": rows["dspark"]["accept_length"],
               "ngram_accept_length": rows["ngram"]["accept_length"],
               "same_text_as_plain": all(t == texts["plain"] for t in texts.values())}
    for name, row in rows.items():
        print(f"{name:7s} best {row['best_tokens_per_s']:6.1f}  median {row['median_tokens_per_s']:6.1f} tokens/s  "
              f"acceptance {row['accept_length']:.3f}")
    print(summary)
    write_result("spec_b1", summary, {"rows": rows, "config": vars(args) | {"prompts": len(prompts)}})


if __name__ == "__main__":
    main()
