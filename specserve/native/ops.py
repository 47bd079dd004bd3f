"""The C++ ops' schemas, the int8 kernel's weight layout, and Python references: what each kernel computes, which
the tests compare against and which serve an op where the kernels cannot be built (row-invariant too, but slow)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

PAGED_ATTENTION_ROWS = ("paged_attention_rows(Tensor q, Tensor k_pool, Tensor v_pool, Tensor row_seq, "
                        "Tensor row_len, Tensor seq_slots, float scale) -> Tensor")
PAGED_ATTENTION_QKV = ("paged_attention_qkv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_pool, "
                       "Tensor(b!) v_pool, Tensor slot_mapping, Tensor row_seq, Tensor row_len, Tensor seq_slots, "
                       "int heads, float scale) -> Tensor")
INT8_LINEAR = ("int8_linear(Tensor x, Tensor? norm_weight, float eps, bool glu, Tensor weight, Tensor weight_scale, "
               "Tensor? bias, Tensor? residual=None) -> Tensor")
ACTIVATION_GROUP = 128          # inputs per activation scale (native/int8_linear.cpp's GROUP)
KV_SCALE_BYTES = 4              # an int8 pool's KV head: head_dim int8 values, then their float32 scale's bytes
QUANTIZE_KV = "quantize_kv(Tensor x) -> Tensor"
ARGMAX_ROWS = "argmax_rows(Tensor x) -> Tensor"
MARKOV_GREEDY = "markov_greedy(Tensor base, Tensor prev, Tensor w1, Tensor w2, Tensor w2_scale) -> Tensor"


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """native/argmax.cpp: [rows, n] float32 → [rows] the first maximal index of each row (a NaN counts as maximal)."""
    return x.argmax(dim=-1)


def markov_greedy(base: torch.Tensor, prev: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  w2_scale: torch.Tensor) -> torch.Tensor:
    """native/markov.cpp: base [jobs, rows, V] float32, prev [jobs] draft ids, w1 [V + 1, r], the int8 linear w2 r → V
    → [jobs, rows] the draft ids of argmax(base_k + w2(w1[prev_k])), prev_k being row k - 1's pick."""
    picked = []
    for k in range(base.shape[1]):
        prev = argmax_rows(int8_linear(w1[prev], None, 0.0, False, w2, w2_scale, None, base[:, k]))
        picked.append(prev)
    return torch.stack(picked, dim=1)


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float32 → [..., head_dim + 4] int8: each head's values rounded to the nearest of 255 levels
    over its largest magnitude, then that scale's bytes (native/rows.cpp's quantize_kv, the same bits)."""
    peak = x.abs().amax(dim=-1, keepdim=True)
    nonzero = peak > 1e-30
    inv = torch.where(nonzero, 127.0 / peak, torch.zeros_like(peak))
    scale = torch.where(nonzero, peak / 127.0, torch.zeros_like(peak))
    values = torch.round(x * inv).clamp(-127.0, 127.0).to(torch.int8)
    return torch.cat([values, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_kv(pool_rows: torch.Tensor) -> torch.Tensor:
    """`quantize_kv`'s inverse as the kernel reads it: [..., head_dim + 4] int8 → [..., head_dim] float32."""
    scale = pool_rows[..., -KV_SCALE_BYTES:].contiguous().view(torch.float32)
    return pool_rows[..., :-KV_SCALE_BYTES].float() * scale


