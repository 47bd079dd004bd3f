"""EAGLE (chain, topk=1): one Llama decoder layer running autoregressively over target features.

A target feature is the target's residual stream after `target_layer_ids`, concatenated per token and
fused by `fc` (K·H → H), as in EAGLE-3. The row at position p pairs token p with the feature of
position p - 1 (zeros at p = 0; training must do the same): `input_proj` maps
[embed(token_p) ; feature_{p-1}] (2H → H), as in EAGLE-1, and the decoder layer (RoPE at p, its K/V in
the draft pool) turns that into its output residual h_p. The target's LM head over norm(h_p) predicts
token p + 1, and h_p stands in for the target's feature of p when the next draft row is fed.
Embedding and LM head are the target's, shared, not stored.

The checkpoint is a folder: config.json (the fields of EagleConfig plus "algorithm": "EAGLE") and
model.safetensors in Hugging Face layout ([out, in] weights; the layer is `model.layers.0.*`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

from specserve.attention.sdpa import AttentionMetadata
from specserve.config import ModelConfig
from specserve.kv_pages import KVGeometry, KVPool
from specserve.loader import ModelLoadError
from specserve.models.drafter_checkpoint import (
    check_fits_target,
    config_from_json,
    default_layer_ids,
    read_drafter_folder,
    save_drafter_folder,
)
from specserve.models.layers import Linear, Rope, make_linear, rms_norm
from specserve.models.llama import LlamaModel
from specserve.native.ops import apply_rope

ALGORITHM = "EAGLE"


@dataclass(frozen=True)
class EagleConfig:
    target_layer_ids: tuple[int, ...]     # target layers whose output forms the feature, increasing
    hidden_size: int                      # = the target's: the embedding and LM head are shared
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_name: str
    target_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    algorithm: ClassVar[str] = ALGORITHM

    def to_json(self) -> dict:
        return {"algorithm": ALGORITHM, **dataclasses.asdict(self)}

    @staticmethod
    def from_json(data: dict, source: str) -> EagleConfig:
        if data.get("algorithm") != ALGORITHM:
            raise ModelLoadError(f"{source} is not an EAGLE checkpoint (its config.json has algorithm "
                                 f"{data.get('algorithm')!r}, expected {ALGORITHM!r})")
        return config_from_json(EagleConfig, data, source)


def weight_shapes(c: EagleConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint and its Hugging Face shape."""
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    p = "model.layers.0."
    return {"fc.weight": (h, len(c.target_layer_ids) * h), "input_proj.weight": (h, 2 * h),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (c.intermediate_size, h), p + "mlp.up_proj.weight": (c.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, c.intermediate_size),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,), "model.norm.weight": (h,)}


@dataclass
class EagleCheckpoint:
    config: EagleConfig
    weights: dict[str, torch.Tensor]      # Hugging Face layout
    source: str = ""

    def save(self, folder: str | Path) -> None:
        save_drafter_folder(folder, self.config.to_json(), self.weights)

    @staticmethod
    def load(folder: str | Path) -> EagleCheckpoint:
        config, weights = read_drafter_folder(folder, "an EAGLE checkpoint", EagleConfig.from_json)
        return EagleCheckpoint(config, weights, str(folder))

    def validate(self, target: ModelConfig) -> None:
        """Raise ModelLoadError at startup for anything that does not fit the target."""
        c = self.config
        check_fits_target(self.source or "the EAGLE drafter", target, target_name=c.target_name,
                          hidden_size=c.hidden_size, target_vocab_size=c.target_vocab_size,
                          target_layer_ids=c.target_layer_ids, weights=self.weights, shapes=weight_shapes(c))


