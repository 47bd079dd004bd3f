"""Attention over paged KV on the CPU; prefill, decode and verify windows mix freely. Two paths:
- float32, float16 and int8 pools: the row-invariant kernel (rows.cpp), each query row computed alone from its keys
  (in float32; float16 K/V widen exactly as they are read, int8 K/V as int8 x their head's scale), read in place
  through its sequence's slot table (`RowTables`); a row's result never depends on the rows beside it;
- other pools (float64): ragged queries (each sequence its own count and positions) packed into padded SDPA
  calls (`AttentionChunk`), exact up to float64 rounding.
paged_attention and what it reads are TorchScript-compatible: llama.py scripts the layer stack."""
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from specserve import native
from specserve.kv_pages import KVPool, slots_for
from specserve.native.ops import to_pool

# Decode steps, verify windows and short chunks take the grouped layout (a float64 decode step at a 4k context
# ran ~1.7x faster in it than in SDPA's own GQA path); long prefills ran 5-20% slower in it.
GROUPED_MAX_Q = 16


@dataclass(frozen=True)
class SeqSpan:
    """One sequence in a forward: `num_new` tokens at positions [start, start+num_new), written into
    `pages`; they attend to every position < start + num_new (causal within the new tokens)."""
    pages: list[int]
    start: int
    num_new: int
    causal: bool = True   # block drafters run their block non-causally


