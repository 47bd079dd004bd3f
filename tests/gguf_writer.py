"""Tiny GGUF files written the way llama.cpp's converter writes them, for the loader tests."""
from pathlib import Path

import gguf
import numpy as np
import torch

from specserve.config import ModelConfig
from specserve.loader import LoadedCheckpoint, expected_weight_names

Q = gguf.GGMLQuantizationType
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(33, 127)] + ["he", "ll"]
MERGES = ["h e", "l l"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
GGUF_PARTS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
}


def tiny_config(arch: str) -> ModelConfig:
    # Sizes are multiples of 256 so that K-quant blocks fit every matrix row.
    heads, head_dim = (8, 64) if arch == "qwen3" else (4, 64)  # qwen3: head_dim != hidden / heads
    return ModelConfig(architecture=arch, vocab_size=len(TOKENS), hidden_size=256, intermediate_size=512,
                       num_layers=2, num_heads=heads, num_kv_heads=2, head_dim=head_dim, rms_norm_eps=1e-6,
                       rope_theta=50000.0, max_position_embeddings=1024, tie_word_embeddings=arch == "llama",
                       qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3", bos_token_id=1, eos_token_ids=(2,),
                       name=f"tiny-{arch}")


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"embed_tokens": (config.vocab_size, h), "lm_head": (config.vocab_size, h), "q_proj.weight": (q, h),
              "k_proj.weight": (kv, h), "v_proj.weight": (kv, h), "o_proj.weight": (h, q),
              "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
              "gate_proj": (config.intermediate_size, h), "up_proj": (config.intermediate_size, h),
              "down_proj": (h, config.intermediate_size), "q_norm": (config.head_dim,), "k_norm": (config.head_dim,)}
    weights = {}
    for name in sorted(expected_weight_names(config)):
        shape = next((s for k, s in shapes.items() if k in name), (h,))
        weights[name] = torch.randn(shape, generator=g)
    return weights


def gguf_name(hf_name: str) -> str:
    stem, _, kind = hf_name.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, layer, part = stem.split(".", 3)
        return f"blk.{layer}.{GGUF_PARTS[part]}.{kind}"
    return f"{GGUF_PARTS[stem]}.{kind}"


def llama_cpp_permute(rows: np.ndarray, n_heads: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf does to llama q/k: split each head's rows into the two
    # rotary halves and interleave them.
    return rows.reshape(n_heads, 2, rows.shape[0] // n_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def encode(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Stored form of `w` (rows kept in order). gguf cannot quantize K-quants, so those get random
    blocks with sane scales instead; the expected values are then the dequantized blocks."""
    if qtype == Q.Q4_K:
        blocks = rng.integers(0, 256, (w.shape[0], w.shape[1] // 256, 144), dtype=np.uint8)
        blocks[..., :4] = np.array([0.01, 0.02], np.float16).view(np.uint8)  # d, dmin
        return blocks.reshape(w.shape[0], -1)
    if qtype == Q.Q6_K:
        blocks = rng.integers(0, 256, (w.shape[0], w.shape[1] // 256, 210), dtype=np.uint8)
        blocks[..., 208:] = np.array([0.01], np.float16).view(np.uint8)  # d
        return blocks.reshape(w.shape[0], -1)
    return gguf.quants.quantize(w, qtype)


def write_gguf(path: Path, config: ModelConfig, weights: dict[str, torch.Tensor], qtype: Q = Q.F32,
               arch: str | None = None) -> dict[str, torch.Tensor]:
    """Writes a GGUF the way llama.cpp would and returns the weights a loader should read back."""
    arch = arch or config.architecture
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(config.name)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(TOKENS) - 3))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_ids[0])
    writer.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(0)
    expected = {}
    for name, w in weights.items():
        array = w.numpy()
        stored = encode(array, qtype, rng) if array.ndim == 2 else array
        raw = qtype if array.ndim == 2 else Q.F32
        expected[name] = torch.from_numpy(gguf.quants.dequantize(stored, raw).copy())
        if arch == "llama" and ".q_proj." in name:
            stored = llama_cpp_permute(stored, config.num_heads)
        elif arch == "llama" and ".k_proj." in name:
            stored = llama_cpp_permute(stored, config.num_kv_heads)
        writer.add_tensor(gguf_name(name), stored, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def make_tiny_gguf(path: Path, arch: str = "llama", qtype: Q = Q.F32) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config = tiny_config(arch)
    weights = random_weights(config)
    expected = write_gguf(path, config, weights, qtype)
    return config, expected


def assert_same_weights(ckpt: LoadedCheckpoint, expected: dict[str, torch.Tensor]) -> None:
    assert ckpt.weights.keys() == expected.keys()
    for name, w in expected.items():
        assert ckpt.weights[name].shape == w.shape, name
        assert torch.equal(ckpt.weights[name], w.to(ckpt.weights[name].dtype)), name
