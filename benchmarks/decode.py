"""Plain greedy decoding on the embedded SmolLM2-135M-Instruct, measured side by side in one run:
- specserve int8 (the default for this Q4_1 GGUF), specserve float32 and transformers `generate` (float32,
  the same dequantized weights) at batch 1 and 8;
- the int8 target's verify cost t(8 rows) / t(1 row) (one sequence's window, 128 tokens of context);
- decode speed at a 4,000-token context against a 100-token one, with the default float16 KV cache and with
  `--kv-cache-dtype int8` (measured in turns);
- where a batch-1 int8 step goes (torch.profiler: int8 matmuls, attention, other ops, and the interpreter,
  Python and dispatch around them), next to the time reading the int8 weights once takes at this machine's
  measured memory bandwidth.
Writes benchmarks/results/decode.json.

    .venv/bin/python benchmarks/decode.py [--max-new-tokens 128] [--repeats 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import transformers  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.common import CHAT_PROMPTS as PROMPTS  # noqa: E402
from benchmarks.common import write_result  # noqa: E402
from specserve.engine import LLM  # noqa: E402
from specserve.loader import load_checkpoint  # noqa: E402
from specserve.loader.safetensors import hf_config  # noqa: E402
from specserve.loader.tokenizer import chat_token_ids  # noqa: E402
from specserve.speculative.cost_table import measure_cost_table  # noqa: E402
from specserve.types import SamplingParams  # noqa: E402


def hf_model(llm: LLM) -> transformers.PreTrainedModel:
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


def decode_rate(llm: LLM, prompt: list[int], new_tokens: int) -> float:
    """Tokens per second after the first token (the prefill excluded)."""
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))
    while not any(out.token_ids for out in engine.step()):
        pass
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - start)


def bandwidth_gbs() -> float:
    """Bytes per second one pass over a 512 MB tensor reads, best of 5."""
    x = torch.ones(128 << 20)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def int8_weight_bytes(llm: LLM) -> int:
    model = llm.engine.model
    linears = [model.head] + [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return sum(lin.weight.numel() + 4 * lin.scale.numel() for lin in linears)


NATIVE_STACK = "decoder layers in the native stack (their int8 linears, attention, rotary and K/V writes)"


class ProfiledStack:
    """The native stack's one call as a profiler event: its kernels run without the dispatcher the profiler watches."""

    def __init__(self, stack: torch.ScriptObject) -> None:
        self.stack = stack

    def forward(self, *args):
        with torch.profiler.record_function(NATIVE_STACK):
            return self.stack.forward(*args)


def step_breakdown(llm: LLM, prompt: list[int], new_tokens: int, step_s: float) -> dict[str, float]:
    """Milliseconds per batch-1 decode step (`step_s`, measured unprofiled) in each part. torch.profiler takes each
    op's own CPU time while decoding (the native stack's call as one event; a scripted stack's ops one by one), the
    ops are grouped, and the shares are scaled to `step_s` (the profiler's per-op cost would inflate the rest).
    "Interpreter, Python and dispatch" is the part of the step that no op accounts for."""
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    model = llm.engine.model
    native = model.native_stack
    if native is not None:
        model.native_stack = ProfiledStack(native)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            llm.generate([prompt], params)
            profiled_s = time.perf_counter() - start
    finally:
        model.native_stack = native
    groups = {NATIVE_STACK: (NATIVE_STACK,),
              "int8 linears called as ops (the LM head; every linear where the stack is scripted)":
                  ("specserve::int8_linear",),
              "attention (the row-invariant kernel with rotary and K/V writes)": ("specserve::paged_attention_qkv",
                                                                                   "specserve::paged_attention_rows",
                                                                    "aten::index_copy_")}
    spent: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if not event.key.startswith(("aten::", "quantized::", "mkldnn::", "specserve::", NATIVE_STACK)):
            continue
        group = next((g for g, names in groups.items() if event.key in names),
                     "other ops (norms, rotary, scaling, casts)")
        spent[group] += event.self_cpu_time_total / 1e6
    spent["interpreter, Python and dispatch"] = profiled_s - sum(spent.values())
    scale = step_s / profiled_s
    return {k: round(v * scale * 1e3, 2) for k, v in spent.items()} | {"step": round(step_s * 1e3, 2)}