class AttentionChunk(NamedTuple):
    """Consecutive sequences attended in one padded SDPA call; their tokens are rows
    [token_start, token_start + num_tokens) of the forward. (A NamedTuple: TorchScript takes it.)"""
    token_start: int
    num_tokens: int
    gather_slots: torch.Tensor     # [batch, max_kv] slots read per sequence (padding → the zero page)
    query_slot: torch.Tensor       # [num_tokens] index of each token in the padded [batch * max_q] queries
    mask: Optional[torch.Tensor]   # [batch, 1, max_q, max_kv] True = may attend; None: every row sees every key
    batch: int
    max_q: int
    grouped: bool                  # attend in _grouped_attention's layout rather than SDPA's own GQA path
    # A lone sequence whose K/V slots are consecutive (its pages were handed out in a row) is read in place
    # from this slot on, without gathering a copy: at a 4k context the copy cost more than the attention.
    first_slot: Optional[int] = None

    @staticmethod
    def build(spans: list[SeqSpan], token_start: int, page_size: int,
              null_slot: int) -> tuple["AttentionChunk", list[torch.Tensor]]:
        """The chunk and each sequence's new-token slots."""
        batch = len(spans)
        max_q = max(s.num_new for s in spans)
        max_kv = max(s.start + s.num_new for s in spans)
        slot_mapping, query_slot = [], []
        gather = torch.full((batch, max_kv), null_slot, dtype=torch.long)
        mask = torch.zeros(batch, 1, max_q, max_kv, dtype=torch.bool)
        for b, s in enumerate(spans):
            kv_len = s.start + s.num_new
            slots = slots_for(s.pages, 0, kv_len, page_size)
            gather[b, :kv_len] = slots
            slot_mapping.append(slots[s.start:])
            query_slot.append(torch.arange(s.num_new) + b * max_q)
            if s.causal:
                q_pos = torch.arange(s.start, kv_len)
                mask[b, 0, : s.num_new, :kv_len] = torch.arange(kv_len)[None, :] <= q_pos[:, None]
            else:
                mask[b, 0, : s.num_new, :kv_len] = True
        num_tokens = sum(s.num_new for s in spans)
        first_slot = None
        if batch == 1:
            used = spans[0].pages[:-(-max_kv // page_size)]
            if used == list(range(used[0], used[0] + len(used))):
                first_slot = used[0] * page_size
            if spans[0].num_new == 1 or not spans[0].causal:
                mask = None
        chunk = AttentionChunk(token_start, num_tokens, gather, torch.cat(query_slot), mask, batch, max_q,
                               max_q <= GROUPED_MAX_Q, first_slot)
        return chunk, slot_mapping


class RowTables(NamedTuple):
    """What the row-invariant kernel reads: each query row attends keys 0 .. length - 1 of its sequence."""
    seq: torch.Tensor              # [num_tokens] the row's sequence
    length: torch.Tensor           # [num_tokens] keys the row attends (its position + 1, or the whole block)
    slots: torch.Tensor            # [num_seqs, max_kv] each sequence's key slots (padding: the zero page)

    @staticmethod
    def build(spans: list[SeqSpan], page_size: int, null_slot: int) -> tuple["RowTables", torch.Tensor]:
        """The tables and the new tokens' slots."""
        if len(spans) == 1:     # batch 1: four small ops rather than a table filled row by row (~40 µs a step)
            s = spans[0]
            kv_len = s.start + s.num_new
            slots = slots_for(s.pages, 0, kv_len, page_size)
            length = torch.arange(s.start + 1, kv_len + 1) if s.causal else torch.full((s.num_new,), kv_len)
            return RowTables(torch.zeros(s.num_new, dtype=torch.long), length, slots[None]), slots[s.start:]
        max_kv = max(s.start + s.num_new for s in spans)
        slots = torch.full((len(spans), max_kv), null_slot, dtype=torch.long)
        seq, length, slot_mapping = [], [], []
        for b, s in enumerate(spans):
            kv_len = s.start + s.num_new
            slots[b, :kv_len] = slots_for(s.pages, 0, kv_len, page_size)
            slot_mapping.append(slots[b, s.start:kv_len])
            seq.append(torch.full((s.num_new,), b, dtype=torch.long))
            length.append(torch.arange(s.start + 1, kv_len + 1) if s.causal else torch.full((s.num_new,), kv_len))
        return RowTables(torch.cat(seq), torch.cat(length), slots), torch.cat(slot_mapping)


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor     # [num_tokens] where each new token's K/V is written
    chunks: tuple[AttentionChunk, ...]
    rows: Optional[RowTables] = None      # set: the row-invariant kernel attends, and `chunks` is empty

    @staticmethod
    def for_pool(spans: list[SeqSpan], pool: KVPool) -> "AttentionMetadata":
        """The metadata of the path the pool's dtype takes: the row-invariant kernel for float32, float16 and int8."""
        if pool.geometry.dtype in (torch.float32, torch.float16, torch.int8):
            native.register()
            rows, slot_mapping = RowTables.build(spans, pool.page_size, pool.null_slot)
            return AttentionMetadata(slot_mapping, (), rows)
        return AttentionMetadata.build(spans, pool.page_size, pool.null_slot)

    def to(self, device: torch.device | str) -> "AttentionMetadata":
        """The same metadata with its tensors on `device` (the drafter trainer's target pass on a GPU)."""
        chunks = tuple(c._replace(gather_slots=c.gather_slots.to(device), query_slot=c.query_slot.to(device),
                                  mask=None if c.mask is None else c.mask.to(device)) for c in self.chunks)
        rows = None if self.rows is None else RowTables(*(t.to(device) for t in self.rows))
        return AttentionMetadata(self.slot_mapping.to(device), chunks, rows)

    # Padded K/V rows gathered per SDPA call. A whole large batch gathered at once falls out of the CPU
    # caches: 32 chat requests decoded at ~110 tokens/s in one call per layer, ~170 in chunks of 1024 rows
    # (256: one sequence per call, the calls' overhead wins). Each chunk also pads only to its own longest.
    CHUNK_KV_ROWS = 1024

    @staticmethod
    def build(spans: list[SeqSpan], page_size: int, null_slot: int,
              chunk_kv_rows: int = CHUNK_KV_ROWS) -> "AttentionMetadata":
        groups: list[list[SeqSpan]] = [[]]
        widest = 0                          # longest K/V of the last group
        for s in spans:
            kv_len = s.start + s.num_new
            if groups[-1] and max(widest, kv_len) * (len(groups[-1]) + 1) > chunk_kv_rows:
                groups.append([])
                widest = 0
            groups[-1].append(s)
            widest = max(widest, kv_len)
        chunks, slot_mapping, token_start = [], [], 0
        for group in groups:
            chunk, slots = AttentionChunk.build(group, token_start, page_size, null_slot)
            chunks.append(chunk)
            slot_mapping += slots
            token_start += chunk.num_tokens
        return AttentionMetadata(torch.cat(slot_mapping), tuple(chunks))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_pool: torch.Tensor, v_pool: torch.Tensor,   # one layer's [num_slots, kv_heads, head_dim]
                    slot_mapping: torch.Tensor, chunks: list[AttentionChunk], rows: Optional[RowTables],
                    scale: float) -> torch.Tensor:
    """Attention in the pool's dtype: with `rows`, the float32 row-invariant kernel; else padded SDPA calls per
    chunk in the wider of q's and the pool's dtypes (a float64 pool makes a row's result independent of the rows
    beside it to float64 rounding; a float16 pool, off the CPU, attends in float32 as the row kernel does).
    q: [num_tokens, heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim] → [num_tokens, heads * head_dim]
    in q's dtype."""
    kv_dtype = k_pool.dtype
    k_pool.index_copy_(0, slot_mapping, to_pool(k, kv_dtype))
    v_pool.index_copy_(0, slot_mapping, to_pool(v, kv_dtype))
    if rows is not None:
        out = torch.ops.specserve.paged_attention_rows(q.float().contiguous(), k_pool, v_pool, rows.seq,
                                                       rows.length, rows.slots, scale)
        return out.view(q.shape[0], -1).to(q.dtype)
    q_kv = q.to(torch.promote_types(q.dtype, kv_dtype))
    outs = [_attend_chunk(q_kv[c.token_start:c.token_start + c.num_tokens], k_pool, v_pool, c, scale)
            for c in chunks]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.to(q.dtype)


def _attend_chunk(q: torch.Tensor,   # [chunk tokens, heads, head_dim]
                  k_pool: torch.Tensor, v_pool: torch.Tensor, chunk: AttentionChunk, scale: float) -> torch.Tensor:
    num_tokens, heads, head_dim = q.shape
    kv_shape = [chunk.batch, -1, k_pool.shape[1], head_dim]
    first_slot = chunk.first_slot
    if first_slot is not None:
        end = first_slot + chunk.gather_slots.shape[1]
        keys, values = k_pool[first_slot:end], v_pool[first_slot:end]
    else:
        # index_select on the flat slot list: advanced indexing with a 2-D index is ~1000x slower here
        flat = chunk.gather_slots.view(-1)
        keys, values = k_pool.index_select(0, flat), v_pool.index_select(0, flat)
    keys = keys.view(kv_shape).transpose(1, 2).to(q.dtype)       # [batch, kv_heads, max_kv, head_dim]
    values = values.view(kv_shape).transpose(1, 2).to(q.dtype)
    # Every sequence with max_q new tokens (decode steps, equal windows): the flat rows are the padded layout.
    unpadded = num_tokens == chunk.batch * chunk.max_q
    if unpadded:
        queries = q.view(chunk.batch, chunk.max_q, heads, head_dim)
    else:
        padded = q.new_zeros(chunk.batch * chunk.max_q, heads, head_dim)
        padded.index_copy_(0, chunk.query_slot, q)
        queries = padded.view(chunk.batch, chunk.max_q, heads, head_dim)
    if chunk.grouped:
        out = _grouped_attention(queries, keys, values, chunk.mask, scale)
    else:
        out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, attn_mask=chunk.mask,
                                             scale=scale, enable_gqa=True)    # [batch, heads, max_q, head_dim]
        out = out.transpose(1, 2).reshape(chunk.batch * chunk.max_q, heads * head_dim)
    return out if unpadded else out.index_select(0, chunk.query_slot)


def _grouped_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """Several queries per sequence: the query heads sharing a K/V head become rows of one query
    block (heads × positions). SDPA's CPU kernel ran ~2x slower per call once a sequence had more than
    one query row (4 sequences × 2 rows: 280 us, against 150 us grouped and 140 us for 1 row).
    queries: [batch, max_q, heads, head_dim]; keys, values: [batch, kv_heads, max_kv, head_dim];
    mask: [batch, 1, max_q, max_kv] → [batch * max_q, heads * head_dim]"""
    batch, max_q, heads, head_dim = queries.shape
    kv_heads, max_kv = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    q = queries.view(batch, max_q, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(batch, kv_heads, group * max_q, head_dim)
    m = None if mask is None else mask[:, :, None].expand(batch, 1, group, max_q, max_kv).reshape(
        batch, 1, group * max_q, max_kv)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=m, scale=scale)
    out = out.view(batch, kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch * max_q, heads * head_dim)
