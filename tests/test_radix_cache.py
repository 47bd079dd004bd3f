from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.kv_pages import PageAllocator
from specserve.models.block_drafter import random_block_drafter
from specserve.radix_cache import RadixCache
from specserve.speculative.cost_table import CostTable
from specserve.types import SamplingParams
from tests.spec_harness import (
    BLOCK_CASES,
    LOSSLESS_CASES,
    assert_draft_context_exact,
    assert_pages_released,
    capture_draft_context,
    drive,
    make_engine,
    record_proposals,
)

PAGE = 4


def tokens(*runs: int) -> list[int]:
    return [t for r in runs for t in range(r * 100, r * 100 + PAGE)]   # one page of distinct tokens per run id


# ---- the tree ----------------------------------------------------------------------------------------

def test_match_is_page_aligned_and_splits_at_the_divergence():
    alloc = PageAllocator(16)
    cache = RadixCache(alloc, PAGE)
    pages = alloc.allocate(3)
    cache.insert(tokens(1, 2, 3), pages)
    assert alloc.refcounts[pages[0]] == 2                      # the request's and the tree's
    assert cache.match_prefix(tokens(1, 2, 3))[0] == pages
    assert cache.match_prefix(tokens(1, 2) + [300, 301])[0] == pages[:2]        # a partial page never matches
    assert cache.match_prefix(tokens(1, 9, 3))[0] == pages[:1]                  # splits the node after page 1
    assert cache.match_prefix(tokens(7))[0] == []
    other = alloc.allocate(2)
    cache.insert(tokens(1, 5), [pages[0], other[1]])
    assert cache.match_prefix(tokens(1, 5))[0] == [pages[0], other[1]]
    assert sorted(cache.cached_pages()) == sorted(pages + [other[1]])
    alloc.free(pages + other)                                   # the requests finish
    assert alloc.num_free == 16 - 4 and cache.num_pages == 4


def test_eviction_frees_least_recently_used_unlocked_leaves_only():
    alloc = PageAllocator(6)
    cache = RadixCache(alloc, PAGE)
    for run in (1, 2, 3):
        pages = alloc.allocate(2)
        cache.insert(tokens(run, run + 10), pages)
        alloc.free(pages)
    assert alloc.num_free == 0
    locked = cache.acquire("r", tokens(1, 11, 4), max_tokens=12)       # most recently used and locked
    cache.match_prefix(tokens(3, 13))
    assert cache.evict(2) and cache.match_prefix(tokens(2, 12))[0] == []    # run 2 went first
    assert not cache.evict(6), "a locked prefix was evicted"
    assert cache.match_prefix(tokens(1, 11))[0] == locked and cache.stats.evicted_pages == 4
    alloc.free(locked)
    cache.release("r")
    cache.clear()
    assert alloc.num_free == 6 and cache.num_pages == 0


def test_acquire_leaves_room_for_a_token_to_feed():
    alloc = PageAllocator(8)
    cache = RadixCache(alloc, PAGE)
    pages = alloc.allocate(2)
    cache.insert(tokens(1, 2), pages)
    assert cache.acquire("a", tokens(1, 2), max_tokens=2 * PAGE - 1) == pages[:1]
    assert alloc.refcounts[pages[0]] == 3 and cache.locked_request_ids() == {"a"}


OPS = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.lists(st.integers(0, 2), min_size=1, max_size=5)),
    st.tuples(st.just("acquire"), st.lists(st.integers(0, 2), min_size=1, max_size=5)),
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("evict"), st.integers(1, 24)),
), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(OPS)
def test_random_insert_match_lock_evict_keeps_refcounts_consistent(ops):
    """Pages hold a known content (the tokens written to them); whatever the interleaving, a match
    returns pages whose content is the query, and refcounts are the requests' plus the tree's."""
    alloc = PageAllocator(24)
    cache = RadixCache(alloc, PAGE)
    content: dict[int, tuple[int, ...]] = {}
    held: dict[str, list[int]] = {}
    for n, (op, arg) in enumerate(ops):
        if op == "insert" and alloc.num_free >= len(arg):
            seq = [t for page in arg for t in (page,) * (PAGE - 1) + (page + 7,)]
            pages = alloc.allocate(len(arg))
            content.update({p: tuple(seq[i * PAGE:(i + 1) * PAGE]) for i, p in enumerate(pages)})
            cache.insert(seq, pages)
            alloc.free(pages)
        elif op == "acquire":
            seq = [t for page in arg for t in (page,) * (PAGE - 1) + (page + 7,)]
            pages = cache.acquire(str(n), seq, len(seq))
            assert [content[p] for p in pages] == [tuple(seq[i * PAGE:(i + 1) * PAGE]) for i in range(len(pages))]
            if pages:
                held[str(n)] = pages
        elif op == "release" and held:
            rid = sorted(held)[arg % len(held)]
            alloc.free(held.pop(rid))
            cache.release(rid)
        elif op == "evict":
            cache.evict(arg)
        cached = Counter(cache.cached_pages())
        assert max(cached.values(), default=1) == 1 and cache.num_pages == len(cached)
        want = cached + Counter(p for pages in held.values() for p in pages)
        assert alloc.refcounts == [want[p] for p in range(24)]
        assert alloc.num_cache_only == sum(alloc.refcounts[p] == 1 for p in cached)
        assert cache.locked_request_ids() == set(held)
    for rid, pages in held.items():
        alloc.free(pages)
        cache.release(rid)
    cache.clear()
    assert alloc.num_free == 24


