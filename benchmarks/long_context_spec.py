"""DSPARK at a long context, batch 1, greedy: the budget planner with the cost table's per-key attention terms
against the same table without them (what the planner had before), beside plain decoding, in one run.

Each prompt asks for a summary of a document of held-out ShareGPT answers (~`--context` tokens, chat template
on). The cost table is measured once here; the two planners read copies of it that differ only in the key terms.
Decode tokens per second after the first token, best of `--repeats` rounds taken in turns.

    python benchmarks/long_context_spec.py
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.common import write_result  # noqa: E402
from benchmarks.quant_quality import held_out_answers  # noqa: E402
from specserve.drafters import embedded_pair  # noqa: E402
from specserve.engine import LLM  # noqa: E402
from specserve.loader.tokenizer import chat_token_ids  # noqa: E402
from specserve.speculative.cost_table import measure_cost_table  # noqa: E402
from specserve.types import SamplingParams  # noqa: E402


def documents(tokenizer, count: int, context: int) -> list[list[int]]:
    """`count` chat prompts, each a document of consecutive held-out answers (~`context` tokens) to summarise."""
    answers = [tokenizer.decode(a) for _, a in held_out_answers(40 * count, tokenizer, 4 * context)]
    prompts, doc = [], []
    for text in answers:
        doc.append(text)
        if len(tokenizer.encode("\n\n".join(doc), add_special_tokens=False)) >= context:
            content = "\n\n".join(doc) + "\n\nSummarize the text above in a few sentences."
            prompts.append(chat_token_ids(tokenizer, [{"role": "user", "content": content}]))
            doc = []
            if len(prompts) == count:
                return prompts
    raise ValueError(f"the held-out answers fill only {len(prompts)} documents of {context} tokens")


def decode(llm: LLM, prompt: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    """(decode tokens per second after the first token, tokens per target forward, the tokens)."""
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))
    outputs = engine.step()
    while not any(out.token_ids for out in outputs):
        outputs = engine.step()
    first = len(outputs[0].token_ids)
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished:
        outputs = engine.step() or outputs
        steps += 1
    seconds = time.perf_counter() - start
    tokens = list(outputs[0].token_ids)
    emitted = len(tokens) - first
    return emitted / seconds, emitted / max(steps, 1), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=3000, help="document tokens per prompt")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    plain = LLM(num_threads=args.threads, disable_radix_cache=True)
    prompts = documents(plain.tokenizer, args.prompts, args.context)
    table = measure_cost_table(plain.engine.model, 16, repeats=5, window=8, long_context=args.context,
                               kv_dtype=plain.engine.pool.geometry.dtype)
    tables = Path(tempfile.mkdtemp())
    keyed, unkeyed = tables / "keyed.json", tables / "unkeyed.json"
    table.save(keyed)
    dataclasses.replace(table, first_row_key_seconds=0.0, extra_row_key_seconds=0.0).save(unkeyed)
    llms = {"plain": plain,
            "DSPARK, keyed planner": LLM(num_threads=args.threads, disable_radix_cache=True, **embedded_pair(),
                                         speculative_dspark_cost_table_path=str(keyed)),
            "DSPARK, unkeyed planner": LLM(num_threads=args.threads, disable_radix_cache=True, **embedded_pair(),
                                           speculative_dspark_cost_table_path=str(unkeyed))}
    for llm in llms.values():
        decode(llm, prompts[0][:200], 8)                       # warm-up, untimed
    best = {name: [0.0] * len(prompts) for name in llms}
    per_step = {name: [0.0] * len(prompts) for name in llms}
    texts: dict[str, list[list[int]]] = {name: [[] for _ in prompts] for name in llms}
    for _ in tqdm(range(args.repeats), desc="long-context DSPARK"):
        for j, prompt in enumerate(prompts):
            for name, llm in llms.items():
                rate, tau, tokens = decode(llm, prompt, args.max_new_tokens)
                best[name][j] = max(best[name][j], rate)
                per_step[name][j], texts[name][j] = tau, tokens
    mean = {name: sum(v) / len(v) for name, v in best.items()}
    for name in llms:
        print(f"{name:26s} {mean[name]:7.1f} tok/s  tokens per forward "
              f"{sum(per_step[name]) / len(prompts):.2f}")
    summary = {
        "context_tokens": [len(p) for p in prompts],
        "plain_tokens_per_s": round(mean["plain"], 2),
        "dspark_keyed_tokens_per_s": round(mean["DSPARK, keyed planner"], 2),
        "dspark_unkeyed_tokens_per_s": round(mean["DSPARK, unkeyed planner"], 2),
        "keyed_over_unkeyed": round(mean["DSPARK, keyed planner"] / mean["DSPARK, unkeyed planner"], 3),
        "keyed_over_plain": round(mean["DSPARK, keyed planner"] / mean["plain"], 3),
        "unkeyed_over_plain": round(mean["DSPARK, unkeyed planner"] / mean["plain"], 3),
        "same_tokens_as_plain": all(texts[name] == texts["plain"] for name in llms),
    }
    print(summary)
    details = {"config": vars(args),
               "cost_table": dataclasses.asdict(table),
               "tokens_per_s": best, "tokens_per_forward": per_step}
    print(f"wrote {write_result('long_context_spec', summary, details)}")


if __name__ == "__main__":
    main()
