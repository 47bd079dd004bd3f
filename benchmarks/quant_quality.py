"""Quality of --quantization int8 against float32 on the same GGUF: mean NLL / perplexity of reference
answers (the first turns of ShareGPT conversations held out from drafter training, chat template on), also
with a float16 KV cache under int8 (--kv-cache-dtype float16, the default there) and an int8 one (int8),
and greedy agreement over the first 64 new tokens of chat prompts (teacher-forced on the float32 model's
own continuation, and the length of the common free-running prefix). Writes
benchmarks/results/quant_quality.json.

    .venv/bin/python benchmarks/quant_quality.py [--model-path P] [--texts 50] [--prompts 16]
"""
from __future__ import annotations

import argparse
import math
import sys
from itertools import islice
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import CHAT_PROMPTS, write_result  # noqa: E402
from specserve.attention.sdpa import AttentionMetadata, SeqSpan  # noqa: E402
from specserve.datasets import SHAREGPT_TRAIN, first_user_turn, iter_json_array, sharegpt_path  # noqa: E402
from specserve.engine import LLM  # noqa: E402
from specserve.kv_pages import KVGeometry, KVPool  # noqa: E402
from specserve.loader.tokenizer import chat_token_ids  # noqa: E402
from specserve.models.llama import LlamaModel  # noqa: E402
from specserve.types import SamplingParams  # noqa: E402


def held_out_answers(count: int, tokenizer, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(chat prompt ids, answer ids) of the first `count` usable ShareGPT conversations after the training ones
    whose second turn is the assistant's and whose prompt + answer fit in `max_tokens`."""
    usable = 0
    out = []
    for record in iter_json_array(sharegpt_path()):
        if (question := first_user_turn(record)) is None:
            continue
        usable += 1
        turns = record.get("conversations") or []
        if usable <= SHAREGPT_TRAIN or len(turns) < 2 or turns[1].get("from") != "gpt" or not turns[1]["value"]:
            continue
        prompt = chat_token_ids(tokenizer, [{"role": "user", "content": question}])
        answer = tokenizer.encode(turns[1]["value"], add_special_tokens=False)
        if len(prompt) + len(answer) <= max_tokens and len(answer) >= 16:
            out.append((prompt, answer))
            if len(out) == count:
                break
    return out


@torch.inference_mode()
def all_logits(model: LlamaModel, ids: list[int], kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # → [len(ids), vocab], attention as the engine serves it (the row-invariant kernel for float32/float16/int8 KV)
    page = 16
    pool = KVPool(KVGeometry.of(model.config, kv_dtype), -(-len(ids) // page), page)
    meta = AttentionMetadata.for_pool([SeqSpan(list(range(pool.num_pages)), 0, len(ids))], pool)
    hidden, _ = model.forward(torch.tensor(ids), torch.arange(len(ids)), meta, pool)
    return model.logits(hidden)


def answer_nll(model: LlamaModel, prompt: list[int], answer: list[int],
               kv_dtype: torch.dtype = torch.float32) -> tuple[float, int]:
    """Summed negative log-likelihood of the answer tokens and their count."""
    logits = all_logits(model, prompt + answer, kv_dtype)[len(prompt) - 1:-1]
    return float(torch.nn.functional.cross_entropy(logits.double(), torch.tensor(answer), reduction="sum")), len(answer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--texts", type=int, default=50)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=768)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    llms = {q: LLM(args.model_path, quantization=q, disable_radix_cache=True) for q in ("none", "int8")}
    tokenizer = llms["none"].tokenizer
    texts = held_out_answers(args.texts, tokenizer, args.max_tokens)
    variants = {"none": ("none", torch.float32), "int8": ("int8", torch.float32), "int8_kv16": ("int8", torch.float16),
                "int8_kv8": ("int8", torch.int8)}
    nll = {v: [0.0, 0] for v in variants}
    for prompt, answer in tqdm(texts, desc="NLL"):
        for v, (q, kv_dtype) in variants.items():
            total, count = answer_nll(llms[q].engine.model, prompt, answer, kv_dtype)
            nll[v][0] += total
            nll[v][1] += count

    prompts = [chat_token_ids(tokenizer, [{"role": "user", "content": p}]) for p in
               islice((CHAT_PROMPTS * 4), args.prompts)]
    prompts = list({tuple(p): p for p in prompts}.values())
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    reference = llms["none"].generate(prompts, params)
    free = llms["int8"].generate(prompts, params)
    forced_same = forced_total = prefix = 0
    for prompt, ref, got in tqdm(list(zip(prompts, reference, free)), desc="greedy"):
        logits = all_logits(llms["int8"].engine.model, prompt + ref.token_ids)[len(prompt) - 1:-1]
        forced_same += int((logits.argmax(-1) == torch.tensor(ref.token_ids)).sum())
        forced_total += len(ref.token_ids)
        prefix += next((i for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)) if a != b), len(ref.token_ids))

    mean = {q: total / count for q, (total, count) in nll.items()}
    summary = {
        "nll_fp32": round(mean["none"], 5), "nll_int8": round(mean["int8"], 5),
        "ppl_fp32": round(math.exp(mean["none"]), 4), "ppl_int8": round(math.exp(mean["int8"]), 4),
        "nll_int8_over_fp32": round(mean["int8"] / mean["none"], 5),
        "nll_int8_kv16": round(mean["int8_kv16"], 5),
        "nll_int8_kv16_over_fp32": round(mean["int8_kv16"] / mean["none"], 5),
        "nll_int8_kv8": round(mean["int8_kv8"], 5),
        "nll_int8_kv8_over_fp32": round(mean["int8_kv8"] / mean["none"], 5),
        "greedy_agreement_teacher_forced": round(forced_same / forced_total, 4),
        "greedy_common_prefix_mean": round(prefix / len(prompts), 2),
    }
    details = {"config": {**vars(args), "texts_used": len(texts), "answer_tokens": nll["none"][1],
                          "prompts_used": len(prompts)}}
    path = write_result("quant_quality", summary, details)
    for key, value in summary.items():
        print(f"{key:34s} {value}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
