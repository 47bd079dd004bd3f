"""Huge-page backed tensors: the same values as ordinary ones, in one advised mapping."""
import sys
from pathlib import Path

import pytest
import torch

from specserve.native import hugepages


def vm_flags(address: int) -> list[str]:
    """The flags of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_zeros_are_zero_and_start_on_a_huge_page():
    t = hugepages.zeros(3 * hugepages.HUGE_PAGE // 4 + 5, torch.float32)
    assert t.dtype == torch.float32 and t.numel() == 3 * hugepages.HUGE_PAGE // 4 + 5
    assert not t.any()
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    t[-1] = 7.0                                   # writable to its last element
    assert t[-1].item() == 7.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps are Linux's")
def test_the_mapping_is_advised_for_huge_pages_and_private():
    t = hugepages.zeros(hugepages.HUGE_PAGE, torch.uint8)
    flags = vm_flags(t.data_ptr())
    assert "hg" in flags              # MADV_HUGEPAGE
    assert "sh" not in flags          # shared anonymous memory would stay in 4 KB pages


def test_small_requests_are_ordinary_tensors():
    t = hugepages.zeros(100, torch.int8)
    assert t.numel() == 100 and not t.any()


def test_gathered_copies_equal_the_originals_side_by_side_in_one_arena():
    torch.manual_seed(0)
    tensors = [torch.randint(-127, 128, (48, 36, 16, 4), dtype=torch.int8), torch.randn(7),
               torch.randint(-127, 128, (3, 5, 4, 32), dtype=torch.int8), torch.randn(1 << 20)]
    copies = hugepages.gathered(tensors)
    storage = copies[0].untyped_storage().data_ptr()
    for t, c in zip(tensors, copies):
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous() and torch.equal(c, t)
        assert c.untyped_storage().data_ptr() == storage and c.data_ptr() % hugepages.ALIGN == 0
    ends = [c.data_ptr() + c.numel() * c.element_size() for c in copies]
    assert all(end <= nxt.data_ptr() for end, nxt in zip(ends, copies[1:]))     # in order, none overlapping
