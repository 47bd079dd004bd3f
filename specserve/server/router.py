"""Which data-parallel replica takes a request: the one whose prefix cache likely holds the longest part of its
prompt, unless that replica is busier than the least loaded one by more than `max_imbalance` requests; then the
least loaded one (ties to the lowest index).

The front cannot see the replicas' radix trees (they live in other processes), so it remembers, per page of
prompt tokens, the replica it last sent that prefix to: a hash chain over whole pages, as the prefix cache keys
them, bounded to the most recently used `capacity` pages."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixRouter:
    def __init__(self, num_replicas: int, page_size: int, max_imbalance: int = 4, capacity: int = 100_000) -> None:
        self.num_replicas = num_replicas
        self.page_size = page_size
        self.max_imbalance = max_imbalance
        self.capacity = capacity
        self._owner: OrderedDict[int, int] = OrderedDict()      # prefix hash → replica, least recently used first

    def _page_hashes(self, prompt: Sequence[int]) -> list[int]:
        hashes, h = [], 0
        for end in range(self.page_size, len(prompt) + 1, self.page_size):
            h = hash((h, tuple(prompt[end - self.page_size:end])))
            hashes.append(h)
        return hashes

    def route(self, prompt: Sequence[int], load: Sequence[int]) -> int:
        """The replica for `prompt`, given each replica's unfinished requests; remembers the choice."""
        if self.num_replicas == 1:
            return 0
        hashes = self._page_hashes(prompt)
        least = min(range(self.num_replicas), key=load.__getitem__)
        choice = least
        for h in reversed(hashes):                 # the longest remembered prefix
            owner = self._owner.get(h)
            if owner is not None:
                if load[owner] - load[least] <= self.max_imbalance:
                    choice = owner
                break
        for h in hashes:
            self._owner[h] = choice
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
        return choice
