"""Prometheus metrics of one server. Each replica's engine thread (or, for a replica process, the thread that
receives its results) reports an EngineSnapshot after each step; gauges show the sum over the replicas and
counters what their summed totals gained. Latencies are observed where requests are routed. prometheus_client
metrics are thread-safe, and a registry per server keeps test processes and several apps apart."""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specserve.engine import Engine
from specserve.radix_cache import PrefixCacheStats
from specserve.types import SpecStats

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class EngineSnapshot:
    """One engine's scheduler and page gauges and its running totals, copied so that other threads (or, pickled,
    the server process) may read them while the engine goes on."""
    running: int
    waiting: int
    pages_used: int
    pages_free: int
    pages_cached: int      # held only by the prefix cache (evictable)
    pools: tuple[str, ...]
    prefix: PrefixCacheStats | None
    spec: SpecStats

    @classmethod
    def of(cls, engine: Engine) -> EngineSnapshot:
        free, cache_only = engine.allocator.num_free, engine.allocator.num_cache_only
        # both pools hold the same page ids, so their counts agree
        pools = ("target", "draft") if engine.draft_pool is not None else ("target",)
        prefix = None if engine.prefix_cache is None else dataclasses.replace(engine.prefix_cache.stats)
        return cls(len(engine.scheduler.running), len(engine.scheduler.waiting),
                   engine.allocator.num_pages - free - cache_only, free, cache_only, pools, prefix, engine.stats.copy())


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("specserve_num_requests_running", "Requests being decoded", registry=r)
        self.waiting = Gauge("specserve_num_requests_waiting", "Requests queued in the engine", registry=r)
        self.prompt_tokens = Counter("specserve_prompt_tokens", "Prompt tokens sent to the engines", registry=r)
        self.generation_tokens = Counter("specserve_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("specserve_requests_finished", "Finished requests", ["finish_reason"], registry=r)
        self.ttft = Histogram("specserve_time_to_first_token_seconds", "Submission to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("specserve_time_per_output_token_seconds", "Mean time per token after the first",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.pages_used = Gauge("specserve_kv_pages_used", "KV pages held by requests", ["pool"], registry=r)
        self.pages_free = Gauge("specserve_kv_pages_free", "KV pages free", ["pool"], registry=r)
        self.pages_cached = Gauge("specserve_kv_pages_cached",
                                  "KV pages held only by the prefix cache (evictable)", ["pool"], registry=r)
        self.prefix_hit_rate = Gauge("specserve_prefix_cache_hit_rate",
                                     "Admitted prompt tokens served from the prefix cache, since start", registry=r)
        self.prefix_hit_tokens = Counter("specserve_prefix_cache_hit_tokens", "Prompt tokens served from the cache",
                                         registry=r)
        self.prefix_evicted = Counter("specserve_prefix_cache_evicted_pages", "Pages evicted from the prefix cache",
                                      registry=r)
        self.accept_length = Gauge("specserve_spec_accept_length",
                                   "Tokens emitted per verify step since start (bonus included)", registry=r)
        self.acceptance_rate = Gauge("specserve_spec_acceptance_rate",
                                     "Accepted / proposed drafts since start", registry=r)
        self.verify_calls = Counter("specserve_spec_verify_calls", "Verify steps (one per request per step)",
                                    registry=r)
        self.proposed = Counter("specserve_spec_proposed_drafts", "Draft tokens proposed", registry=r)
        self.accepted = Counter("specserve_spec_accepted_drafts", "Draft tokens accepted", registry=r)
        self.accepted_position = Counter("specserve_spec_accepted_position",
                                         "Drafts accepted at each window position (1 = first draft)", ["position"],
                                         registry=r)
        self.routed = Counter("specserve_requests_routed", "Engine requests sent to each data-parallel replica",
                              ["replica"], registry=r)
        self._latest: dict[int, EngineSnapshot] = {}   # replica → its last snapshot
        self._lock = threading.Lock()                  # replicas report from threads of their own
        self._seen = SpecStats()    # engine totals already counted
        self._seen_prefix = (0, 0)  # prefix cache hit tokens and evicted pages already counted

    def observe(self, replica: int, snap: EngineSnapshot) -> None:
        """`replica`'s latest snapshot: gauges are set to the sum over replicas, counters grow by what the summed
        totals gained since the last call."""
        with self._lock:
            self._latest[replica] = snap
            snaps = list(self._latest.values())
            self.running.set(sum(s.running for s in snaps))
            self.waiting.set(sum(s.waiting for s in snaps))
            for pool in snaps[0].pools:
                self.pages_used.labels(pool).set(sum(s.pages_used for s in snaps))
                self.pages_free.labels(pool).set(sum(s.pages_free for s in snaps))
                self.pages_cached.labels(pool).set(sum(s.pages_cached for s in snaps))
            if prefixes := [s.prefix for s in snaps if s.prefix is not None]:
                stats = PrefixCacheStats(queried_tokens=sum(p.queried_tokens for p in prefixes),
                                         hit_tokens=sum(p.hit_tokens for p in prefixes),
                                         evicted_pages=sum(p.evicted_pages for p in prefixes))
                self.prefix_hit_rate.set(stats.hit_rate)
                self.prefix_hit_tokens.inc(stats.hit_tokens - self._seen_prefix[0])
                self.prefix_evicted.inc(stats.evicted_pages - self._seen_prefix[1])
                self._seen_prefix = (stats.hit_tokens, stats.evicted_pages)
            total, seen = SpecStats(), self._seen
            for s in snaps:
                total.merge(s.spec)
            if total.verify_ct == seen.verify_ct:
                return
            self.generation_tokens.inc(total.num_emitted_tokens - seen.num_emitted_tokens)
            self.verify_calls.inc(total.verify_ct - seen.verify_ct)
            self.proposed.inc(total.num_proposed_drafts - seen.num_proposed_drafts)
            self.accepted.inc(total.num_accepted_drafts - seen.num_accepted_drafts)
            old = seen.accepted_histogram + [0] * (len(total.accepted_histogram) - len(seen.accepted_histogram))
            for position in range(1, len(total.accepted_histogram)):
                # a step that accepted k drafts accepted positions 1..k
                delta = sum(total.accepted_histogram[position:]) - sum(old[position:])
                if delta:
                    self.accepted_position.labels(str(position)).inc(delta)
            self.accept_length.set(total.accept_length)
            if total.num_proposed_drafts:
                self.acceptance_rate.set(total.num_accepted_drafts / total.num_proposed_drafts)
            self._seen = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
