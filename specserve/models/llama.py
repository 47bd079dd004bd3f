"""Llama-family decoder (Llama, SmolLM, Qwen2 with QKV bias, Qwen3 with qk-norm) over paged KV.
Fused QKV and gate/up projections keep the op count low: at batch 1 on a CPU, overhead is half the step."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.attention.sdpa import AttentionMetadata, paged_attention
from specserve.config import ModelConfig
from specserve.kv_pages import KVPool
from specserve.models.layers import Linear, Rope, apply_rope, make_linear, rms_norm
from specserve.quantization import Int8Linear


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor        # [hidden]
    qkv: Linear | Int8Linear        # hidden → (heads + 2 * kv_heads) * head_dim, bias for Qwen2
    q_norm: torch.Tensor | None     # [head_dim]
    k_norm: torch.Tensor | None
    o: Linear | Int8Linear          # heads * head_dim → hidden
    post_norm: torch.Tensor         # [hidden]
    gate_up: Linear | Int8Linear    # hidden → 2 * intermediate
    down: Linear | Int8Linear       # intermediate → hidden


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 shared_head: Linear | Int8Linear | None = None, quantization: str = "none") -> None:
        """`shared_head`: use another model's vocabulary projection (drafters share the target's).
        `quantization`: "int8" makes every linear, the vocabulary projection included, an Int8Linear."""
        self.config = config
        self.dtype = dtype
        self.quantization = quantization

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint for {config.name or config.architecture} is missing tensor {name}")
            return weights[name].to(dtype)

        self.embed = w("model.embed_tokens.weight")                       # [vocab, hidden]
        if shared_head is None:
            shared_head = make_linear(self.embed if config.tie_word_embeddings else w("lm_head.weight"),
                                      quantization=quantization, plain_single_row=True)
        self.head = shared_head
        self.final_norm = w("model.norm.weight")
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            bias = (torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if config.qkv_bias else None)
            self.layers.append(DecoderLayer(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=make_linear(qkv, bias, quantization),
                q_norm=w(p + "self_attn.q_norm.weight") if config.qk_norm else None,
                k_norm=w(p + "self_attn.k_norm.weight") if config.qk_norm else None,
                o=make_linear(w(p + "self_attn.o_proj.weight"), quantization=quantization),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=make_linear(torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                                    quantization=quantization),
                down=make_linear(w(p + "mlp.down_proj.weight"), quantization=quantization),
            ))
        self.rope = Rope(config.head_dim, config.rope_theta, config.max_position_embeddings, dtype)
        self.scale = config.head_dim ** -0.5

    def row_weights(self) -> int:
        """Weights one token's row multiplies through in a forward, the vocabulary projection included."""
        return self.head.num_weights + sum(layer.qkv.num_weights + layer.o.num_weights + layer.gate_up.num_weights
                                           + layer.down.num_weights for layer in self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, pool: KVPool,
                aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids, positions: [num_tokens] → final-normed hidden [num_tokens, hidden] and the
        residual stream after each layer in `aux_layer_ids` ([num_tokens, hidden] each)."""
        return self.forward_embeds(self.embed[input_ids], positions, meta, pool, aux_layer_ids)

    def forward_embeds(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, pool: KVPool,
                       aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward` from input vectors x: [num_tokens, hidden] instead of token ids (EAGLE's inputs
        mix the token embedding with a feature)."""
        c = self.config
        cos, sin = self.rope.tables(positions)
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        aux = []
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, c.rms_norm_eps)
            qkv = layer.qkv(h)
            # Q and K heads side by side: one rotary call for both (at batch 8 the small ops are a third
            # of the step)
            qk = qkv[:, :q_size + kv_size].view(-1, c.num_heads + c.num_kv_heads, c.head_dim)
            v = qkv[:, q_size + kv_size:].view(-1, c.num_kv_heads, c.head_dim)
            if layer.q_norm is not None:
                qk = torch.cat([rms_norm(qk[:, :c.num_heads], layer.q_norm, c.rms_norm_eps),
                                rms_norm(qk[:, c.num_heads:], layer.k_norm, c.rms_norm_eps)], dim=1)
            qk = apply_rope(qk, cos, sin)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            x = x + layer.o(paged_attention(q, k, v, i, pool, meta, self.scale))
            h = rms_norm(x, layer.post_norm, c.rms_norm_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
            if i in aux_layer_ids:
                aux.append(x)
        return rms_norm(x, self.final_norm, c.rms_norm_eps), aux

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_rows, hidden] → [num_rows, vocab]
        return self.head(hidden)
