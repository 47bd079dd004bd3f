"""Radix prefix cache: a tree over token ids whose nodes own whole target pages (and, through the
shared page ids, the draft pool's pages for the same positions). Requests share matched pages by
refcount; the tree holds one reference of its own on each page it caches. Nodes on a request's
matched path are locked while it runs; unlocked leaves are evicted least recently used first when
the allocator runs low. Only positions whose target KV and draft context are both written are
inserted, so a hit never hands anyone unwritten KV."""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.kv_pages import PageAllocator


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...]                 # edge label: a whole number of pages of tokens
    pages: list[int]
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)   # first page's tokens → child
    lock_ref: int = 0
    last_access: int = 0


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0                 # prompt tokens looked up at admission
    hit_tokens: int = 0                     # of those, served from the cache
    evicted_pages: int = 0

    def record(self, num_tokens: int, num_hit: int) -> None:
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hit

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.root = Node((), [], None)
        self.num_pages = 0                  # pages the tree holds a reference on
        self.stats = PrefixCacheStats()
        self._clock = itertools.count(1)
        self._locked: dict[str, Node] = {}  # request id → deepest node of its matched path

    # ---- lookup ----------------------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], Node]:
        """Pages of the longest cached page-aligned prefix of `tokens`, and the node it ends at."""
        node, pages, i = self.root, [], 0
        now = next(self._clock)
        while len(tokens) - i >= self.page_size:
            child = node.children.get(tuple(tokens[i:i + self.page_size]))
            if child is None:
                break
            shared = self._shared_pages(child.tokens, tokens[i:])
            if shared < len(child.pages):
                child = self._split(child, shared)
            child.last_access = now
            pages += child.pages
            i += len(child.tokens)
            node = child
        return pages, node

    def acquire(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> list[int]:
        """Share and lock the cached prefix of `tokens` (at most `max_tokens` of them) for a request;
        the request owns one reference on each returned page."""
        limit = max_tokens // self.page_size * self.page_size
        pages, node = self.match_prefix(tokens[:limit])
        if not pages:
            return []
        self.allocator.share(pages)
        self._lock(node, +1)
        self._locked[request_id] = node
        return pages

    def release(self, request_id: str) -> None:
        node = self._locked.pop(request_id, None)
        if node is not None:
            self._lock(node, -1)

    # ---- insertion and eviction --------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Cache `pages`, holding the K/V of `tokens` (len(tokens) == len(pages) * page_size). Pages
        of a prefix cached already stay as they are; the caller frees its own copies as usual."""
        assert len(tokens) == len(pages) * self.page_size, "insert whole pages only"
        node, i, p = self.root, 0, 0
        now = next(self._clock)
        while p < len(pages):
            key = tuple(tokens[i:i + self.page_size])
            child = node.children.get(key)
            if child is None:
                new = Node(tuple(tokens[i:]), list(pages[p:]), node, last_access=now)
                self.allocator.share(new.pages)
                self.allocator.set_cached(new.pages, True)
                self.num_pages += len(new.pages)
                node.children[key] = new
                return
            shared = self._shared_pages(child.tokens, tokens[i:])
            if shared < len(child.pages):
                child = self._split(child, shared)
            child.last_access = now
            node, i, p = child, i + len(child.tokens), p + len(child.pages)

    def evict(self, num_free: int) -> bool:
        """Drop least recently used unlocked leaves until the allocator has `num_free` free pages;
        False when everything evictable is gone first."""
        if self.allocator.num_free >= num_free:
            return True
        leaves = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and not n.lock_ref]
        heapq.heapify(leaves)
        while leaves and self.allocator.num_free < num_free:
            *_, node = heapq.heappop(leaves)
            self.allocator.set_cached(node.pages, False)
            self.allocator.free(node.pages)
            self.num_pages -= len(node.pages)
            self.stats.evicted_pages += len(node.pages)
            parent = node.parent
            del parent.children[node.tokens[:self.page_size]]
            if parent is not self.root and not parent.children and not parent.lock_ref:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return self.allocator.num_free >= num_free

    def clear(self) -> None:
        """Evict every unlocked node."""
        self.evict(self.allocator.num_pages)

    def locked_request_ids(self) -> set[str]:
        return set(self._locked)

    def cached_pages(self) -> list[int]:
        return [p for n in self._nodes() for p in n.pages]

    # ---- internals -------------------------------------------------------------------------------
    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def _shared_pages(self, label: tuple[int, ...], tokens: Sequence[int]) -> int:
        """Whole pages on which `label` and `tokens` agree."""
        n = 0
        for start in range(0, min(len(label), len(tokens)) - self.page_size + 1, self.page_size):
            if tuple(tokens[start:start + self.page_size]) != label[start:start + self.page_size]:
                break
            n += 1
        return n

    def _split(self, node: Node, num_pages: int) -> Node:
        """Cut `node` after `num_pages` pages; the new upper node takes its place and is returned.
        Every lock through `node` passes through the upper part too, so it inherits the count."""
        cut = num_pages * self.page_size
        upper = Node(node.tokens[:cut], node.pages[:num_pages], node.parent, lock_ref=node.lock_ref,
                     last_access=node.last_access)
        node.parent.children[node.tokens[:self.page_size]] = upper
        node.tokens, node.pages, node.parent = node.tokens[cut:], node.pages[num_pages:], upper
        upper.children[node.tokens[:self.page_size]] = node
        return upper

    def _lock(self, node: Node, delta: int) -> None:
        while node is not self.root:
            node.lock_ref += delta
            assert node.lock_ref >= 0, "unlocked a node more often than it was locked"
            node = node.parent
