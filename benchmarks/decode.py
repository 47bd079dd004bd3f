"""Plain greedy decoding: specserve vs transformers `generate` on the same SmolLM2 weights, batch 1 and 8,
measured side by side in one run. Writes benchmarks/results/decode.json.

    .venv/bin/python benchmarks/decode.py [--max-new-tokens 128] [--repeats 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import transformers
from tqdm import tqdm

from benchmarks.common import CHAT_PROMPTS as PROMPTS
from benchmarks.common import write_result
from specserve.engine import LLM
from specserve.loader.safetensors import hf_config
from specserve.loader.tokenizer import chat_token_ids
from specserve.types import SamplingParams


def hf_model(llm: LLM) -> transformers.PreTrainedModel:
    from specserve.loader import load_checkpoint
    ckpt = load_checkpoint(llm.engine.config.model_path, torch.float32)
    config = transformers.LlamaConfig(**hf_config(ckpt.config))
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict(ckpt.weights, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def time_ours(llm: LLM, batch: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(batch, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed, [o.token_ids for o in outs]


@torch.inference_mode()
def time_hf(model, tokenizer, batch: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    width = max(len(b) for b in batch)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(b)) + b for b in batch])
    mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=pad)
    elapsed = time.perf_counter() - start
    return len(batch) * new_tokens / elapsed, out[:, width:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="best of N timings per cell")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    llm = LLM()
    model = hf_model(llm)
    tokenizer = llm.tokenizer
    prompts = [chat_token_ids(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    time_ours(llm, prompts[:1], 8)          # warm-up both
    time_hf(model, tokenizer, prompts[:1], 8)

    rows = {}
    cells = [(engine, bs) for bs in (1, 8) for engine in ("specserve", "transformers")]
    for engine, bs in tqdm(cells, desc="decode benchmark"):
        batch = prompts[:bs]
        best, tokens = 0.0, None
        for _ in range(args.repeats):
            rate, tokens = (time_ours(llm, batch, args.max_new_tokens) if engine == "specserve"
                            else time_hf(model, tokenizer, batch, args.max_new_tokens))
            best = max(best, rate)
        rows[f"{engine}_b{bs}"] = {"tokens_per_s": round(best, 2), "first_tokens": tokens[0][:16]}
    same_b1 = rows["specserve_b1"]["first_tokens"] == rows["transformers_b1"]["first_tokens"]
    summary = {
        "speedup_vs_hf_b1": round(rows["specserve_b1"]["tokens_per_s"] / rows["transformers_b1"]["tokens_per_s"], 3),
        "speedup_vs_hf_b8": round(rows["specserve_b8"]["tokens_per_s"] / rows["transformers_b8"]["tokens_per_s"], 3),
        "specserve_b1_tokens_per_s": rows["specserve_b1"]["tokens_per_s"],
        "specserve_b8_tokens_per_s": rows["specserve_b8"]["tokens_per_s"],
        "transformers_b1_tokens_per_s": rows["transformers_b1"]["tokens_per_s"],
        "transformers_b8_tokens_per_s": rows["transformers_b8"]["tokens_per_s"],
        "same_first_tokens_b1": same_b1,
    }
    print(f"{'batch':>5} {'specserve tok/s':>16} {'transformers tok/s':>19} {'ratio':>6}")
    for bs in (1, 8):
        ours, theirs = rows[f"specserve_b{bs}"]["tokens_per_s"], rows[f"transformers_b{bs}"]["tokens_per_s"]
        print(f"{bs:>5} {ours:>16.1f} {theirs:>19.1f} {ours / theirs:>6.2f}")
    path = write_result("decode", summary, {"config": vars(args), "rows": rows, "model": "SmolLM2-135M-Instruct Q4_1 → fp32"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
