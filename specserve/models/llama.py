"""Llama-family decoder (Llama, SmolLM, Qwen2 with QKV bias, Qwen3 with qk-norm) over paged KV.
Fused QKV and gate/up projections keep the op count low: at batch 1 on a CPU, overhead is half the step."""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch

from specserve import native
from specserve.attention.sdpa import AttentionChunk, AttentionMetadata, RowTables, SeqSpan, paged_attention
from specserve.config import ModelConfig
from specserve.kv_pages import KVGeometry, KVPool
from specserve.models.layers import Linear, Rope, make_linear, rms_norm
from specserve.native import hugepages
from specserve.native.ops import apply_rope
from specserve.quantization import Int8Linear


class DecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, input_norm: torch.Tensor, qkv: Linear | Int8Linear,
                 q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, o: Linear | Int8Linear,
                 post_norm: torch.Tensor, gate_up: Linear | Int8Linear, down: Linear | Int8Linear) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim ** -0.5
        self.input_norm = input_norm    # [hidden]
        self.qkv = qkv                  # hidden → (heads + 2 * kv_heads) * head_dim, bias for Qwen2
        self.q_norm = q_norm            # [head_dim], Qwen3
        self.k_norm = k_norm
        self.o = o                      # heads * head_dim → hidden
        self.post_norm = post_norm      # [hidden]
        self.gate_up = gate_up          # hidden → 2 * intermediate
        self.down = down                # intermediate → hidden

    def forward(self, x: torch.Tensor,                          # [num_tokens, hidden]
                cos: torch.Tensor, sin: torch.Tensor,           # [num_tokens, 1, head_dim]
                k_pool: torch.Tensor, v_pool: torch.Tensor,     # [num_slots, kv_heads, head_dim], this layer's
                slot_mapping: torch.Tensor, chunks: list[AttentionChunk], rows: Optional[RowTables]) -> torch.Tensor:
        x = self.attention(x, cos, sin, k_pool, v_pool, slot_mapping, chunks, rows, residual=x)
        return self.mlp(x, residual=x)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                  v_pool: torch.Tensor, slot_mapping: torch.Tensor, chunks: list[AttentionChunk],
                  rows: Optional[RowTables], residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The attention block's contribution to the residual stream (a partial sum under tensor parallelism),
        added to `residual` by the output projection when one is given."""
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv.normed(x, self.input_norm, self.eps)
        if rows is not None and self.q_norm is None and qkv.dtype == torch.float32:
            # one op for rotary, the K/V write and attention: as ~18 small torch ops they cost more than attending
            return self.o(torch.ops.specserve.paged_attention_qkv(qkv, cos, sin, k_pool, v_pool, slot_mapping,
                                                                  rows.seq, rows.length, rows.slots, heads,
                                                                  self.scale), residual)
        # Q and K heads side by side: one rotary call for both (at batch 8 the small ops are a third of the step)
        qk = qkv[:, :(heads + kv_heads) * head_dim].view(-1, heads + kv_heads, head_dim)
        v = qkv[:, (heads + kv_heads) * head_dim:].view(-1, kv_heads, head_dim)
        q_norm, k_norm = self.q_norm, self.k_norm
        if q_norm is not None and k_norm is not None:
            qk = torch.cat([rms_norm(qk[:, :heads], q_norm, self.eps), rms_norm(qk[:, heads:], k_norm, self.eps)],
                           dim=1)
        qk = apply_rope(qk, cos, sin)
        return self.o(paged_attention(qk[:, :heads], qk[:, heads:], v, k_pool, v_pool, slot_mapping, chunks,
                                      rows, self.scale), residual)

    def mlp(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The MLP block's contribution to the residual stream (a partial sum under tensor parallelism),
        added to `residual` by the down projection when one is given."""
        return self.down.glu(self.gate_up.normed(x, self.post_norm, self.eps), residual)


class DecoderStack(torch.nn.Module):
    """The decoder layers, scripted with TorchScript: at batch 1 a layer's ~60 small ops cost more than its
    weights, and the interpreter runs them ~1.5x faster than Python. (torch.compile's inductor, with the int8
    op as an extern call, made a SmolLM2 layer slower here; TorchScript is deprecated but kept by the pinned
    torch.)"""

    def __init__(self, layers: list[DecoderLayer]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_layers: list[torch.Tensor], v_layers: list[torch.Tensor],   # [num_slots, kv_heads, head_dim] each
                slot_mapping: torch.Tensor, chunks: list[AttentionChunk], rows: Optional[RowTables],
                aux_layer_ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, k_layers[i], v_layers[i], slot_mapping, chunks, rows)
            if i in aux_layer_ids:
                aux.append(x)
        return x, aux


@torch.inference_mode()
def warm_up(model: LlamaModel, kv_dtype: torch.dtype) -> None:
    """TorchScript profiles and optimises the stack on its first two calls (the first took ~1 s for SmolLM2's
    30 layers): made here, a prefill and a decode step on a scratch page, so that no request waits for it.
    (A TensorParallelModel, which has the same forward and kv_geometry, passes itself too.)"""
    pool = KVPool(model.kv_geometry(kv_dtype), num_pages=1, page_size=4)
    for start, num_new in ((0, 2), (2, 1)):
        meta = AttentionMetadata.for_pool([SeqSpan([0], start, num_new)], pool)
        positions = torch.arange(start, start + num_new)
        model.forward(torch.zeros(num_new, dtype=torch.long), positions, meta, pool)