def step_and_read(llm: LLM, prompt: list[int], new_tokens: int, repeats: int) -> tuple[float, float]:
    """The batch-1 decode step (seconds, the prefill excluded) and the memory bandwidth (GB/s), measured in turns
    so that both see the same moments of a shared host, each the best of `repeats`."""
    step_s, gbs = float("inf"), 0.0
    for _ in range(repeats):
        step_s = min(step_s, 1 / decode_rate(llm, prompt, new_tokens))
        gbs = max(gbs, bandwidth_gbs())
    return step_s, gbs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="best of N timings per cell")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--long-context", type=int, default=4000)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    llms = {"int8": LLM(disable_radix_cache=True), "float32": LLM(quantization="none", disable_radix_cache=True)}
    model = hf_model(llms["float32"])
    tokenizer = llms["int8"].tokenizer
    prompts = [chat_token_ids(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    for llm in llms.values():
        time_ours(llm, prompts[:1], 8)                          # warm-up, untimed
    time_hf(model, tokenizer, prompts[:1], 8)

    rows = {}
    cells = [(engine, bs) for bs in (1, 8) for engine in ("specserve int8", "specserve float32", "transformers")]
    for engine, bs in tqdm(cells, desc="decode benchmark"):
        batch = prompts[:bs]
        best, tokens = 0.0, None
        for _ in range(args.repeats):
            rate, tokens = (time_hf(model, tokenizer, batch, args.max_new_tokens) if engine == "transformers"
                            else time_ours(llms[engine.split()[1]], batch, args.max_new_tokens))
            best = max(best, rate)
        rows[f"{engine}_b{bs}"] = {"tokens_per_s": round(best, 2), "first_tokens": tokens[0][:16]}
    del model

    int8 = llms["int8"]
    table = measure_cost_table(int8.engine.model, 16, rows=[1, 8], repeats=5, context=128, window=8,
                               kv_dtype=int8.engine.pool.geometry.dtype)
    filler = tokenizer.encode(" ".join(PROMPTS) * 200, add_special_tokens=False)
    short, long = [filler[:100], filler[:args.long_context]]
    kv8 = LLM(kv_cache_dtype="int8", disable_radix_cache=True)
    long_rates: dict[str, dict[str, float]] = {"float16": defaultdict(float), "int8": defaultdict(float)}
    for _ in tqdm(range(args.repeats), desc="long context"):
        for kv, llm in (("float16", int8), ("int8", kv8)):
            for n, p in (("100", short), (str(args.long_context), long)):
                long_rates[kv][n] = max(long_rates[kv][n], decode_rate(llm, p, 64))
    del kv8
    rates, rates8 = long_rates["float16"], long_rates["int8"]
    step_s, gbs = step_and_read(int8, prompts[0], args.max_new_tokens, max(args.repeats, 5))
    breakdown = step_breakdown(int8, prompts[0], args.max_new_tokens, step_s)
    weight_bytes = int8_weight_bytes(int8)
    read_ms = weight_bytes / gbs / 1e6

    r = {k: v["tokens_per_s"] for k, v in rows.items()}
    summary = {
        "int8_b1_tokens_per_s": r["specserve int8_b1"], "float32_b1_tokens_per_s": r["specserve float32_b1"],
        "transformers_b1_tokens_per_s": r["transformers_b1"],
        "int8_b8_tokens_per_s": r["specserve int8_b8"], "float32_b8_tokens_per_s": r["specserve float32_b8"],
        "transformers_b8_tokens_per_s": r["transformers_b8"],
        "int8_vs_float32_b1": round(r["specserve int8_b1"] / r["specserve float32_b1"], 3),
        "speedup_vs_hf_b1": round(r["specserve int8_b1"] / r["transformers_b1"], 3),
        "speedup_vs_hf_b8": round(r["specserve int8_b8"] / r["transformers_b8"], 3),
        "verify8_over_1": round(table.time(8) / table.time(1), 3),
        "ctx4k_over_ctx100": round(rates[str(args.long_context)] / rates["100"], 3),
        "decode_tokens_per_s_ctx100": round(rates["100"], 2),
        f"decode_tokens_per_s_ctx{args.long_context}": round(rates[str(args.long_context)], 2),
        "ctx4k_over_ctx100_kv_int8": round(rates8[str(args.long_context)] / rates8["100"], 3),
        "decode_tokens_per_s_ctx100_kv_int8": round(rates8["100"], 2),
        f"decode_tokens_per_s_ctx{args.long_context}_kv_int8": round(rates8[str(args.long_context)], 2),
        "step_ms_b1": breakdown["step"], "int8_weight_read_ms": round(read_ms, 2),
        "step_over_weight_read": round(breakdown["step"] / read_ms, 2),
        "same_first_tokens_float32_vs_hf_b1": rows["specserve float32_b1"]["first_tokens"] ==
                                                rows["transformers_b1"]["first_tokens"],
    }
    print(f"{'batch':>5} {'int8 tok/s':>11} {'float32 tok/s':>14} {'transformers tok/s':>19}")
    for bs in (1, 8):
        print(f"{bs:>5} {r[f'specserve int8_b{bs}']:>11.1f} {r[f'specserve float32_b{bs}']:>14.1f} "
              f"{r[f'transformers_b{bs}']:>19.1f}")
    print("step breakdown (ms):", breakdown)
    print(summary)
    details = {"config": vars(args), "rows": rows, "step_breakdown_ms": breakdown,
               "int8_weight_bytes": weight_bytes, "read_bandwidth_gb_s": round(gbs, 2),
               "verify_cost_table_s": dict(zip(table.rows, table.seconds)),
               "model": "SmolLM2-135M-Instruct Q4_1 GGUF → int8 (default) or float32"}
    path = write_result("decode", summary, details)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
