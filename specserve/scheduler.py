"""Continuous batching: running requests first (decoding ones, then the next prefill chunks), then
admission from the queue under a token budget. While others wait or decode, one request's prefill chunk
is capped (--max-prefill-chunk), so a long prompt cannot hold the whole budget for many steps in a row
and short requests start beside it. An admitted request starts after its longest cached prefix
(radix_cache.py). When pages run out, unused cached prefixes are evicted first; then the newest
running request is preempted: its pages are freed and it is recomputed later (its emitted tokens are
kept)."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from specserve.config import SchedulerConfig
from specserve.kv_pages import OutOfPages, PageAllocator
from specserve.radix_cache import RadixCache
from specserve.types import Request, RequestStatus, ScheduledRequest, StepPlan


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, page_size: int, max_model_len: int,
                 draft_slots: Callable[[Request], int] = lambda req: 0,
                 prefix_cache: RadixCache | None = None) -> None:
        self.config = config
        self.allocator = allocator
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.draft_slots = draft_slots       # how many draft tokens the proposer may append for a request
        self.prefix_cache = prefix_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        contended = len(self.waiting) + len(self.running) > 1
        chunk = (self.config.max_prefill_chunk or max(budget // 8, 1)) if contended else budget
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        decoding_first = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for req in decoding_first:
            if req not in self.running or budget <= 0:
                continue
            sched = self._fit(req, budget, chunk, preempted, {s.request.request_id for s in scheduled})
            if sched is not None:
                scheduled.append(sched)
                budget -= sched.num_feed + sched.max_drafts
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_running_requests):
            req = self.waiting[0]
            self._reuse_prefix(req)
            sched = self._plan(req, budget, chunk)
            if not self._grow(req, sched.start + sched.num_feed + sched.max_drafts):
                self._drop_pages(req)
                req.num_computed_tokens = req.num_cached_tokens = 0
                break
            if self.prefix_cache is not None:
                self.prefix_cache.stats.record(req.num_tokens, req.num_cached_tokens)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(sched)
            budget -= sched.num_feed + sched.max_drafts
        return StepPlan(tuple(scheduled), tuple(preempted))

    def _plan(self, req: Request, budget: int, chunk: int) -> ScheduledRequest:
        """Feed up to `chunk` of the request's unfed tokens within `budget`; drafts take what the budget leaves."""
        start = req.num_computed_tokens
        num_feed = min(req.num_tokens - start, budget, chunk)
        samples = start + num_feed == req.num_tokens
        drafts = 0
        if samples:
            remaining = req.params.max_new_tokens - len(req.output_token_ids) - 1
            drafts = max(0, min(self.draft_slots(req), budget - num_feed, remaining,
                                self.max_model_len - req.num_tokens - 1))
        return ScheduledRequest(req, start, num_feed, samples, drafts)

    def _fit(self, req: Request, budget: int, chunk: int, preempted: list[Request],
             planned: set[str]) -> ScheduledRequest | None:
        """Plan the request, preempting the newest running request not planned in this step (possibly this
        one) while its pages do not fit; max_model_len never exceeds the pool, so a request alone fits."""
        sched = self._plan(req, budget, chunk)
        while not self._grow(req, sched.start + sched.num_feed + sched.max_drafts):
            victim = next(r for r in reversed(self.running) if r is req or r.request_id not in planned)
            self.preempt(victim)
            preempted.append(victim)
            if victim is req:
                return None
        return sched

    def _reuse_prefix(self, req: Request) -> None:
        """Start the request after its cached prefix, keeping at least one token to feed (its logits). A
        request that wants its prompt's logprobs computes the whole prompt."""
        if self.prefix_cache is None or req.params.prompt_logprobs:
            return
        tokens = req.all_token_ids
        req.pages = self.prefix_cache.acquire(req.request_id, tokens, len(tokens) - 1)
        req.num_computed_tokens = req.num_cached_tokens = len(req.pages) * self.page_size

    def _grow(self, req: Request, num_tokens: int) -> bool:
        extra = pages_needed(num_tokens, self.page_size) - len(req.pages)
        if extra <= 0:
            return True
        if self.prefix_cache is not None and not self.prefix_cache.evict(extra):
            return False
        try:
            req.pages.extend(self.allocator.allocate(extra))
        except OutOfPages:
            return False
        return True

    def _drop_pages(self, req: Request) -> None:
        self.allocator.free(req.pages)
        req.pages = []
        if self.prefix_cache is not None:
            self.prefix_cache.release(req.request_id)

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._drop_pages(req)
        req.num_computed_tokens = req.num_cached_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._drop_pages(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