def random_eagle(target: ModelConfig, *, target_layer_ids: tuple[int, ...] | None = None, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> EagleCheckpoint:
    """A randomly initialised head for `target` (tests, and the starting point of training). The
    default features are EAGLE-3's: a low, a middle and a high layer."""
    config = EagleConfig(
        target_layer_ids=target_layer_ids or default_layer_ids(target.num_layers, 3),
        hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
        num_attention_heads=target.num_heads, num_key_value_heads=target.num_kv_heads, head_dim=target.head_dim,
        target_name=target.name, target_vocab_size=target.vocab_size, rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta)
    generator = torch.Generator().manual_seed(seed)
    weights = {name: torch.ones(shape, dtype=dtype) if len(shape) == 1
               else torch.randn(shape, generator=generator, dtype=dtype) * shape[1] ** -0.5
               for name, shape in weight_shapes(config).items()}
    return EagleCheckpoint(config, weights, "random EAGLE drafter")


class EagleDrafter:
    """The head at runtime, over the target's embedding and LM head."""

    def __init__(self, ckpt: EagleCheckpoint, target: LlamaModel) -> None:
        c, t = ckpt.config, target.config
        self.config = c
        layer = ModelConfig("llama", t.vocab_size, c.hidden_size, c.intermediate_size, 1, c.num_attention_heads,
                            c.num_key_value_heads, c.head_dim, c.rms_norm_eps, c.rope_theta,
                            t.max_position_embeddings, tie_word_embeddings=True, name="EAGLE drafter")
        w = {k: v.to(target.dtype) for k, v in ckpt.weights.items()}
        self.model = LlamaModel(layer, {**w, "model.embed_tokens.weight": target.embed}, target.dtype,
                                shared_head=target.head, quantization=target.quantization)
        self.kv_geometry = KVGeometry.of(layer, target.dtype)
        # `fc` and `input_proj` stay in the compute dtype: their inputs join vectors of very different scales
        # (target layers; an embedding and a feature), which one int8 scale per token would flatten.
        self.fc = Linear(w["fc.weight"])                     # len(target_layer_ids) * hidden → hidden
        self.input_proj = Linear(w["input_proj.weight"])     # 2 * hidden → hidden
        # Committed rows need only K and V: a small copy of those rows skips Q, attention and the MLP.
        p = "model.layers.0.self_attn."
        self.context_kv = make_linear(torch.cat([w[p + "k_proj.weight"], w[p + "v_proj.weight"]]),
                                      quantization=target.quantization)

    def fuse(self, aux: list[torch.Tensor]) -> torch.Tensor:
        # aux: per target layer in target_layer_ids, [n, hidden] → features [n, hidden]
        return self.fc(torch.cat(aux, dim=-1))

    def inputs(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        # tokens: [n]; features: [n, hidden] of each token's previous position → [n, hidden]
        return self.input_proj(torch.cat([self.model.embed[tokens], features], dim=-1))

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions: [n]; features: [n, hidden] → the layer's output residual [n, hidden] (the
        predicted features) and logits [n, vocab]."""
        normed, (residual,) = self.model.forward_embeds(self.inputs(tokens, features), positions, meta, pool, (0,))
        return residual, self.model.logits(normed)

    def write_context(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor, pool: KVPool) -> None:
        """The K/V `forward` would write for these rows. tokens, positions, slots: [n]; features: [n, hidden]."""
        c = self.config
        h = rms_norm(self.inputs(tokens, features), self.model.layers[0].input_norm, c.rms_norm_eps)
        kv = self.context_kv(h)
        kv_size = c.num_key_value_heads * c.head_dim
        k = kv[:, :kv_size].view(-1, c.num_key_value_heads, c.head_dim)
        v = kv[:, kv_size:].view(-1, c.num_key_value_heads, c.head_dim)
        cos, sin = self.model.rope.tables(positions)
        pool.write(0, slots, apply_rope(k, cos, sin), v)


def dense_chain_forward(c: EagleConfig, w: dict[str, torch.Tensor], embed: torch.Tensor, rope: Rope,
                        aux: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                        num_rows: int) -> torch.Tensor:
    """The drafting chain of EagleProposer, dense and differentiable in the checkpoint's tensors `w`
    (training, EAGLE-3's training-time test). aux: [B, L, len(target_layer_ids) * hidden] of each
    sequence's tokens; tokens: [B, L]; anchors: [B, A] positions (>= 1). Row k of an anchor a sits at
    a + k and takes token a + k (the true one: only an accepted prefix of drafts matters) with the real
    feature of a - 1 (row 0) or row k - 1's output; it attends to the context K/V of positions <= a,
    written from real features, and rows 1..k of its own chain → final-normed hidden [B, A, num_rows, hidden]."""
    B, L, _ = aux.shape
    A = anchors.shape[1]
    eps, d, heads, kv_heads = c.rms_norm_eps, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    p = "model.layers.0."
    fused = aux @ w["fc.weight"].T                                                        # [B, L, hidden]

    def layer_input(token_ids: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([embed[token_ids], features], dim=-1) @ w["input_proj.weight"].T
        return x, rms_norm(x, w[p + "input_layernorm.weight"], eps)

    def proj(h: torch.Tensor, name: str, n: int) -> torch.Tensor:   # [B, T, hidden] → [B, T, n, d]
        return (h @ w[p + f"self_attn.{name}_proj.weight"].T).unflatten(-1, (n, d))

    previous = torch.cat([fused.new_zeros(B, 1, fused.shape[-1]), fused[:, :-1]], dim=1)   # feature of p - 1
    _, h = layer_input(tokens, previous)
    keys = [apply_rope(proj(h, "k", kv_heads), *rope.tables(torch.arange(L)))]
    values = [proj(h, "v", kv_heads)]
    masks = [(torch.arange(L) <= anchors[..., None])]                                    # [B, A, L]
    batch = torch.arange(B)[:, None]
    features = fused[batch, anchors - 1]                                                  # [B, A, hidden]
    rows = []
    for k in range(num_rows):
        positions = (anchors + k).clamp(max=L - 1)
        x, h = layer_input(tokens[batch, positions], features)
        cos, sin = (t.view(B, A, 1, d) for t in rope.tables((anchors + k).flatten()))
        q = apply_rope(proj(h, "q", heads), cos, sin)
        if k:      # row 0's K/V is the context's at its anchor, already there
            keys.append(apply_rope(proj(h, "k", kv_heads), cos, sin))
            values.append(proj(h, "v", kv_heads))
            masks.append(torch.eye(A, dtype=torch.bool).expand(B, A, A))
        att = F.scaled_dot_product_attention(q.transpose(1, 2), torch.cat(keys, 1).transpose(1, 2),
                                             torch.cat(values, 1).transpose(1, 2),
                                             attn_mask=torch.cat(masks, -1)[:, None], scale=d ** -0.5,
                                             enable_gqa=True)                              # [B, heads, A, d]
        x = x + att.transpose(1, 2).flatten(2) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        x = x + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
        features = x
        rows.append(rms_norm(x, w["model.norm.weight"], eps))
    return torch.stack(rows, dim=2)