def to_pool(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V rows [..., head_dim] as a pool of `dtype` stores them (int8: the quantize_kv op, which TorchScript can
    call where it cannot reinterpret a tensor's bytes). TorchScript-compatible: the layer stack writes through it."""
    if dtype == torch.int8:
        return torch.ops.specserve.quantize_kv(x.float())
    return x.to(dtype)


def from_pool(pool_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows as values of `dtype`: float16 widens exactly, int8 is `dequantize_kv`'s int8 x scale."""
    return dequantize_kv(pool_rows).to(dtype) if pool_rows.dtype == torch.int8 else pool_rows.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary with the rotate-half layout (Hugging Face's). x: [num_tokens, heads, head_dim]; cos, sin:
    [num_tokens, 1, head_dim]. TorchScript-compatible: the layer stack calls it where the fused op does not serve."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def quantize_query(q: torch.Tensor) -> torch.Tensor:
    """The query an int8 pool's attention scores, [..., head_dim] → the same shape and dtype: each block of 16 values
    (8 where head_dim is not a multiple of 16) rounded to 255 levels over its largest magnitude, as a key head is
    (quantize_kv)."""
    block = 16 if q.shape[-1] % 16 == 0 else 8
    blocks = q.float().reshape(*q.shape[:-1], q.shape[-1] // block, block)
    return dequantize_kv(quantize_kv(blocks)).reshape(q.shape).to(q.dtype)


def paged_attention_rows(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, row_seq: torch.Tensor,
                         row_len: torch.Tensor, seq_slots: torch.Tensor, scale: float) -> torch.Tensor:
    """native/rows.cpp's attention, one row at a time (an int8 pool scores `quantize_query`'s queries).
    q: [rows, heads, head_dim] → [rows, heads, head_dim]."""
    if k_pool.dtype == torch.int8:
        q = quantize_query(q)
    out = torch.empty_like(q)
    for r in range(len(q)):
        slots = seq_slots[row_seq[r], :row_len[r]]
        keys = from_pool(k_pool[slots], q.dtype).transpose(0, 1)[None]
        values = from_pool(v_pool[slots], q.dtype).transpose(0, 1)[None]
        out[r] = F.scaled_dot_product_attention(q[r][None, :, None], keys, values, scale=scale,
                                                enable_gqa=True)[0, :, 0]
    return out


def paged_attention_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                        v_pool: torch.Tensor, slot_mapping: torch.Tensor, row_seq: torch.Tensor, row_len: torch.Tensor,
                        seq_slots: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
    """native/rows.cpp's fused op: rotary on the Q and K heads of qkv [rows, (heads + 2 * kv_heads) *
    head_dim], the new K/V written at slot_mapping, then `paged_attention_rows` → [rows, heads * head_dim]."""
    kv_heads = k_pool.shape[1]
    d = qkv.shape[1] // (heads + 2 * kv_heads)
    qk = apply_rope(qkv[:, :(heads + kv_heads) * d].view(-1, heads + kv_heads, d), cos.view(-1, 1, d),
                    sin.view(-1, 1, d))
    k_pool.index_copy_(0, slot_mapping, to_pool(qk[:, heads:], k_pool.dtype))
    v_pool.index_copy_(0, slot_mapping, to_pool(qkv[:, (heads + kv_heads) * d:].reshape(-1, kv_heads, d), v_pool.dtype))
    out = paged_attention_rows(qk[:, :heads].contiguous(), k_pool, v_pool, row_seq, row_len, seq_slots, scale)
    return out.view(len(qkv), -1)


def pack(q: torch.Tensor, vnni: bool = False) -> torch.Tensor:
    """[out, in] int8 → a kernel layout, zero-padded. Without VNNI [ceil(out / 4), ceil(in / 32), 4, 32]: each block
    of 4 output channels holds their 32 weights of each step side by side, so that a block is one stream to read.
    With VNNI [ceil(out / 16), ceil(in / 32) * 8, 16, 4]: each block of 16 channels holds their 4 weights of each
    step side by side, one channel per 32-bit lane."""
    out, inp = q.shape
    channels = 16 if vnni else 4
    padded = F.pad(q, (0, -inp % 32, 0, -out % channels))
    step = 4 if vnni else 32
    return padded.view(padded.shape[0] // channels, channels, -1, step).transpose(1, 2).contiguous()


def unpack(weight: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """`pack`'s inverse, for either layout: [out, in] int8."""
    return weight.transpose(1, 2).reshape(-1, weight.shape[1] * weight.shape[3])[:out, :inp]


def int8_linear(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, glu: bool, weight: torch.Tensor,
                weight_scale: torch.Tensor, bias: torch.Tensor | None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """native/int8_linear.cpp (the same bits without a norm or gating). x: [rows, in] float32 ([rows, 2 * in] with
    glu: silu(gate) * up), or its RMSNorm with `norm_weight` → [rows, out], plus `residual` [rows, out] if given."""
    if glu:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    elif norm_weight is not None:
        x = F.rms_norm(x, norm_weight.shape, norm_weight, eps)
    rows, n = x.shape
    w = unpack(weight, len(weight_scale), n).double()
    y = torch.zeros(rows, len(weight_scale), device=x.device)
    for g0 in range(0, n, ACTIVATION_GROUP):
        h = x[:, g0:g0 + ACTIVATION_GROUP]
        peak = h.abs().amax(dim=-1, keepdim=True)
        inv = torch.where(peak > 1e-30, 127.0 / peak, torch.zeros_like(peak))
        q = torch.round(h * inv)                                      # round half to even, as the kernel
        dots = (q.double() @ w[:, g0:g0 + ACTIVATION_GROUP].T).to(torch.int32)    # exact: < 2^53
        y = y + dots.float() * (peak / 127.0)
    y = y * weight_scale
    if bias is not None:
        y = y + bias
    return y if residual is None else residual + y
