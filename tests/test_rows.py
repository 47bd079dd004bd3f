"""The row-invariant attention kernels (native/rows.cpp, references in native/ops.py): equal to the references,
and a row's bits depend only on its own query, keys and count: not on the rows beside it, nor on whether its keys
cross a split."""
import pytest
import torch

from specserve import native
from specserve.native import ops

KV_DTYPES = [torch.float32, torch.float16, torch.int8]
# (heads, kv_heads, head_dim): head_dim 64 and 128 take the AVX-512 path on CPUs that have it, 24 the AVX2 path
SHAPES = [(9, 3, 64), (12, 2, 128), (6, 2, 24)]


def exact(pool: torch.Tensor) -> torch.Tensor:
    """The values a pool holds, as the kernel reads them, in float64 (int8: int8 x scale)."""
    return ops.from_pool(pool, torch.float32).double()


def scored(q: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """The queries the kernel scores against `pool`, in float64: an int8 pool's are quantized as its keys are."""
    return (ops.quantize_query(q) if pool.dtype == torch.int8 else q).double()


def case(num_rows: int, shape: tuple[int, int, int] = SHAPES[0], slots: int = 3000, seed: int = 0):
    heads, kv_heads, d = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_rows, heads, d, generator=gen)
    k_pool, v_pool = torch.randn(slots, kv_heads, d, generator=gen), torch.randn(slots, kv_heads, d, generator=gen)
    seq_slots = torch.stack([torch.randperm(slots, generator=gen)[:1500] for _ in range(2)])
    return q, k_pool, v_pool, seq_slots


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_kernel_computes_what_the_reference_computes(kv_dtype, shape):
    """float16 pools widen exactly as they are read, int8 ones as int8 x scale: the reference sees the same values."""
    native.register()
    q, k_pool, v_pool, seq_slots = case(7, shape)
    k_pool, v_pool = ops.to_pool(k_pool, kv_dtype), ops.to_pool(v_pool, kv_dtype)
    # keys 1, 8 and 9 (the vector tail), 511-513 and 1025 (across the 512-key splits), two sequences
    row_seq = torch.tensor([0, 0, 1, 1, 0, 1, 0])
    row_len = torch.tensor([1, 9, 511, 512, 513, 1025, 1500])
    got = torch.ops.specserve.paged_attention_rows(q, k_pool, v_pool, row_seq, row_len, seq_slots, 0.125)
    want = ops.paged_attention_rows(scored(q, k_pool), exact(k_pool), exact(v_pool), row_seq, row_len, seq_slots, 0.125)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_row_gives_the_same_bits_alone_and_in_any_batch(kv_dtype, shape):
    native.register()
    q, k_pool, v_pool, seq_slots = case(6, shape, seed=1)
    k_pool, v_pool = ops.to_pool(k_pool, kv_dtype), ops.to_pool(v_pool, kv_dtype)
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


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_rows_of_one_sequence_share_a_pass_and_keep_their_bits(kv_dtype, shape):
    """Consecutive rows of one sequence (a verify window, a prefill chunk) are attended together, 16 at a time:
    each row's bits are those it has alone; lengths cross a split and the 8- and 16-key blocks."""
    native.register()
    q, k_pool, v_pool, seq_slots = case(21, shape, seed=4)
    k_pool, v_pool = ops.to_pool(k_pool, kv_dtype), ops.to_pool(v_pool, kv_dtype)
    seq_slots[0, :600] = torch.arange(600)           # runs of adjacent slots, read in place from float32 pools
    row_seq = torch.tensor([0] * 20 + [1])
    row_len = torch.tensor(list(range(505, 525)) + [9])
    window = torch.ops.specserve.paged_attention_rows(q, k_pool, v_pool, row_seq, row_len, seq_slots, 0.125)
    for r in range(21):
        alone = torch.ops.specserve.paged_attention_rows(q[r:r + 1].contiguous(), k_pool, v_pool, row_seq[r:r + 1],
                                                         row_len[r:r + 1], seq_slots, 0.125)
        assert torch.equal(alone[0], window[r]), f"row {r} in its window differs from the row alone"
    want = ops.paged_attention_rows(scored(q, k_pool), exact(k_pool), exact(v_pool), row_seq, row_len, seq_slots, 0.125)
    torch.testing.assert_close(window.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_row_gives_the_same_bits_wherever_its_keys_sit_in_the_pool(kv_dtype):
    """Runs of adjacent slots (read in place) and scattered slots (gathered first) give the same bits."""
    native.register()
    q, k_pool, v_pool, _ = case(2, slots=1100, seed=2)
    k_pool, v_pool = ops.to_pool(k_pool, kv_dtype), ops.to_pool(v_pool, kv_dtype)
    adjacent = torch.arange(1100)[None]
    where = torch.randperm(1100)
    k_moved, v_moved = torch.empty_like(k_pool), torch.empty_like(v_pool)
    k_moved[where], v_moved[where] = k_pool, v_pool
    row_seq, row_len = torch.tensor([0, 0]), torch.tensor([1100, 517])
    in_place = torch.ops.specserve.paged_attention_rows(q, k_pool, v_pool, row_seq, row_len, adjacent, 0.125)
    gathered = torch.ops.specserve.paged_attention_rows(q, k_moved, v_moved, row_seq, row_len, where[None], 0.125)
    assert torch.equal(in_place, gathered)
    want = ops.paged_attention_rows(scored(q, k_pool), exact(k_pool), exact(v_pool), row_seq, row_len, adjacent, 0.125)
    torch.testing.assert_close(in_place.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_fused_op_rotates_writes_and_attends_as_the_reference(kv_dtype):
    """paged_attention_qkv: the same K/V bits written (rotary as ops.apply_rope), the same attention up to
    rounding; rows of a verify window see each other's new keys."""
    native.register()
    heads, kv_heads, d, rows_count = 9, 3, 64, 5
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(rows_count, (heads + 2 * kv_heads) * d, generator=gen)
    angles = torch.rand(rows_count, d, generator=gen) * 6
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]             # [rows, 1, head_dim], as Rope.tables
    pools = [(ops.to_pool(torch.randn(40, kv_heads, d, generator=gen), kv_dtype),
              ops.to_pool(torch.randn(40, kv_heads, d, generator=gen), kv_dtype)) for _ in range(2)]
    pools[1] = (pools[0][0].clone(), pools[0][1].clone())
    seq_slots = torch.tensor([[7, 3, 30, 31, 32, 33, 12, 13], [1, 2, 20, 21, 0, 0, 0, 0]])
    slot_mapping = torch.tensor([31, 32, 33, 20, 21])          # sequence 0: positions 3-5; sequence 1: 2-3
    row_seq, row_len = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([4, 5, 6, 3, 4])
    args = (slot_mapping, row_seq, row_len, seq_slots, heads, 0.125)
    got = torch.ops.specserve.paged_attention_qkv(qkv, cos, sin, *pools[0], *args)
    want = ops.paged_attention_qkv(qkv, cos, sin, *pools[1], *args)
    assert torch.equal(pools[0][0], pools[1][0]) and torch.equal(pools[0][1], pools[1][1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    alone = torch.ops.specserve.paged_attention_qkv(qkv[4:], cos[4:], sin[4:], *pools[0], slot_mapping[4:],
                                                    row_seq[4:], row_len[4:], seq_slots, heads, 0.125)
    assert torch.equal(alone[0], got[4])
