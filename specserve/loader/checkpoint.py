"""What every loader returns (LoadedCheckpoint), the error every loader raises, and the tensor names a
supported architecture must provide."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specserve.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")


class ModelLoadError(ValueError):
    """A model could not be found or read; the message names the problem and the fix."""

    def __init__(self, message: str):
        # Wrapped library errors often span lines; callers print this as one line.
        super().__init__(" ".join(message.split()))


@dataclass
class LoadedCheckpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: PreTrainedTokenizerBase
    source: str
    quantized: bool = False        # the source stores quantized weights (a GGUF's Q4_*, Q8_0, K-quants)


def expected_weight_names(config: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_layers):
        layer = f"model.layers.{i}"
        names |= {f"{layer}.self_attn.{p}_proj.weight" for p in "qkvo"}
        names |= {f"{layer}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        names |= {f"{layer}.input_layernorm.weight", f"{layer}.post_attention_layernorm.weight"}
        if config.qkv_bias:
            names |= {f"{layer}.self_attn.{p}_proj.bias" for p in "qkv"}
        if config.qk_norm:
            names |= {f"{layer}.self_attn.{p}_norm.weight" for p in "qk"}
    return names


def check_weight_names(weights: dict[str, torch.Tensor], config: ModelConfig, source: str) -> None:
    missing = sorted(expected_weight_names(config) - weights.keys())
    if missing:
        raise ModelLoadError(f"{source} lacks {len(missing)} tensors (e.g. {missing[0]}); "
                             "the checkpoint is incomplete or not a supported architecture")
