"""The block drafter of DFLASH and DSPARK (DESIGN.md §3).

Context: the target's residual stream after `target_layer_ids` is concatenated per committed token (with
`context_norm`, each layer's stream RMS-normalised first: their scales differ ~20x), projected by `fc` and
normalised; each draft layer turns it into K/V (RoPE at the token's absolute position) in the draft pool.
Block: the anchor's embedding then the mask token's, at the positions after the context (with
`anchor_feature`, each slot's input adds `anchor_proj` of the context vector of the token before the anchor,
the latest the target has seen: a direct path that the attention would otherwise have to find); one non-causal
forward over them gives hidden states. Two slot layouts give gamma drafts: gamma slots whose row k predicts
the token at anchor + k + 1 (DSPARK's), or with `anchor_slot` (DFlash's own) gamma + 1 slots where the mask
slot at anchor + k predicts the token at anchor + k and the anchor's slot drafts nothing. Either way draft row
k is the token at anchor + k + 1. Embedding and LM head are the target's; a token map restricts the head to a
draft vocabulary of V_d target tokens. DSPARK adds a rank-r Markov head (row k's logits += W2(W1[prev_k])) and
a confidence head (c_k = sigmoid(Linear([h_k; W1[prev_k]]) / T_k)).

The checkpoint is a folder: config.json (the fields of BlockDrafterConfig plus `architectures`) and
model.safetensors in Hugging Face layout ([out, in] weights); the optional int64 tensor `token_map`
lists the target id of each draft id.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve import native
from specserve.attention.sdpa import AttentionMetadata
from specserve.config import ModelConfig
from specserve.kv_pages import KVGeometry, KVPool
from specserve.loader import ModelLoadError
from specserve.models.drafter_checkpoint import (
    check_fits_target,
    config_from_json,
    default_layer_ids,
    mismatch,
    read_drafter_folder,
    save_drafter_folder,
)
from specserve.models.layers import Rope, make_linear, rms_norm
from specserve.models.llama import LlamaModel
from specserve.native.ops import apply_rope
from specserve.quantization import Int8Linear

ARCHITECTURE = "BlockDrafter"


@dataclass(frozen=True)
class BlockDrafterConfig:
    algorithm: str                        # "DFLASH" | "DSPARK"
    target_layer_ids: tuple[int, ...]     # target layers whose output forms the context, increasing
    block_size: int                       # rows the drafter was trained with (gamma <= block_size)
    num_hidden_layers: int
    hidden_size: int                      # = the target's: the embedding and LM head are shared
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    mask_token_id: int                    # target token id embedded in rows 1.. of the block
    draft_vocab_size: int                 # V_d; < the target's vocabulary needs a token map
    target_name: str
    target_hidden_size: int
    target_vocab_size: int
    markov_rank: int = 0                  # r; DSPARK only
    confidence_temperatures: tuple[float, ...] = ()   # T_k per row; DSPARK only
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qk_norm: bool = False
    context_norm: bool = False            # RMS-normalise each target layer's stream before fc
    anchor_feature: bool = False          # block rows add anchor_proj(context vector at anchor - 1)
    anchor_slot: bool = False             # DFlash's layout: the anchor's slot drafts nothing, block_size mask slots do

    def to_json(self) -> dict:
        return {"architectures": [ARCHITECTURE], **dataclasses.asdict(self)}

    @staticmethod
    def from_json(data: dict, source: str) -> BlockDrafterConfig:
        if data.get("architectures") != [ARCHITECTURE]:
            raise ModelLoadError(f"{source} is not a block drafter checkpoint (architectures "
                                 f"{data.get('architectures')}, expected [{ARCHITECTURE!r}])")
        return config_from_json(BlockDrafterConfig, data, source)


def weight_shapes(c: BlockDrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint (bar the optional token map) and its Hugging Face shape."""
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"fc.weight": (h, len(c.target_layer_ids) * c.target_hidden_size), "hidden_norm.weight": (h,),
              "model.norm.weight": (h,)}
    if c.anchor_feature:
        shapes["anchor_proj.weight"] = (h, h)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (c.intermediate_size, h),
                   p + "mlp.up_proj.weight": (c.intermediate_size, h),
                   p + "mlp.down_proj.weight": (h, c.intermediate_size),
                   p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        if c.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)}
    if c.algorithm == "DSPARK":
        r, vd = c.markov_rank, c.draft_vocab_size
        shapes |= {"markov.w1.weight": (vd, r), "markov.w2.weight": (vd, r), "confidence.weight": (1, h + r),
                   "confidence.bias": (1,)}
    return shapes


