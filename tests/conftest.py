"""Shared fixtures: a tiny random Llama/Qwen model with a byte-level tokenizer, built in memory."""
from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from specserve.config import ModelConfig
from specserve.engine import LLM
from specserve.loader import LoadedCheckpoint
from specserve.loader.safetensors import hf_config
from specserve.train.data import Example
from specserve.types import SamplingParams

# Tiny-model ops are dominated by thread handoff: one thread is ~100x faster when the machine is busy.
torch.set_num_threads(1)

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_checkpoint(arch: str = "llama", num_layers: int = 2, hidden: int = 64, seed: int = 0,
                    dtype: torch.dtype = torch.float64, max_positions: int = 512) -> LoadedCheckpoint:
    """A random model; its weights are scaled up so greedy outputs are far from ties."""
    tokenizer = byte_tokenizer()
    vocab = len(tokenizer)
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
              rms_norm_eps=1e-6, rope_theta=10000.0, eos_token_id=vocab - 1)
    torch.manual_seed(seed)
    if arch == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw, tie_word_embeddings=True))
    else:
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw, tie_word_embeddings=False))
    weights = {k: v.detach().to(dtype) for k, v in hf.state_dict().items()}
    for k, v in weights.items():
        if k.endswith("proj.weight") or k.endswith("embed_tokens.weight") or k == "lm_head.weight":
            v.mul_(4.0)
        elif k.endswith("bias"):
            v.normal_(0, 0.1)
    config = ModelConfig(arch, vocab, hidden, 2 * hidden, num_layers, 4, 2, hidden // 4, 1e-6, 10000.0,
                         max_positions, arch == "llama", arch == "qwen2", False, None, (vocab - 1,), f"tiny-{arch}")
    return LoadedCheckpoint(config=config, weights=weights, tokenizer=tokenizer, source=f"tiny-{arch}")


def save_hf_folder(ckpt: LoadedCheckpoint, folder: Path, dtype: torch.dtype | None = None) -> Path:
    """Write a checkpoint as a Hugging Face folder (config.json, model.safetensors, tokenizer) for --model-path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(ckpt.config)))
    save_file({k: (v if dtype is None else v.to(dtype)).contiguous() for k, v in ckpt.weights.items()},
              str(folder / "model.safetensors"))
    ckpt.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama() -> LoadedCheckpoint:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_qwen() -> LoadedCheckpoint:
    return tiny_checkpoint("qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_answers(tiny_llama) -> list[Example]:
    """The tiny target's own greedy answers to random prompts (drafter training data)."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 10, (40,), generator=gen).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    llm = LLM(checkpoint=tiny_llama, dtype="float64", page_size=4, num_pages=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=32))
    return [Example(f"e{i}", p, o.token_ids) for i, (p, o) in enumerate(zip(prompts, outs))]