# ---- the engine with the cache -------------------------------------------------------------------------

SYSTEM = [random.Random(1).randrange(256) for _ in range(13)]
SHARED = [SYSTEM + [random.Random(i).randrange(256) for _ in range(2 + i)] for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, logprobs=True)
TURN2 = [9, 8, 7, 6, 5]


def conversations(engine, poison: bool = True):
    """Six requests sharing a system prompt (two at a time, so later ones find it cached), then a
    second turn of each that extends its first turn with the model's own answer."""
    first = drive(engine, SHARED, GREEDY, poison).outputs
    second = drive(engine, [p + o.token_ids + TURN2 for p, o in zip(SHARED, first)], GREEDY, poison).outputs
    return first + second


@pytest.fixture(scope="module")
def drafters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("drafters")
    random_block_drafter(tiny_llama.config, "DFLASH", num_layers=2, seed=1, dtype=torch.float64).save(root / "dflash")
    random_block_drafter(tiny_llama.config, seed=2, dtype=torch.float64).save(root / "dspark")
    CostTable((1, 64), (1.0, 7.3)).save(root / "cost.json")
    return {name: str(root / name) for name in ("dflash", "dspark", "cost.json")}


ALGORITHMS = {
    "none": lambda target, drafters: {},
    **{name: (lambda name: lambda target, drafters: LOSSLESS_CASES[name][0](target))(name)
       for name in ("ngram", "standalone-agree", "eagle")},
    **{name: (lambda name: lambda target, drafters: BLOCK_CASES[name](drafters))(name)
       for name in ("dflash", "dspark-hybrid")},
}


def engine_for(tiny_llama, drafters, algorithm: str, **kw):
    args = {**ALGORITHMS[algorithm](tiny_llama, drafters), "max_running_requests": 2, "speculative_block_size": 4,
            **kw}
    return make_engine(tiny_llama, args.pop("draft", None), **args)


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_cache_on_gives_what_cache_off_gives(tiny_llama, drafters, algorithm):
    off = conversations(engine_for(tiny_llama, drafters, algorithm, disable_radix_cache=True))
    engine = engine_for(tiny_llama, drafters, algorithm)
    on = conversations(engine)
    for a, b in zip(on, off, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-9
    stats = engine.prefix_cache.stats
    # every later shared-prompt request reuses the system prompt's full pages; turn 2 reuses turn 1
    assert stats.hit_tokens >= 4 * (len(SYSTEM) // PAGE * PAGE) + 6 * (len(SHARED[0]) // PAGE * PAGE)
    assert_pages_released(engine)


@pytest.mark.parametrize("algorithm", ["standalone-agree", "eagle", "dflash"])
def test_a_hit_gives_the_drafter_the_context_it_would_have_computed(tiny_llama, drafters, algorithm):
    """Greedy drafts depend only on the tokens so far when the draft context is right: with the cache on,
    every step that drafts in both runs from the same tokens drafts the same."""
    proposals = []
    for disable in (True, False):
        engine = engine_for(tiny_llama, drafters, algorithm, disable_radix_cache=disable)
        seen = record_proposals(engine)
        conversations(engine)
        proposals.append({tuple(seq): d for _, seqs, p in seen for seq, d in zip(seqs, p.draft_tokens) if d})
    off, on = proposals
    common = off.keys() & on.keys()
    assert len(common) > 20
    assert all(on[key] == off[key] for key in common)


@pytest.mark.parametrize("algorithm", ["dflash", "dspark-hybrid"])
def test_block_drafter_context_on_hits_equals_a_recomputation(tiny_llama, drafters, algorithm):
    engine = engine_for(tiny_llama, drafters, algorithm)
    context = capture_draft_context(engine)
    conversations(engine)
    assert engine.prefix_cache.stats.hit_tokens > 0
    assert_draft_context_exact(engine, context)


@pytest.mark.parametrize("algorithm", ["none", "standalone-agree", "eagle", "dspark-hybrid"])
def test_eviction_under_memory_pressure_stays_correct(tiny_llama, drafters, algorithm):
    prompts = [SYSTEM[:5 + i] + [i] * (3 + i % 4) for i in range(10)]
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    off = drive(engine_for(tiny_llama, drafters, algorithm, disable_radix_cache=True, num_pages=16), prompts,
                params).outputs
    engine = engine_for(tiny_llama, drafters, algorithm, num_pages=16, max_running_requests=3)
    on = drive(engine, prompts, params, poison=True).outputs
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert engine.prefix_cache.stats.evicted_pages > 0 and engine.prefix_cache.stats.hit_tokens > 0
    assert_pages_released(engine)


def test_disable_radix_cache_turns_it_off(tiny_llama):
    engine = make_engine(tiny_llama, disable_radix_cache=True)
    drive(engine, SHARED[:2], GREEDY)
    assert engine.prefix_cache is None
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_cached_tokens_are_reported_on_the_request(tiny_llama):
    engine = make_engine(tiny_llama, max_running_requests=1)
    drive(engine, SHARED[:1], GREEDY)
    rid = engine.add_request(SHARED[0] + [1, 2, 3], GREEDY)
    engine.step()
    req = next(r for r in engine.scheduler.running if r.request_id == rid)
    assert req.num_cached_tokens == len(SHARED[0]) // PAGE * PAGE
    assert torch.equal(torch.tensor(req.pages[:req.num_cached_tokens // PAGE]),
                       torch.tensor(engine.prefix_cache.match_prefix(SHARED[0])[0]))
