"""Tensors in memory the kernel backs with 2 MB transparent huge pages (Linux, THP in "madvise" or "always" mode).

A decode step streams every weight once, in a few hundred reads of 0.3-28 MB. In 4 KB pages each read walks the page
tables every 4 KB; in huge pages every 2 MB. On this project's 2-core hosts the batch-1 forward of SmolLM2 ran ~15%
faster with its int8 weights in huge pages (benchmarks/decode.py measures it). torch's own allocator asks for them
only under THP_MEM_ALLOC_ENABLE, read once at torch's start, so the memory here is an anonymous mapping of our own,
advised before its first touch (pages already faulted in as 4 KB stay so)."""
from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64                  # each tensor of an arena starts on a cache line


def zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D zero tensor of `numel` elements, in huge pages where the system grants them (a fresh anonymous mapping
    is zero-filled by the kernel, page by page as it is touched)."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(numel, dtype=dtype)
    # private: Python's default anonymous mapping is shared memory, which THP's "madvise" mode leaves in 4 KB pages
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # slack: a 2 MB start
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)   # holds the mapping for as long as any view of it lives
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes].view(dtype)


def gathered(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (contiguous, any dtypes) side by side in one huge-page arena, in order."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    arena = zeros(end, torch.uint8)
    copies = []
    for t, offset in zip(tensors, offsets):
        nbytes = t.numel() * t.element_size()
        copy = arena[offset:offset + nbytes].view(t.dtype).view(t.shape)
        copy.copy_(t)
        copies.append(copy)
    return copies
