"""Hugging Face folders (config.json + *.safetensors, single or sharded) → LoadedCheckpoint."""
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specserve.config import ModelConfig
from specserve.loader.checkpoint import LoadedCheckpoint, ModelLoadError, check_weight_names, expected_weight_names
from specserve.loader.tokenizer import load_tokenizer

_CLASSES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is corrupt ({e}); download the model again") from e


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    return () if value is None else (value,) if isinstance(value, int) else tuple(value)


def read_config(folder: Path) -> ModelConfig:
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder} has no config.json; pass a Hugging Face model folder or a GGUF file")
    cfg = _read_json(folder / "config.json")
    generation = folder / "generation_config.json"
    generation_eos = _read_json(generation).get("eos_token_id") if generation.is_file() else None
    model_class = (cfg.get("architectures") or ["<none>"])[0]
    if model_class not in _CLASSES:
        raise ModelLoadError(f"{folder}: architecture {model_class} is not supported; "
                             f"supported: {', '.join(_CLASSES)}")
    arch = _CLASSES[model_class]
    # transformers 5 writes rope_parameters; older folders have rope_theta and rope_scaling.
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ModelLoadError(f"{folder}: rope type {rope_type}, attention_bias or mlp_bias is not supported; "
                             "use a plain Llama/Qwen2/Qwen3 checkpoint")
    try:
        heads = cfg["num_attention_heads"]
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg["max_position_embeddings"],
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(_token_ids(cfg.get("eos_token_id")) + _token_ids(generation_eos))),
            name=cfg.get("_name_or_path") or folder.name,
        )
    except KeyError as e:
        raise ModelLoadError(f"{folder}/config.json lacks {e.args[0]}; download the model again") from e


def hf_config(config: ModelConfig) -> dict:
    """config.json contents that read_config (and transformers) turn back into `config`."""
    model_class = next(c for c, a in _CLASSES.items() if a == config.architecture)
    return {
        "architectures": [model_class],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids),
        "_name_or_path": config.name,
    }


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / f for f in sorted(set(_read_json(index).get("weight_map", {}).values()))]
    return sorted(folder.glob("*.safetensors"))


def load_folder(path: str | Path, dtype: torch.dtype = torch.float32) -> LoadedCheckpoint:
    folder = Path(path)
    config = read_config(folder)
    files = _weight_files(folder)
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights; download the model again")
    weights = {}
    for file in files:
        try:
            weights.update(load_file(file))
        except (OSError, SafetensorError) as e:
            raise ModelLoadError(f"{file} is missing, corrupt or truncated ({e}); download the model again") from e
    # Tied checkpoints may still carry lm_head.weight; rotary buffers and the like are not weights.
    expected = expected_weight_names(config)
    weights = {k: v.to(dtype) for k, v in weights.items() if k in expected}
    check_weight_names(weights, config, str(folder))
    return LoadedCheckpoint(config=config, weights=weights, tokenizer=load_tokenizer(folder), source=str(folder))
