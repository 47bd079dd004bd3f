"""Radix prefix cache on vs off on the embedded target with its shipped DSPARK drafter (plain decoding if none
is shipped), one request at a time so time-to-first-token is the prefill's own cost:
- MT-Bench turn 2: each question's second turn after the model's own first answer (the cache holds turn 1);
- shared system prompt: one long system prompt before each of the chat prompts.
Both settings answer the same prompts; greedy outputs must match and acceptance length should not move.

    python benchmarks/prefix.py
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import CHAT_PROMPTS, write_result  # noqa: E402
from specserve.datasets import load_workload, messages  # noqa: E402
from specserve.drafters import embedded_pair  # noqa: E402
from specserve.engine import LLM  # noqa: E402
from specserve.loader.tokenizer import chat_token_ids  # noqa: E402
from specserve.types import RequestOutput, SamplingParams, SpecStats  # noqa: E402

SYSTEM = ("You are a helpful, careful assistant working for a small software company. Answer the user's "
          "question accurately and concisely. When the question is about code, give a short explanation "
          "first and then a minimal example. When the question is about facts, say how sure you are and "
          "mention what would change your answer. Never invent references. Keep a friendly, professional "
          "tone, use plain words, prefer short paragraphs and bullet lists, and end with one sentence that "
          "sums up the answer. If the question is ambiguous, state the reading you chose before answering. ") * 2


def timed(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[RequestOutput, float]:
    start = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    return out, time.perf_counter() - start


def run_setting(cache: bool, args: argparse.Namespace, mtbench: list, engine_args: dict) -> dict:
    llm = LLM(num_threads=args.threads, disable_radix_cache=not cache, **engine_args)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    tok = llm.tokenizer
    llm.generate([chat_token_ids(tok, [{"role": "user", "content": "Hello"}])], SamplingParams(max_new_tokens=4,
                                                                                        temperature=0.0))
    results = {}
    for name in ("mtbench_turn2", "shared_system"):
        ttft, tokens, seconds, stats, texts = [], 0, 0.0, SpecStats(), []
        items = mtbench if name == "mtbench_turn2" else CHAT_PROMPTS
        for item in tqdm(items, desc=f"{name} cache {'on' if cache else 'off'}", unit="prompt"):
            if name == "mtbench_turn2":
                first = llm.generate([chat_token_ids(tok, messages(item, []))], params)[0]
                prompt = chat_token_ids(tok, messages(item, [first.text]))
            else:
                prompt = chat_token_ids(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": item}])
            out, elapsed = timed(llm, prompt, params)
            ttft.append(out.time_to_first_token)
            tokens += len(out.token_ids)
            seconds += elapsed
            texts.append(out.token_ids)
            stats.merge(SpecStats(out.spec.verify_ct, out.spec.num_proposed_drafts,
                                  out.spec.num_accepted_drafts, len(out.token_ids)))
        results[name] = {"ttft_p50_s": round(statistics.median(ttft), 4),
                         "ttft_mean_s": round(statistics.mean(ttft), 4),
                         "tokens_per_s": round(tokens / seconds, 2), "accept_length": round(stats.accept_length, 3),
                         "prompts": len(items), "texts": texts}
    if llm.engine.prefix_cache is not None:
        s = llm.engine.prefix_cache.stats
        results["cache"] = {"hit_rate": round(s.hit_rate, 4), "hit_tokens": s.hit_tokens,
                            "evicted_pages": s.evicted_pages}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=10, help="MT-Bench questions")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    engine_args = embedded_pair()
    mtbench = load_workload("mtbench")[:args.num_prompts]
    off = run_setting(False, args, mtbench, engine_args)
    on = run_setting(True, args, mtbench, engine_args)

    print(f"{'workload':<15} {'TTFT off':>9} {'TTFT on':>8} {'speedup':>8} {'tok/s off':>10} {'tok/s on':>9} "
          f"{'accept off':>11} {'accept on':>10}")
    rows = {}
    for name in ("mtbench_turn2", "shared_system"):
        a, b = off[name], on[name]
        differs = sum(x != y for x, y in zip(a.pop("texts"), b.pop("texts")))
        rows[name] = {"cache_off": a, "cache_on": b, "ttft_speedup": round(a["ttft_p50_s"] / b["ttft_p50_s"], 3),
                      "throughput_ratio": round(b["tokens_per_s"] / a["tokens_per_s"], 3), "text_differs": differs}
        print(f"{name:<15} {a['ttft_p50_s']:>9.3f} {b['ttft_p50_s']:>8.3f} {rows[name]['ttft_speedup']:>7.2f}x "
              f"{a['tokens_per_s']:>10.1f} {b['tokens_per_s']:>9.1f} {a['accept_length']:>11.2f} "
              f"{b['accept_length']:>10.2f}   text differs: {differs}")
    accept_off = statistics.mean(off[n]["accept_length"] for n in rows)
    accept_on = statistics.mean(on[n]["accept_length"] for n in rows)
    summary = {"ttft_speedup_mtbench_turn2": rows["mtbench_turn2"]["ttft_speedup"],
               "ttft_speedup_shared_system": rows["shared_system"]["ttft_speedup"],
               "accept_length_ratio_cache_on_off": round(accept_on / accept_off, 4),
               "text_differs": sum(r["text_differs"] for r in rows.values()),
               "cache_hit_rate": on["cache"]["hit_rate"]}
    print(summary)
    path = write_result("prefix", summary, {"config": vars(args), "algorithm": engine_args.get(
        "speculative_algorithm", "NONE"), "rows": rows, "cache": on["cache"]})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