@dataclass
class BlockDrafterCheckpoint:
    config: BlockDrafterConfig
    weights: dict[str, torch.Tensor]      # Hugging Face layout; "token_map" ([V_d] int64) is optional
    source: str = ""

    def save(self, folder: str | Path) -> None:
        save_drafter_folder(folder, self.config.to_json(), self.weights)

    @staticmethod
    def load(folder: str | Path) -> BlockDrafterCheckpoint:
        config, weights = read_drafter_folder(folder, "a block drafter checkpoint", BlockDrafterConfig.from_json)
        return BlockDrafterCheckpoint(config, weights, str(folder))

    def validate(self, algorithm: str, target: ModelConfig, token_map: torch.Tensor | None) -> None:
        """Raise ModelLoadError at startup for anything that does not fit the target or the algorithm."""
        c, src = self.config, self.source or "the block drafter"
        bad = mismatch(src, target)
        if c.algorithm != algorithm:
            raise bad(f"it is a {c.algorithm} drafter; run it with --speculative-algorithm {c.algorithm}")
        check_fits_target(src, target, target_name=c.target_name, hidden_size=c.target_hidden_size,
                          target_vocab_size=c.target_vocab_size, target_layer_ids=c.target_layer_ids,
                          weights=self.weights, shapes=weight_shapes(c))
        if c.hidden_size != c.target_hidden_size:
            raise bad(f"its hidden size {c.hidden_size} differs from the target hidden size {c.target_hidden_size} "
                      "it was built for: it shares the target's embedding and LM head")
        if not 0 <= c.mask_token_id < target.vocab_size:
            raise bad(f"mask_token_id {c.mask_token_id} is outside the vocabulary [0, {target.vocab_size})")
        if c.block_size < 1 or c.num_hidden_layers < 1:
            raise bad("block_size and num_hidden_layers must be >= 1")
        if algorithm == "DSPARK" and (c.markov_rank < 1 or len(c.confidence_temperatures) != c.block_size
                                      or any(t <= 0 for t in c.confidence_temperatures)):
            raise bad("DSPARK needs markov_rank >= 1 and one positive confidence temperature per block row")
        token_map = token_map if token_map is not None else self.weights.get("token_map")
        if token_map is None:
            if c.draft_vocab_size != target.vocab_size:
                raise bad(f"its draft vocabulary has {c.draft_vocab_size} tokens but there is no token map; "
                          "pass --speculative-token-map")
        elif (token_map.shape != (c.draft_vocab_size,) or token_map.dtype.is_floating_point
              or len(token_map.unique()) != len(token_map)
              or not 0 <= int(token_map.min()) <= int(token_map.max()) < target.vocab_size):
            raise bad(f"the token map must hold {c.draft_vocab_size} distinct target token ids, got "
                      f"{token_map.dtype} of shape {list(token_map.shape)}")


def load_token_map(path: str | Path) -> torch.Tensor:
    """--speculative-token-map: a torch.save'd 1-D integer tensor of target ids, one per draft id."""
    try:
        token_map = torch.load(path, weights_only=True)
    except (OSError, RuntimeError) as e:
        raise ModelLoadError(f"cannot read the token map {path} ({e})") from e
    return torch.as_tensor(token_map)


def random_block_drafter(target: ModelConfig, algorithm: str = "DSPARK", *, num_layers: int = 1,
                         block_size: int = 16, target_layer_ids: tuple[int, ...] | None = None,
                         markov_rank: int = 8, token_map: torch.Tensor | None = None,
                         mask_token_id: int | None = None, qk_norm: bool = False, context_norm: bool = False,
                         anchor_feature: bool = False, anchor_slot: bool = False, seed: int = 0,
                         dtype: torch.dtype = torch.float32) -> BlockDrafterCheckpoint:
    """A randomly initialised drafter for `target` (tests, and the starting point of training)."""
    dspark = algorithm == "DSPARK"
    config = BlockDrafterConfig(
        algorithm=algorithm, target_layer_ids=target_layer_ids or default_layer_ids(target.num_layers),
        block_size=block_size, num_hidden_layers=num_layers, hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size, num_attention_heads=target.num_heads,
        num_key_value_heads=target.num_kv_heads, head_dim=target.head_dim,
        mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
        draft_vocab_size=target.vocab_size if token_map is None else len(token_map),
        target_name=target.name, target_hidden_size=target.hidden_size, target_vocab_size=target.vocab_size,
        markov_rank=markov_rank if dspark else 0,
        confidence_temperatures=(1.0,) * block_size if dspark else (),
        rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta, qk_norm=qk_norm,
        context_norm=context_norm, anchor_feature=anchor_feature, anchor_slot=anchor_slot)
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        if len(shape) == 1:
            weights[name] = torch.zeros(shape, dtype=dtype) if name.endswith("bias") else torch.ones(shape, dtype=dtype)
        else:
            weights[name] = torch.randn(shape, generator=generator, dtype=dtype) * shape[1] ** -0.5
    if token_map is not None:
        weights["token_map"] = token_map.long()
    return BlockDrafterCheckpoint(config, weights, f"random {algorithm} drafter")


