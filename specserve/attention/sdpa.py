"""Reference attention over paged KV on the CPU: ragged queries (each sequence its own count and
positions) packed into one padded SDPA call per layer. Prefill, decode and verify windows mix freely."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.kv_pages import KVPool


@dataclass(frozen=True)
class SeqSpan:
    """One sequence in a forward: `num_new` tokens at positions [start, start+num_new), written into
    `pages`; they attend to every position < start + num_new (causal within the new tokens)."""
    pages: list[int]
    start: int
    num_new: int
    causal: bool = True   # block drafters run their block non-causally


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor     # [num_tokens] where each new token's K/V is written
    gather_slots: torch.Tensor     # [batch, max_kv] slots read per sequence (padding → the zero page)
    query_slot: torch.Tensor       # [num_tokens] index of each token in the padded [batch * max_q] queries
    mask: torch.Tensor             # [batch, 1, max_q, max_kv] True = may attend
    batch: int
    max_q: int

    @staticmethod
    def build(spans: list[SeqSpan], page_size: int, null_slot: int) -> AttentionMetadata:
        batch = len(spans)
        max_q = max(s.num_new for s in spans)
        max_kv = max(s.start + s.num_new for s in spans)
        slot_mapping, query_slot = [], []
        gather = torch.full((batch, max_kv), null_slot, dtype=torch.long)
        mask = torch.zeros(batch, 1, max_q, max_kv, dtype=torch.bool)
        for b, s in enumerate(spans):
            kv_len = s.start + s.num_new
            pos = torch.arange(kv_len)
            pages = torch.tensor(s.pages, dtype=torch.long)
            slots = pages[pos // page_size] * page_size + pos % page_size
            gather[b, :kv_len] = slots
            slot_mapping.append(slots[s.start:])
            query_slot.append(torch.arange(s.num_new) + b * max_q)
            if s.causal:
                q_pos = torch.arange(s.start, kv_len)
                mask[b, 0, : s.num_new, :kv_len] = pos[None, :] <= q_pos[:, None]
            else:
                mask[b, 0, : s.num_new, :kv_len] = True
        return AttentionMetadata(torch.cat(slot_mapping), gather, torch.cat(query_slot), mask, batch, max_q)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, pool: KVPool,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    # q: [num_tokens, heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim] → [num_tokens, heads * head_dim]
    pool.write(layer, meta.slot_mapping, k, v)
    num_tokens, heads, head_dim = q.shape
    # index_select on the flat slot list: advanced indexing with a 2-D index is ~1000x slower here
    flat = meta.gather_slots.view(-1)
    kv_shape = (meta.batch, -1, pool.geometry.num_kv_heads, head_dim)
    keys = pool.k[layer].index_select(0, flat).view(kv_shape).transpose(1, 2)   # [batch, kv_heads, max_kv, head_dim]
    values = pool.v[layer].index_select(0, flat).view(kv_shape).transpose(1, 2)
    # Every sequence with max_q new tokens (decode steps, equal windows): the flat rows are the padded layout.
    unpadded = num_tokens == meta.batch * meta.max_q
    if unpadded:
        queries = q.view(meta.batch, meta.max_q, heads, head_dim).transpose(1, 2)
    else:
        padded = q.new_zeros(meta.batch * meta.max_q, heads, head_dim)
        padded[meta.query_slot] = q
        queries = padded.view(meta.batch, meta.max_q, heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.mask, scale=scale,
                                         enable_gqa=True)             # [batch, heads, max_q, head_dim]
    out = out.transpose(1, 2).reshape(meta.batch * meta.max_q, heads * head_dim)
    return out if unpadded else out[meta.query_slot]
