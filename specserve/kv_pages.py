"""Paged KV memory: one PageAllocator hands out page ids; each model (target, drafter) has a KVPool
over those same ids. A pool keeps one extra all-zero page that is never handed out: padded reads
point there, so a masked-out key is always finite."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from specserve import native
from specserve.config import ModelConfig
from specserve.native import hugepages
from specserve.native.ops import KV_SCALE_BYTES, to_pool

log = logging.getLogger(__name__)


class OutOfPages(Exception):
    pass


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"the KV cache needs at least one page, got {num_pages}: raise the memory budget")
        self.num_pages = num_pages
        self.refcounts = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))   # pop() hands out low ids first
        # Pages the prefix cache holds, and how many of them nobody else does: kept as refcounts
        # change, because /metrics reads it every step and the cache may hold most of the pool.
        self._cached = [False] * num_pages
        self.num_cache_only = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            assert self.refcounts[p] == 0, f"page {p} handed out while in use"
            self.refcounts[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refcounts[p] > 0, f"cannot share free page {p}"
            self.num_cache_only -= self._cached[p] and self.refcounts[p] == 1
            self.refcounts[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refcounts[p] > 0, f"double free of page {p}"
            self.refcounts[p] -= 1
            self.num_cache_only += self._cached[p] and self.refcounts[p] == 1
            if self.refcounts[p] == 0:
                assert not self._cached[p], f"freed page {p} while the prefix cache holds it"
                self._free.append(p)

    def set_cached(self, pages: list[int], cached: bool) -> None:
        """Mark pages as held (or no longer held) by the prefix cache, whose own reference they already
        (still) carry."""
        for p in pages:
            assert self.refcounts[p] > 0 and self._cached[p] != cached, f"page {p} cannot change its cached mark"
            self._cached[p] = cached
            self.num_cache_only += (1 if cached else -1) * (self.refcounts[p] == 1)

    def free_page_ids(self) -> list[int]:
        return list(self._free)


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @staticmethod
    def of(config: ModelConfig, dtype: torch.dtype) -> KVGeometry:
        return KVGeometry(config.num_layers, config.num_kv_heads, config.head_dim, dtype)

    @property
    def head_width(self) -> int:
        """Elements of one KV head in a slot: its head_dim values, and in an int8 pool their scale's 4 bytes."""
        return self.head_dim + (KV_SCALE_BYTES if self.dtype == torch.int8 else 0)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_width * self.dtype.itemsize


class KVPool:
    """K/V of one model for every page: k[layer] is [num_slots, kv_heads, head_width], slot = page*page_size + offset
    (head_width: head_dim, plus an int8 pool's scale bytes)."""

    def __init__(self, geometry: KVGeometry, num_pages: int, page_size: int,
                 device: torch.device | str = "cpu") -> None:
        self.geometry = geometry
        self.num_pages = num_pages
        self.page_size = page_size
        self.null_slot = num_pages * page_size      # first slot of the reserved zero page
        shape = (geometry.num_layers, (num_pages + 1) * page_size, geometry.num_kv_heads, geometry.head_width)
        if torch.device(device).type == "cpu":
            self.k = hugepages.zeros(math.prod(shape), geometry.dtype).view(shape)    # a long context's reads
            self.v = hugepages.zeros(math.prod(shape), geometry.dtype).view(shape)
        else:
            self.k = torch.zeros(shape, dtype=geometry.dtype, device=device)
            self.v = torch.zeros(shape, dtype=geometry.dtype, device=device)
        # each layer's view, made once: taking k[i] inside the scripted layer stack is an op per layer and step
        self.k_layers, self.v_layers = list(self.k.unbind(0)), list(self.v.unbind(0))
        if geometry.dtype == torch.int8:
            native.register()     # its quantize_kv op writes the pool

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots: [num_tokens]; k, v: [num_tokens, kv_heads, head_dim], rounded to the pool's dtype
        self.k[layer].index_copy_(0, slots, to_pool(k, self.k.dtype))
        self.v[layer].index_copy_(0, slots, to_pool(v, self.v.dtype))

    def fill_pages(self, pages: list[int], value: float) -> None:
        """Overwrite whole pages (tests poison free pages with NaN to prove they are never read); an int8 pool reads
        every value as `value` (its values 1, their scale `value`)."""
        if not pages:
            return
        idx = (torch.tensor(pages)[:, None] * self.page_size + torch.arange(self.page_size)).flatten()
        fill = torch.full((self.geometry.head_dim,), value)
        if self.geometry.dtype == torch.int8:
            fill = torch.cat([torch.ones(self.geometry.head_dim, dtype=torch.int8),
                              torch.tensor([value], dtype=torch.float32).view(torch.int8)])
        self.k[:, idx] = fill.to(self.k.dtype)
        self.v[:, idx] = fill.to(self.v.dtype)


def split_pages(memory_bytes: int, page_size: int, geometries: list[KVGeometry]) -> int:
    """Pages that fit the budget when every pool holds every page (pools share page ids)."""
    bytes_per_page = page_size * sum(g.bytes_per_token for g in geometries)
    return max(memory_bytes // bytes_per_page, 0)


def slots_for(pages: list[int], start: int, end: int, page_size: int) -> torch.Tensor:
    """[end - start] the pool slots of positions start .. end - 1 of a sequence holding `pages`."""
    first = start // page_size
    used = torch.tensor(pages[first:-(-end // page_size)], dtype=torch.long) * page_size
    offset = first * page_size
    return (used[:, None] + torch.arange(page_size)).view(-1)[start - offset:end - offset]


def log_pool(name: str, pool: KVPool) -> None:
    g = pool.geometry
    log.info("%s KV pool: %d B/token, %d pages x %d tokens = %d tokens, %.1f MiB", name, g.bytes_per_token,
             pool.num_pages, pool.page_size, pool.num_pages * pool.page_size,
             pool.num_pages * pool.page_size * g.bytes_per_token / 2**20)