class BlockDrafter:
    """A drafter at runtime, over the target's embedding and LM head (restricted to the draft vocabulary)."""

    def __init__(self, ckpt: BlockDrafterCheckpoint, target: LlamaModel, token_map: torch.Tensor | None = None) -> None:
        c, t = ckpt.config, target.config
        self.config = c
        dtype = target.dtype
        token_map = token_map if token_map is not None else ckpt.weights.get("token_map")
        # draft id → target id
        self.token_map = torch.arange(t.vocab_size) if token_map is None else token_map.long()
        # target id → draft id; a token outside the map points at an all-zero Markov row
        self.to_draft = torch.full((t.vocab_size,), c.draft_vocab_size, dtype=torch.long)
        self.to_draft[self.token_map] = torch.arange(c.draft_vocab_size)

        layers = ModelConfig("qwen3" if c.qk_norm else "llama", t.vocab_size, c.hidden_size, c.intermediate_size,
                             c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                             c.rms_norm_eps, c.rope_theta, t.max_position_embeddings, qk_norm=c.qk_norm,
                             name=f"{c.algorithm} drafter")
        w = {k: v.to(dtype) for k, v in ckpt.weights.items() if k != "token_map"}
        quantization = target.quantization
        # The target's head, shared (prepacked once), or its rows of the draft vocabulary: [V_d, hidden]
        head = target.head if token_map is None else target.head.rows(token_map.long())
        self.model = LlamaModel(layers, {**w, "model.embed_tokens.weight": target.embed}, dtype, shared_head=head,
                                quantization=quantization)
        self.kv_geometry = KVGeometry.of(layers, dtype)
        # `fc` reads target layers side by side whose scales differ ~20x: int8 (a scale per 128 inputs) only when
        # context_norm brings each layer to RMS 1 first; otherwise it stays in the compute dtype.
        self.fc = make_linear(w["fc.weight"], quantization=quantization if c.context_norm else "none")
        self.hidden_norm = w["hidden_norm.weight"]
        self.anchor_proj = (make_linear(w["anchor_proj.weight"], quantization=quantization) if c.anchor_feature
                            else None)
        # The context needs only K and V of each layer: a small copy of those rows skips Q. Quantized per
        # row, they are the very rows of the layer's own QKV.
        self.context_kv = [make_linear(torch.cat([w[f"model.layers.{i}.self_attn.k_proj.weight"],
                                                  w[f"model.layers.{i}.self_attn.v_proj.weight"]]),
                                       quantization=quantization)
                           for i in range(c.num_hidden_layers)]
        # the whole write as one native op (native/context.cpp) where it has a kernel for each step
        self.native_context = (dtype == torch.float32 and c.context_norm and not c.qk_norm
                               and all(isinstance(lin, Int8Linear) for lin in [self.fc, *self.context_kv])
                               and native.register())
        self.markov = c.algorithm == "DSPARK"             # with the Markov and confidence heads
        if self.markov:
            w1 = w["markov.w1.weight"]
            self.w1 = torch.cat([w1, w1.new_zeros(1, c.markov_rank)])   # [V_d + 1, r]
            self.w2 = make_linear(w["markov.w2.weight"], quantization=quantization)        # r → V_d
            # hidden + r → 1
            self.confidence_head = make_linear(w["confidence.weight"], w["confidence.bias"], quantization)
            self.temperatures = torch.tensor(c.confidence_temperatures, dtype=dtype)   # [block_size]
        # a greedy block's heads as one native op (native/markov.cpp) where each of them is an int8 linear
        self.native_heads = (self.markov and dtype == torch.float32 and native.register()
                             and all(isinstance(lin, Int8Linear) for lin in [head, self.w2, self.confidence_head])
                             and head.bias is None)

    def block_row_weights(self) -> int:
        """Weights one block row multiplies through: its layers, the draft head and the DSPARK heads."""
        heads = self.w2.num_weights + self.confidence_head.num_weights if self.markov else 0
        anchor = self.anchor_proj.num_weights if self.anchor_proj is not None else 0
        return self.model.row_weights() + heads + anchor

    def write_context(self, aux: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      pool: KVPool) -> torch.Tensor:
        """aux: [n, len(target_layer_ids) * target hidden] of committed tokens; positions, slots: [n]
        → their context vectors [n, hidden] (a block reads the one before its anchor with anchor_feature)."""
        c = self.config
        if self.native_context and pool.k.dtype in (torch.float32, torch.float16, torch.int8):
            return torch.ops.specserve.draft_context(
                aux, len(c.target_layer_ids), c.rms_norm_eps, self.fc.weight, self.fc.scale, self.hidden_norm,
                [lin.weight for lin in self.context_kv], [lin.scale for lin in self.context_kv], self.model.rope.cos,
                self.model.rope.sin, positions, pool.k, pool.v, slots)
        ctx = context_vectors(c, aux, self.fc, self.hidden_norm)
        cos, sin = self.model.rope.tables(positions)
        kv_size = c.num_key_value_heads * c.head_dim
        for i, (layer, context_kv) in enumerate(zip(self.model.layers, self.context_kv)):
            kv = context_kv(ctx)
            k = kv[:, :kv_size].view(-1, c.num_key_value_heads, c.head_dim)
            v = kv[:, kv_size:].view(-1, c.num_key_value_heads, c.head_dim)
            if layer.k_norm is not None:
                k = rms_norm(k, layer.k_norm, c.rms_norm_eps)
            pool.write(i, slots, apply_rope(k, cos, sin), v)
        return ctx

    def block_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                     pool: KVPool, anchor_context: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [n] block slots (spans non-causal); anchor_context: [n, hidden] each slot's
        context vector at its anchor - 1 (anchor_feature only) → final-normed hidden [n, hidden]."""
        x = self.model.embed[input_ids]
        if self.anchor_proj is not None:
            x = x + self.anchor_proj(anchor_context)
        return self.model.forward_embeds(x, positions, meta, pool)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [n, hidden] → [n, V_d] over the draft vocabulary
        return self.model.logits(hidden)

    def markov_logits(self, prev: torch.Tensor, base: torch.Tensor | None = None) -> torch.Tensor:
        # prev: [n] draft ids of each row's previous token (to_draft's: V_d for a token outside the draft
        # vocabulary, whose Markov row is zero) → [n, V_d], added to base [n, V_d] if given
        return self.w2(self.w1[prev], base)

    def confidence(self, hidden: torch.Tensor, prev: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        # hidden: [n, hidden]; prev: [n] draft ids of each row's previous token; rows: [n] row index k in the block
        # → c_k: [n]
        features = torch.cat([hidden, self.w1[prev]], dim=-1)
        return torch.sigmoid(self.confidence_head(features).squeeze(-1) / self.temperatures[rows])

    def dspark_greedy(self, hidden: torch.Tensor,      # [jobs, rows, hidden] final-normed block rows
                      prev: torch.Tensor               # [jobs] draft ids of the tokens before the first rows
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """native_heads only: the greedy picks [jobs, rows] (draft ids; each row's argmax after the Markov term of the
        row before's pick) and their confidences [jobs, rows], in one native op (native/markov.cpp) with the kernels
        of `logits`, `markov_logits` and `confidence`."""
        head, conf = self.model.head, self.confidence_head
        return torch.ops.specserve.dspark_greedy(hidden, prev, head.weight, head.scale, self.w1, self.w2.weight,
                                                 self.w2.scale, conf.weight, conf.scale, conf.bias, self.temperatures)


def context_vectors(c: BlockDrafterConfig, aux: torch.Tensor, fc, hidden_norm: torch.Tensor) -> torch.Tensor:
    """aux: [..., len(target_layer_ids) * target hidden] → context vectors [..., hidden]; `fc` maps the
    last dimension (a Linear at runtime, the trained weight in training)."""
    if c.context_norm:
        per_layer = aux.unflatten(-1, (len(c.target_layer_ids), c.target_hidden_size))
        aux = F.rms_norm(per_layer, (c.target_hidden_size,), eps=c.rms_norm_eps).flatten(-2)
    return rms_norm(fc(aux), hidden_norm, c.rms_norm_eps)


def dense_block_forward(c: BlockDrafterConfig, w: dict[str, torch.Tensor], embed: torch.Tensor, rope: Rope,
                        aux: torch.Tensor, anchors: torch.Tensor, anchor_ids: torch.Tensor,
                        rows: int | None = None) -> torch.Tensor:
    """The block forward of BlockDrafter, dense and differentiable in the checkpoint's tensors `w`
    (training). aux: [B, L, len(target_layer_ids) * target hidden] of each sequence's tokens;
    anchors, anchor_ids: [B, A] positions (>= 1) and token ids. Each anchor's block (the anchor, then
    mask tokens) sees the context of positions < anchor and its own slots, as the paged proposer's does
    → final-normed hidden of the draft rows [B, A, rows, hidden], the first `rows` of each block (default:
    block_size; the engine runs shorter blocks too); with anchor_slot, the anchor's slot is run and left out.

    Attention is split in two parts that share one softmax: every slot against the context ([R, L] scores,
    masked past the slot's anchor) and each block's slots against each other ([A, G, G]), so that a step
    over every answer position costs R * (L + G) scores rather than the R * (L + R) of one dense mask."""
    B, L, _ = aux.shape
    lead = int(c.anchor_slot)                                  # slots before the first draft row
    A, G = anchors.shape[1], (rows or c.block_size) + lead     # G: slots per block
    R = A * G
    eps, d, kv_heads = c.rms_norm_eps, c.head_dim, c.num_key_value_heads
    group = c.num_attention_heads // kv_heads
    ctx = context_vectors(c, aux, lambda t: t @ w["fc.weight"].T, w["hidden_norm.weight"])   # [B, L, hidden]
    ctx_rope = rope.tables(torch.arange(L))
    block_rope = [t.view(B, R, 1, d) for t in rope.tables((anchors[..., None] + torch.arange(G)).flatten())]
    ids = torch.full((B, A, G), c.mask_token_id, dtype=torch.long)
    ids[..., 0] = anchor_ids
    x = embed[ids.view(B, R)]                                                                   # [B, R, hidden]
    if c.anchor_feature:
        before = ctx.gather(1, (anchors - 1).clamp_min(0)[..., None].expand(-1, -1, ctx.shape[-1]))  # [B, A, hidden]
        before = before * (anchors > 0)[..., None]         # nothing before position 0, as in the engine
        x = x + (before @ w["anchor_proj.weight"].T).repeat_interleave(G, dim=1)
    hidden_mask = torch.arange(L) >= anchors.repeat_interleave(G, dim=1)[..., None]            # [B, R, L]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."

        def proj(t: torch.Tensor, name: str, heads: int) -> torch.Tensor:   # [B, T, hidden] → [B, T, heads, d]
            out = (t @ w[p + f"self_attn.{name}_proj.weight"].T).unflatten(-1, (heads, d))
            return rms_norm(out, w[p + f"self_attn.{name}_norm.weight"], eps) if c.qk_norm and name != "v" else out

        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = apply_rope(proj(h, "q", c.num_attention_heads), *block_rope).view(B, R, kv_heads, group, d)
        k_ctx, v_ctx = apply_rope(proj(ctx, "k", kv_heads), *ctx_rope), proj(ctx, "v", kv_heads)   # [B, L, kv, d]
        k_blk, v_blk = apply_rope(proj(h, "k", kv_heads), *block_rope), proj(h, "v", kv_heads)     # [B, R, kv, d]
        scores_ctx = torch.einsum("brkgd,blkd->bkgrl", q, k_ctx).masked_fill(hidden_mask[:, None, None], -torch.inf)
        scores_blk = torch.einsum("bajkgd,bamkd->bkgajm", q.view(B, A, G, kv_heads, group, d),
                                  k_blk.view(B, A, G, kv_heads, d)).reshape(B, kv_heads, group, R, G)
        probs = (torch.cat([scores_ctx, scores_blk], dim=-1) * d ** -0.5).softmax(-1)        # [B, kv, g, R, L + G]
        att = (torch.einsum("bkgrl,blkd->brkgd", probs[..., :L], v_ctx)
               + torch.einsum("bkgajm,bamkd->bajkgd", probs[..., L:].reshape(B, kv_heads, group, A, G, G),
                              v_blk.view(B, A, G, kv_heads, d)).reshape(B, R, kv_heads, group, d))
        x = x + att.flatten(2) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms_norm(x, w["model.norm.weight"], eps).view(B, A, G, -1)[:, :, lead:]
