import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.kv_pages import KVGeometry, KVPool, OutOfPages, PageAllocator, split_pages
from specserve.native.ops import from_pool


def test_allocate_and_free_roundtrip():
    alloc = PageAllocator(4)
    pages = alloc.allocate(3)
    assert sorted(pages) == [0, 1, 2] and alloc.num_free == 1
    with pytest.raises(OutOfPages):
        alloc.allocate(2)
    alloc.free(pages)
    assert alloc.num_free == 4 and alloc.refcounts == [0] * 4


def test_shared_page_freed_only_when_last_owner_frees():
    alloc = PageAllocator(2)
    (page,) = alloc.allocate(1)
    alloc.share([page])
    alloc.free([page])
    assert alloc.num_free == 1 and alloc.refcounts[page] == 1
    alloc.free([page])
    assert alloc.num_free == 2


def test_double_free_is_caught():
    alloc = PageAllocator(2)
    pages = alloc.allocate(1)
    alloc.free(pages)
    with pytest.raises(AssertionError):
        alloc.free(pages)


ops = st.lists(st.tuples(st.sampled_from(["alloc", "share", "free"]), st.integers(0, 6), st.integers(0, 1000)),
               max_size=200)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_allocator_never_hands_out_used_pages_and_never_leaks(operations):
    alloc = PageAllocator(16)
    owners: list[list[int]] = []          # each owner holds one reference to each of its pages
    for op, n, pick in operations:
        if op == "alloc":
            free_before = set(alloc.free_page_ids())
            try:
                pages = alloc.allocate(n)
            except OutOfPages:
                assert n > len(free_before)
                continue
            assert set(pages) <= free_before and len(set(pages)) == len(pages)
            owners.append(pages)
        elif owners:
            target = owners[pick % len(owners)]
            if op == "share":
                alloc.share(target)
                owners.append(list(target))
            else:
                alloc.free(target)
                owners.remove(target)
        held = {}
        for pages in owners:
            for p in pages:
                held[p] = held.get(p, 0) + 1
        assert all(alloc.refcounts[p] == held.get(p, 0) for p in range(16))
        assert set(alloc.free_page_ids()) == {p for p in range(16) if p not in held}
    for pages in owners:
        alloc.free(pages)
    assert alloc.num_free == 16 and not any(alloc.refcounts)


def test_pool_sizes_and_split_by_bytes_per_token():
    target = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    draft = KVGeometry(num_layers=1, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    assert target.bytes_per_token == 46080
    pages = split_pages(1 << 30, 16, [target, draft])
    assert pages == (1 << 30) // (16 * (46080 + 1536))
    pool = KVPool(draft, pages, 16)
    assert pool.k.shape == (1, (pages + 1) * 16, 3, 64)
    assert pool.k[0, pool.null_slot:].abs().sum() == 0


def test_fill_pages_touches_only_those_pages():
    pool = KVPool(KVGeometry(2, 1, 4, torch.float64), 3, 4)
    pool.fill_pages([1], float("nan"))
    assert pool.k[:, 4:8].isnan().all() and not pool.k[:, :4].isnan().any() and not pool.k[:, 8:].isnan().any()


def test_an_int8_pool_holds_each_heads_scale_after_its_values_and_reads_back_what_was_written():
    geometry = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.int8)
    assert geometry.head_width == 68 and geometry.bytes_per_token == 2 * 30 * 3 * 68
    pool = KVPool(KVGeometry(2, 3, 64, torch.int8), 3, 4)
    assert pool.k.shape == (2, 16, 3, 68) and pool.k.dtype == torch.int8
    k, v = torch.randn(4, 3, 64), torch.randn(4, 3, 64) * 100
    pool.write(1, torch.arange(4, 8), k, v)
    for written, stored in ((k, pool.k[1, 4:8]), (v, pool.v[1, 4:8])):
        peak = written.abs().amax(-1, keepdim=True)
        # at most half a level of the head's own scale off
        assert ((from_pool(stored, torch.float32) - written).abs() <= peak / 127 * 0.5 + 1e-6).all()
    pool.fill_pages([2], float("nan"))
    assert from_pool(pool.k[:, 8:12], torch.float32).isnan().all()
    assert not from_pool(pool.k[:, :8], torch.float32).isnan().any()
