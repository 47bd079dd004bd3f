"""Prometheus metrics of one server. Engine-side values are read by the engine thread after each step
(the engine is not thread-safe); latencies are observed where requests are routed. prometheus_client
metrics are thread-safe, and a registry per server keeps test processes and several apps apart."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specserve.engine import Engine
from specserve.types import SpecStats

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("specserve_num_requests_running", "Requests being decoded", registry=r)
        self.waiting = Gauge("specserve_num_requests_waiting", "Requests queued in the engine", registry=r)
        self.prompt_tokens = Counter("specserve_prompt_tokens", "Prompt tokens admitted", registry=r)
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
        self._seen = SpecStats()    # engine totals already counted
        self._seen_prefix = (0, 0)  # prefix cache hit tokens and evicted pages already counted

    def observe_engine(self, engine: Engine) -> None:
        """Engine thread only: scheduler and page gauges, and counter increments since the last call."""
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(len(engine.scheduler.waiting))
        pools = ["target"] + (["draft"] if engine.draft_pool is not None else [])
        free = engine.allocator.num_free
        cache_only = engine.allocator.num_cache_only   # kept by the prefix cache alone
        for pool in pools:   # both pools hold the same page ids, so their counts agree
            self.pages_used.labels(pool).set(engine.allocator.num_pages - free - cache_only)
            self.pages_free.labels(pool).set(free)
            self.pages_cached.labels(pool).set(cache_only)
        if engine.prefix_cache is not None:
            stats = engine.prefix_cache.stats
            self.prefix_hit_rate.set(stats.hit_rate)
            self.prefix_hit_tokens.inc(stats.hit_tokens - self._seen_prefix[0])
            self.prefix_evicted.inc(stats.evicted_pages - self._seen_prefix[1])
            self._seen_prefix = (stats.hit_tokens, stats.evicted_pages)

        total, seen = engine.stats, self._seen
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
        self._seen = SpecStats()
        self._seen.merge(total)

    def render(self) -> bytes:
        return generate_latest(self.registry)
