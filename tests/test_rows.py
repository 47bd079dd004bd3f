"""The row-invariant attention kernel (attention/rows.cpp via rows.py): built on this machine, equal to the
reference implementation, and a row's bits depend only on its own query, keys and count: not on the rows beside
it, nor on whether its keys cross a split."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specserve.attention import rows


def case(num_rows: int, heads: int = 9, kv_heads: int = 3, d: int = 64, slots: int = 3000, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_rows, heads, d, generator=gen)
    k_pool, v_pool = torch.randn(slots, kv_heads, d, generator=gen), torch.randn(slots, kv_heads, d, generator=gen)
    seq_slots = torch.stack([torch.randperm(slots, generator=gen)[:1500] for _ in range(2)])
    return q, k_pool, v_pool, seq_slots


def test_the_kernel_is_built_on_this_machine():
    assert rows.register(), "the float32 attention kernel did not build here (see the log): gcc, ninja, AVX2?"


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_the_kernel_computes_what_the_reference_computes(kv_dtype):
    """float16 pools widen exactly as they are read: the reference sees the same rounded values."""
    rows.register()
    q, k_pool, v_pool, seq_slots = case(7)
    k_pool, v_pool = k_pool.to(kv_dtype), v_pool.to(kv_dtype)
    # keys 1, 8 and 9 (the vector tail), 511-513 and 1025 (across the 512-key splits), two sequences
    row_seq = torch.tensor([0, 0, 1, 1, 0, 1, 0])
    row_len = torch.tensor([1, 9, 511, 512, 513, 1025, 1500])
    got = torch.ops.specserve.paged_attention_rows(q, k_pool, v_pool, row_seq, row_len, seq_slots, 0.125)
    want = rows.reference(q.double(), k_pool.double(), v_pool.double(), row_seq, row_len, seq_slots, 0.125)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_a_row_gives_the_same_bits_alone_and_in_any_batch():
    rows.register()
    q, k_pool, v_pool, seq_slots = case(6, seed=1)
    row_seq, row_len = torch.tensor([0, 1, 0, 1, 0, 1]), torch.tensor([700, 64, 701, 1024, 1, 1499])
    batch = torch.ops.specserve.paged_attention_rows(q, k_pool, v_pool, row_seq, row_len, seq_slots, 0.1)
    for r in range(6):
        alone = torch.ops.specserve.paged_attention_rows(q[r:r + 1].contiguous(), k_pool, v_pool, row_seq[r:r + 1],
                                                         row_len[r:r + 1], seq_slots, 0.1)
        assert torch.equal(alone[0], batch[r]), f"row {r} alone differs from its batch"
    # the same row among other rows, in another order and with other threads
    torch.set_num_threads(2)
    try:
        order = torch.tensor([5, 3, 1, 0, 2, 4])
        shuffled = torch.ops.specserve.paged_attention_rows(q[order].contiguous(), k_pool, v_pool, row_seq[order],
                                                            row_len[order], seq_slots, 0.1)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(shuffled, batch[order])


def test_where_the_kernel_cannot_be_built_the_reference_serves_the_op():
    """A fresh process on a 'CPU without AVX2': the op is the per-row reference, and still row-invariant."""
    script = """
import torch
from specserve.attention import rows
from tests.test_rows import case
rows._has_avx2 = lambda: False
assert not rows.register()
q, k_pool, v_pool, seq_slots = case(3, seed=2)
row_seq, row_len = torch.tensor([0, 1, 0]), torch.tensor([5, 600, 6])
out = torch.ops.specserve.paged_attention_rows(q, k_pool, v_pool, row_seq, row_len, seq_slots, 0.1)
assert torch.equal(out, rows.reference(q, k_pool, v_pool, row_seq, row_len, seq_slots, 0.1))
alone = torch.ops.specserve.paged_attention_rows(q[1:2], k_pool, v_pool, row_seq[1:2], row_len[1:2], seq_slots, 0.1)
assert torch.equal(alone[0], out[1])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "float32 attention runs the slow reference" in done.stderr