def native_stack(layers: list[DecoderLayer], dtype: torch.dtype) -> torch.ScriptObject | None:
    """The stack as one native call (native/stack.cpp: the same ops in the same order, so the same bits, without the
    interpreter and the dispatcher) where it has a kernel for each op: int8 linears in float32, no qk-norm, compiled
    kernels. None elsewhere."""
    linears = [lin for layer in layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    if (dtype != torch.float32 or not layers or not layers[0].input_norm.is_cpu
            or not all(isinstance(lin, Int8Linear) for lin in linears)
            or any(layer.q_norm is not None for layer in layers) or not native.register()):
        return None
    none = torch.empty(0)
    return torch.classes.specserve.DecoderStack(
        [layer.input_norm for layer in layers], [layer.qkv.weight for layer in layers],
        [layer.qkv.scale for layer in layers], [none if layer.qkv.bias is None else layer.qkv.bias for layer in layers],
        [layer.o.weight for layer in layers], [layer.o.scale for layer in layers],
        [layer.post_norm for layer in layers], [layer.gate_up.weight for layer in layers],
        [layer.gate_up.scale for layer in layers], [layer.down.weight for layer in layers],
        [layer.down.scale for layer in layers], layers[0].heads, layers[0].scale, layers[0].eps)


def scripted(stack: DecoderStack) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.jit.script.*deprecated", category=DeprecationWarning)
        return torch.jit.script(stack)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 shared_head: Linear | Int8Linear | None = None, quantization: str = "none",
                 device: torch.device | str = "cpu") -> None:
        """`shared_head`: use another model's vocabulary projection (drafters share the target's).
        `quantization`: "int8" makes every linear, the vocabulary projection included, an Int8Linear.
        `device`: the engine serves on the CPU; the drafter trainer's target pass may run on a GPU, where the
        ops run their references (native/__init__.py) and attention takes the padded SDPA path."""
        self.config = config
        self.dtype = dtype
        self.quantization = quantization
        self.tp_size = 1

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint for {config.name or config.architecture} is missing tensor {name}")
            return weights[name].to(device, dtype)

        self.embed = w("model.embed_tokens.weight")                       # [vocab, hidden]
        owns_head = shared_head is None
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
                config,
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
        if self.embed.is_cpu:
            self._int8_weights_in_huge_pages(owns_head)
        native.register()               # the layers call its ops on every path: they must exist before any forward
        self.native_stack = native_stack(self.layers, dtype)
        self.rope = Rope(config.head_dim, config.rope_theta, config.max_position_embeddings, dtype, device)

    def _int8_weights_in_huge_pages(self, owns_head: bool) -> None:
        """The int8 weights, moved into one huge-page arena in the order a forward reads them (see
        native/hugepages.py); before the stacks are made, which keep the tensors they are given."""
        linears = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        int8 = [lin for lin in linears + ([self.head] if owns_head else []) if isinstance(lin, Int8Linear)]
        for lin, weight in zip(int8, hugepages.gathered([lin.weight for lin in int8])):
            lin.weight = weight

    @functools.cached_property
    def stack(self) -> torch.jit.ScriptModule | DecoderStack:
        """The layer stack under TorchScript, compiled on first use (~1 s for SmolLM2's 30 layers): the paths the
        native stack does not take (float linears, qk-norm, a float64 KV pool) run it. Off the CPU it stays eager:
        its calls are few and large there, and TorchScript's GPU fuser would compile for every new token count."""
        stack = DecoderStack(self.layers)
        return scripted(stack) if self.embed.is_cpu else stack

    def row_weights(self) -> int:
        """Weights one token's row multiplies through in a forward, the vocabulary projection included."""
        return self.head.num_weights + sum(layer.qkv.num_weights + layer.o.num_weights + layer.gate_up.num_weights
                                           + layer.down.num_weights for layer in self.layers)

    def kv_geometry(self, dtype: torch.dtype) -> KVGeometry:
        return KVGeometry.of(self.config, dtype)

    def warm_up(self, kv_dtype: torch.dtype) -> None:
        warm_up(self, kv_dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, pool: KVPool,
                aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids, positions: [num_tokens] → final-normed hidden [num_tokens, hidden] and the
        residual stream after each layer in `aux_layer_ids` ([num_tokens, hidden] each)."""
        return self.forward_embeds(self.embed[input_ids], positions, meta, pool, aux_layer_ids)

    def forward_embeds(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, pool: KVPool,
                       aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward` from input vectors x: [num_tokens, hidden] instead of token ids (EAGLE's inputs
        mix the token embedding with a feature)."""
        cos, sin = self.rope.tables(positions)
        rows = meta.rows
        if self.native_stack is not None and rows is not None and x.dtype == torch.float32:
            x, aux = self.native_stack.forward(x, cos, sin, pool.k, pool.v, meta.slot_mapping, rows.seq, rows.length,
                                               rows.slots, list(aux_layer_ids))
            return rms_norm(x, self.final_norm, self.config.rms_norm_eps), aux
        x, aux = self.stack(x, cos, sin, pool.k_layers, pool.v_layers, meta.slot_mapping, list(meta.chunks), meta.rows,
                            list(aux_layer_ids))
        return rms_norm(x, self.final_norm, self.config.rms_norm_eps), aux

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_rows, hidden] → [num_rows, vocab]
        return self.head(hidden)
