import math

import pytest
import torch

from specserve.attention import sdpa
from specserve.attention.sdpa import AttentionMetadata, SeqSpan, paged_attention
from specserve.kv_pages import KVGeometry, KVPool
from specserve.native import ops


def reference(q, k, v, causal_offset, causal):
    # q: [n, heads, d]; k, v: [kv_len, kv_heads, d]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        qpos = torch.arange(q.shape[0])[:, None] + causal_offset
        scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


@pytest.mark.parametrize("grouped_max_q", [sdpa.GROUPED_MAX_Q, 0])
@pytest.mark.parametrize("chunk_kv_rows", [AttentionMetadata.CHUNK_KV_ROWS, 24, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_ragged_paged_attention_matches_per_sequence_reference(causal, chunk_kv_rows, grouped_max_q, monkeypatch):
    monkeypatch.setattr(sdpa, "GROUPED_MAX_Q", grouped_max_q)    # 0: every query count takes the plain layout
    torch.manual_seed(0)
    page_size, heads, kv_heads, d = 4, 4, 2, 8
    pool = KVPool(KVGeometry(1, kv_heads, d, torch.float64), 12, page_size)
    pool.fill_pages(list(range(12)), float("nan"))      # nothing unwritten may be read
    # (cached tokens, new tokens, pages): decode, prefill, verify window, mid-prefill chunk
    layout = [(5, 1, [7, 2]), (0, 6, [0, 9]), (3, 4, [4, 5]), (8, 3, [1, 3, 10])]
    history = {}
    for b, (cached, _, pages) in enumerate(layout):
        if cached:
            k, v = (torch.randn(cached, kv_heads, d, dtype=torch.float64) for _ in range(2))
            meta = AttentionMetadata.build([SeqSpan(pages, 0, cached)], page_size, pool.null_slot)
            pool.write(0, meta.slot_mapping, k, v)
            history[b] = (k, v)
    spans = [SeqSpan(pages, cached, new, causal) for cached, new, pages in layout]
    meta = AttentionMetadata.build(spans, page_size, pool.null_slot, chunk_kv_rows)
    # sequences go together while their padded K/V fits the budget, and always at least one per chunk
    want = {AttentionMetadata.CHUNK_KV_ROWS: [4], 24: [3, 1], 1: [1, 1, 1, 1]}[chunk_kv_rows]
    assert [c.batch for c in meta.chunks] == want
    total = sum(new for _, new, _ in layout)
    q = torch.randn(total, heads, d, dtype=torch.float64)
    k = torch.randn(total, kv_heads, d, dtype=torch.float64)
    v = torch.randn(total, kv_heads, d, dtype=torch.float64)
    out = paged_attention(q, k, v, pool.k[0], pool.v[0], meta.slot_mapping, list(meta.chunks), None, d ** -0.5)
    assert not out.isnan().any()
    off = 0
    for b, (cached, new, _) in enumerate(layout):
        hk, hv = history.get(b, (k[:0], v[:0]))
        full_k, full_v = torch.cat([hk, k[off:off + new]]), torch.cat([hv, v[off:off + new]])
        ref = reference(q[off:off + new], full_k, full_v, cached, causal)
        torch.testing.assert_close(out[off:off + new], ref, rtol=1e-10, atol=1e-10)
        off += new


@pytest.mark.parametrize("pages, first_slot", [([2, 3, 4], 8), ([2, 4, 3], None)])
def test_a_lone_sequence_on_consecutive_pages_is_read_in_place_in_the_pools_dtype(pages, first_slot):
    """Consecutive pages are read without a gathered copy; either way the result is the reference's. A float32
    query against a float64 pool is attended in float64 and comes back as float32."""
    torch.manual_seed(1)
    page_size, heads, kv_heads, d, cached = 4, 4, 2, 8, 9
    pool = KVPool(KVGeometry(1, kv_heads, d, torch.float64), 6, page_size)
    pool.fill_pages(list(range(6)), float("nan"))
    k, v = torch.randn(cached + 2, kv_heads, d), torch.randn(cached + 2, kv_heads, d)
    pool.write(0, AttentionMetadata.build([SeqSpan(pages, 0, cached)], page_size, pool.null_slot).slot_mapping,
               k[:cached].double(), v[:cached].double())
    for new in (1, 2):                       # a decode step (no mask needed) and a window of two
        meta = AttentionMetadata.build([SeqSpan(pages, cached, new)], page_size, pool.null_slot)
        assert meta.chunks[0].first_slot == first_slot and (meta.chunks[0].mask is None) == (new == 1)
        q = torch.randn(new, heads, d)
        out = paged_attention(q, k[cached:cached + new], v[cached:cached + new], pool.k[0], pool.v[0],
                              meta.slot_mapping, list(meta.chunks), None, d ** -0.5)
        assert out.dtype == torch.float32
        ref = reference(q.double(), k[:cached + new].double(), v[:cached + new].double(), cached, True)
        torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("causal", [True, False])
def test_a_float32_pool_attends_row_by_row_and_each_row_alone_gives_the_same_bits(causal, kv_dtype):
    """The float32 path (AttentionMetadata.for_pool → the row-invariant kernel): the reference's result for the
    ragged layout, and each sequence run alone (fewer rows, other chunking) gives bit for bit the same rows."""
    torch.manual_seed(2)
    page_size, heads, kv_heads, d = 4, 4, 2, 8
    layout = [(5, 1, [7, 2]), (0, 6, [0, 9]), (3, 4, [4, 5]), (8, 3, [1, 3, 10])]
    pool = KVPool(KVGeometry(1, kv_heads, d, kv_dtype), 12, page_size)
    pool.fill_pages(list(range(12)), float("nan"))
    total = sum(new for _, new, _ in layout)
    history = [(torch.randn(c, kv_heads, d), torch.randn(c, kv_heads, d)) for c, _, _ in layout]
    q, k, v = torch.randn(total, heads, d), torch.randn(total, kv_heads, d), torch.randn(total, kv_heads, d)

    def attend(members: list[int]) -> torch.Tensor:
        for b in members:
            cached, _, pages = layout[b]
            if cached:
                pool.write(0, AttentionMetadata.for_pool([SeqSpan(pages, 0, cached)], pool).slot_mapping, *history[b])
        spans = [SeqSpan(layout[b][2], layout[b][0], layout[b][1], causal) for b in members]
        meta = AttentionMetadata.for_pool(spans, pool)
        assert meta.rows is not None and not meta.chunks
        rows = torch.cat([torch.arange(sum(n for _, n, _ in layout[:b]), sum(n for _, n, _ in layout[:b + 1]))
                          for b in members])
        return paged_attention(q[rows], k[rows], v[rows], pool.k[0], pool.v[0], meta.slot_mapping,
                               list(meta.chunks), meta.rows, d ** -0.5)

    out = attend(list(range(len(layout))))
    off = 0
    for b, (cached, new, _) in enumerate(layout):
        full_k, full_v = torch.cat([history[b][0], k[off:off + new]]), torch.cat([history[b][1], v[off:off + new]])
        # the pool holds the K/V rounded to its dtype
        full_k, full_v = [ops.from_pool(ops.to_pool(t, kv_dtype), torch.float64) for t in (full_k, full_v)]
        # and an int8 pool scores its queries rounded as its keys are
        q_scored = ops.quantize_query(q[off:off + new]) if kv_dtype == torch.int8 else q[off:off + new]
        ref = reference(q_scored.double(), full_k, full_v, cached, causal)
        torch.testing.assert_close(out[off:off + new].double(), ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(attend([b]), out[off:off + new]), f"sequence {b} alone differs from its rows in the batch"
        off += new
