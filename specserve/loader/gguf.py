"""GGUF files (llama.cpp) → config and dequantized weights under Hugging Face names and layouts."""
from pathlib import Path

import gguf
import numpy as np
import torch

from specserve.config import ModelConfig
from specserve.loader.checkpoint import SUPPORTED_ARCHITECTURES, LoadedCheckpoint, ModelLoadError, check_weight_names
from specserve.loader.tokenizer import load_tokenizer

_LAYER_PARTS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_PARTS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_REQUIRED = object()


def hf_name(gguf_name: str) -> str | None:
    stem, _, kind = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_PARTS[part]}.{kind}" if part in _LAYER_PARTS else None
    return f"{_GLOBAL_PARTS[stem]}.{kind}" if stem in _GLOBAL_PARTS else None


def unpermute_rotary_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp's converter reorders each llama head's q/k rows from HF's half-split rotary layout
    # (x0..x(d/2-1), y0..) to interleaved pairs (x0, y0, x1, y1, ..); put them back.
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def open_reader(path: str) -> gguf.GGUFReader:
    # The reader indexes a memmap of the raw bytes, so damage surfaces as assorted numpy errors.
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        raise ModelLoadError(f"{path} is corrupt or truncated ({type(e).__name__}: {e}); "
                             "download or fetch it again") from e


def read_config(reader: gguf.GGUFReader, path: str) -> ModelConfig:
    def meta(key: str, default=_REQUIRED):
        field = reader.fields.get(key)
        if field is not None:
            return field.contents()
        if default is _REQUIRED:
            raise ModelLoadError(f"{path} lacks GGUF metadata {key}; the file is incomplete, convert it again")
        return default

    arch = meta("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{path}: architecture {arch!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if (scaling := meta(f"{arch}.rope.scaling.type", "none")) != "none":
        raise ModelLoadError(f"{path}: rope scaling {scaling!r} is not supported; use a model without rope scaling")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path} has no token_embd.weight tensor; the file is incomplete, convert it again")
    hidden, heads = meta(f"{arch}.embedding_length"), meta(f"{arch}.attention.head_count")
    eos = (meta("tokenizer.ggml.eos_token_id", None), meta("tokenizer.ggml.eot_token_id", None))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),  # GGUF shapes are reversed: [hidden, vocab]
        hidden_size=hidden,
        intermediate_size=meta(f"{arch}.feed_forward_length"),
        num_layers=meta(f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=meta(f"{arch}.attention.head_count_kv", heads),
        head_dim=meta(f"{arch}.attention.key_length", hidden // heads),
        # GGUF stores float32; its shortest decimal keeps configs readable (1e-05, not 9.99999974e-06).
        rms_norm_eps=float(str(np.float32(meta(f"{arch}.attention.layer_norm_rms_epsilon")))),
        rope_theta=float(meta(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=meta(f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        bos_token_id=meta("tokenizer.ggml.bos_token_id", None),
        eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
        name=meta("general.name", Path(path).stem),
    )


def read_weights(reader: gguf.GGUFReader, config: ModelConfig, path: str,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    weights = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise ModelLoadError(f"{path}: unexpected tensor {t.name} for architecture {config.architecture}; "
                                 "this model variant is not supported")
        try:
            array = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which gguf cannot "
                                 "dequantize; use a file with another quantization") from e
        weight = torch.tensor(array, dtype=dtype)
        if config.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = unpermute_rotary_rows(weight, config.num_heads)
        elif config.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = unpermute_rotary_rows(weight, config.num_kv_heads)
        weights[name] = weight
    check_weight_names(weights, config, path)
    return weights


def load_gguf(path: str, dtype: torch.dtype = torch.float32) -> LoadedCheckpoint:
    reader = open_reader(path)
    config = read_config(reader, path)
    weights = read_weights(reader, config, path, dtype)
    return LoadedCheckpoint(config=config, weights=weights, tokenizer=load_tokenizer(path), source=path,
                            quantized=is_quantized(reader))


def is_quantized(reader: gguf.GGUFReader) -> bool:
    """Whether any matrix is stored in a quantized type (not F32, F16 or BF16)."""
    plain = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    return any(t.tensor_type not in plain for t in reader.tensors)
