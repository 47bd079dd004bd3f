"""specserve against its peers on the same prompts and machine, batch 1, greedy, 2 threads, one run:
- SmolLM2-135M-Instruct (the embedded Q4_1 GGUF): transformers `generate` plain and with
  `prompt_lookup_num_tokens`, llama.cpp (llama-cpp-python, native Q4_1) plain and with its prompt-lookup
  draft; ours plain (int8, the default for this GGUF, and float32), NGRAM and DSPARK as shipped (int8).
- Qwen2.5-Coder 1.5B target + 0.5B draft: transformers with `assistant_model`, llama.cpp plain and with the
  0.5B model drafting; ours plain (int8 and float32), STANDALONE and NGRAM (int8).
llama-cpp-python is built from source and only for this benchmark: `make peers` installs it and runs this.

    python benchmarks/peers.py
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.common import CHAT_PROMPTS, write_result  # noqa: E402
from specserve.datasets import humaneval_prompts  # noqa: E402
from specserve.drafters import embedded_pair  # noqa: E402
from specserve.engine import LLM  # noqa: E402
from specserve.loader import default_model_path, load_checkpoint  # noqa: E402
from specserve.loader.fetch import fetch_model  # noqa: E402
from specserve.loader.safetensors import hf_config  # noqa: E402
from specserve.loader.tokenizer import chat_token_ids  # noqa: E402
from specserve.types import SamplingParams  # noqa: E402

HF_CLASSES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
              "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}
Generate = Callable[[list[int], int], int]     # prompt ids, max new tokens → tokens generated


def measure(label: str, prompts: list[list[int]], new_tokens: int, generate: Generate) -> dict:
    generate(prompts[0], 4)                                   # warm-up, untimed
    tokens, seconds = 0, 0.0
    for ids in tqdm(prompts, desc=label, unit="prompt"):
        start = time.perf_counter()
        tokens += generate(ids, new_tokens)
        seconds += time.perf_counter() - start
    return {"tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 2)}


# ---- transformers -------------------------------------------------------------------------------------

def hf_model(path: str) -> transformers.PreTrainedModel:
    ckpt = load_checkpoint(path, torch.float32)
    config_cls, model_cls = HF_CLASSES[ckpt.config.architecture]
    model = model_cls(config_cls(**hf_config(ckpt.config))).eval()
    model.load_state_dict(ckpt.weights, strict=False)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model


def hf_generate(model, eos: list[int], **extra) -> Generate:
    @torch.inference_mode()
    def generate(ids: list[int], new_tokens: int) -> int:
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                             **extra)
        return out.shape[1] - len(ids)
    return generate


# ---- llama.cpp ------------------------------------------------------------------------------------------

def llamacpp(path: str, threads: int, draft=None):
    from llama_cpp import Llama

    return Llama(model_path=path, n_ctx=4096, n_threads=threads, n_threads_batch=threads, n_batch=512,
                 verbose=False, draft_model=draft)


def llamacpp_generate(llm) -> Generate:
    def generate(ids: list[int], new_tokens: int) -> int:
        out = llm.create_completion(prompt=ids, max_tokens=new_tokens, temperature=0.0, top_k=1)
        return out["usage"]["completion_tokens"]
    return generate


def small_model_draft(path: str, threads: int, num_drafts: int):
    """A llama-cpp-python draft model: the 0.5B model continues the sequence greedily for num_drafts tokens,
    reusing its KV for the prefix it has already seen."""
    from llama_cpp.llama_speculative import LlamaDraftModel

    class SmallModelDraft(LlamaDraftModel):
        def __init__(self) -> None:
            self.llm = llamacpp(path, threads)

        def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
            drafts = []
            for token in self.llm.generate(input_ids.tolist(), temp=0.0, top_k=1, reset=True):
                drafts.append(token)
                if len(drafts) == num_drafts:
                    break
            return np.array(drafts, dtype=np.intc)

    return SmallModelDraft()


# ---- ours -------------------------------------------------------------------------------------------------

def ours(model_path: str | None, threads: int, **engine_args) -> tuple[LLM, Generate]:
    llm = LLM(model_path, num_threads=threads, disable_radix_cache=True, **engine_args)

    def generate(ids: list[int], new_tokens: int) -> int:
        return len(llm.generate([ids], SamplingParams(temperature=0.0, max_new_tokens=new_tokens))[0].token_ids)
    return llm, generate


def smollm2(args: argparse.Namespace) -> dict:
    path = default_model_path()
    rows = {}
    llm, gen = ours(None, args.threads)
    prompts = [chat_token_ids(llm.tokenizer, [{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:args.num_prompts]]
    eos = [llm.tokenizer.eos_token_id]
    rows["specserve plain"] = measure("specserve plain", prompts, args.max_new_tokens, gen)
    del llm
    llm, gen = ours(None, args.threads, quantization="none")
    rows["specserve plain float32"] = measure("specserve plain float32", prompts, args.max_new_tokens, gen)
    del llm
    llm, gen = ours(None, args.threads, speculative_algorithm="NGRAM")
    rows["specserve NGRAM"] = measure("specserve NGRAM", prompts, args.max_new_tokens, gen)
    del llm
    llm, gen = ours(None, args.threads, **embedded_pair())
    rows["specserve DSPARK"] = measure("specserve DSPARK", prompts, args.max_new_tokens, gen)
    del llm
    gc.collect()
    model = hf_model(path)
    rows["transformers plain"] = measure("transformers plain", prompts, args.max_new_tokens, hf_generate(model, eos))
    rows["transformers prompt lookup"] = measure("transformers prompt lookup", prompts, args.max_new_tokens,
                                                 hf_generate(model, eos, prompt_lookup_num_tokens=args.lookup))
    del model
    gc.collect()
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    cpp = llamacpp(path, args.threads)
    rows["llama.cpp plain"] = measure("llama.cpp plain", prompts, args.max_new_tokens, llamacpp_generate(cpp))
    del cpp
    cpp = llamacpp(path, args.threads, LlamaPromptLookupDecoding(num_pred_tokens=args.lookup))
    rows["llama.cpp prompt lookup"] = measure("llama.cpp prompt lookup", prompts, args.max_new_tokens,
                                              llamacpp_generate(cpp))
    del cpp
    return rows


def qwen(args: argparse.Namespace) -> dict:
    target, draft = fetch_model("qwen2.5-coder-1.5b"), fetch_model("qwen2.5-coder-0.5b")
    rows = {}
    llm, gen = ours(target, args.threads)
    prompts = [chat_token_ids(llm.tokenizer, [{"role": "user", "content": p}])
               for p in humaneval_prompts(args.qwen_prompts)]
    eos = sorted({llm.tokenizer.eos_token_id, *llm.engine.model_config.eos_token_ids})
    rows["specserve plain"] = measure("qwen specserve plain", prompts, args.qwen_new_tokens, gen)
    del llm
    llm, gen = ours(target, args.threads, quantization="none")
    rows["specserve plain float32"] = measure("qwen specserve plain float32", prompts, args.qwen_new_tokens, gen)
    del llm
    llm, gen = ours(target, args.threads, speculative_algorithm="STANDALONE", speculative_draft_model_path=draft,
                    speculative_num_draft_tokens=args.draft_tokens)
    rows["specserve STANDALONE"] = measure("qwen specserve STANDALONE", prompts, args.qwen_new_tokens, gen)
    del llm
    llm, gen = ours(target, args.threads, speculative_algorithm="NGRAM")
    rows["specserve NGRAM"] = measure("qwen specserve NGRAM", prompts, args.qwen_new_tokens, gen)
    del llm
    gc.collect()
    model, assistant = hf_model(target), hf_model(draft)
    rows["transformers plain"] = measure("qwen transformers plain", prompts, args.qwen_new_tokens,
                                         hf_generate(model, eos))
    rows["transformers assistant_model"] = measure("qwen transformers assistant", prompts, args.qwen_new_tokens,
                                                   hf_generate(model, eos, assistant_model=assistant))
    del model, assistant
    gc.collect()
    cpp = llamacpp(target, args.threads)
    rows["llama.cpp plain"] = measure("qwen llama.cpp plain", prompts, args.qwen_new_tokens, llamacpp_generate(cpp))
    del cpp
    cpp = llamacpp(target, args.threads, small_model_draft(draft, args.threads, args.draft_tokens))
    rows["llama.cpp 0.5B draft"] = measure("qwen llama.cpp 0.5B draft", prompts, args.qwen_new_tokens,
                                           llamacpp_generate(cpp))
    del cpp
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=8, help="SmolLM2 chat prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--qwen-prompts", type=int, default=4, help="HumanEval prompts for the Qwen pair")
    parser.add_argument("--qwen-new-tokens", type=int, default=64)
    parser.add_argument("--lookup", type=int, default=8, help="prompt-lookup drafts per step (peers)")
    parser.add_argument("--draft-tokens", type=int, default=6, help="0.5B drafts per step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-qwen", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {"smollm2": smollm2(args)}
    if not args.skip_qwen:
        results["qwen"] = qwen(args)
    for model, rows in results.items():
        print(f"\n{model}")
        for label, row in rows.items():
            print(f"  {label:<30} {row['tokens_per_s']:>8.2f} tokens/s  ({row['tokens']} tokens)")
    s = {label: row["tokens_per_s"] for label, row in results["smollm2"].items()}
    summary = {"dspark_speedup_vs_plain_b1": round(s["specserve DSPARK"] / s["specserve plain"], 3),
               "dspark_vs_transformers_b1": round(s["specserve DSPARK"] / s["transformers plain"], 3),
               "dspark_vs_llamacpp_b1": round(s["specserve DSPARK"] / s["llama.cpp plain"], 3),
               "plain_vs_llamacpp_b1": round(s["specserve plain"] / s["llama.cpp plain"], 3),
               "int8_vs_float32_plain_b1": round(s["specserve plain"] / s["specserve plain float32"], 3)}
    if "qwen" in results:
        q = {label: row["tokens_per_s"] for label, row in results["qwen"].items()}
        best = max(q["specserve STANDALONE"], q["specserve NGRAM"])
        summary["best_spec_vs_llamacpp_qwen_b1"] = round(best / q["llama.cpp plain"], 3)
    print(summary)
    path = write_result("peers", summary, {"config": vars(args), "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
