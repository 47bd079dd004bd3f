"""Speculation must not change what the engine emits: the matrix of algorithms × K × batch against
plain decoding (tokens, logprobs, target KV), with free pages poisoned, plus preemption, sampled
runs and a randomized page-leak test. A new proposer joins every test by adding itself to LOSSLESS_CASES."""
from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings

from specserve.types import SamplingParams
from tests.spec_harness import (
    BATCHES,
    GREEDY,
    KS,
    LOSSLESS_CASES,
    MATRIX_ENGINE,
    PROMPTS,
    SAMPLED,
    SEEDED_CONFIGS,
    Run,
    assert_pages_released,
    assert_same_as_plain,
    assert_sampled_batch_valid,
    assert_seeded_like_plain,
    assert_stats_consistent,
    make_engine,
    make_prompts,
    mean_accept_length,
    replay_traffic,
    run,
    traffic,
)

# The target's numerics the matrix runs in: float64 weights and attention, int8 weights, int8 weights over an int8 KV
# cache (the row-invariant kernel's int8 path; the float64 layers write it through ops.quantize_kv).
NUMERICS = {"none": {"quantization": "none"}, "int8": {"quantization": "int8"},
            "int8-kv-int8": {"quantization": "int8", "kv_cache_dtype": "int8"}}


@pytest.fixture(scope="module")
def plain(tiny_llama):
    """Plain decoding of all 16 prompts per numerics; each request's result does not depend on its batch."""
    return functools.cache(lambda numerics: run(tiny_llama, PROMPTS, GREEDY, **NUMERICS[numerics], **MATRIX_ENGINE))


@pytest.fixture(scope="module")
def spec_kwargs(tiny_llama):
    return functools.cache(lambda case: LOSSLESS_CASES[case][0](tiny_llama))


@pytest.fixture(scope="module")
def spec_run(tiny_llama, spec_kwargs):
    @functools.cache
    def go(case: str, k: int, batch: int, poison: bool = True, numerics: str = "none"):
        return run(tiny_llama, PROMPTS[:batch], GREEDY[:batch], poison=poison, speculative_num_draft_tokens=k,
                   **NUMERICS[numerics], **MATRIX_ENGINE, **spec_kwargs(case))
    return go


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("case", LOSSLESS_CASES)
def test_greedy_speculation_is_lossless(plain, spec_run, case, k, batch, numerics):
    spec = spec_run(case, k, batch, numerics=numerics)
    want = plain(numerics)
    assert_same_as_plain(spec, Run(want.outputs[:batch], want.kv, want.engine))
    assert_stats_consistent(spec, k)
    assert_pages_released(spec.engine)


@pytest.mark.parametrize("case", LOSSLESS_CASES)
def test_acceptance_is_what_the_drafter_promises(spec_run, case):
    accept = mean_accept_length(spec_run(case, 8, 4))
    minimum = LOSSLESS_CASES[case][1]
    if minimum is None:
        assert accept == 1.0, "a drafter whose argmax is never the target's got a draft accepted"
    else:
        assert accept > minimum


@pytest.mark.parametrize("case", LOSSLESS_CASES)
def test_poisoned_free_pages_change_nothing(spec_run, case):
    clean, poisoned = spec_run(case, 4, 16, poison=False), spec_run(case, 4, 16)
    assert [o.token_ids for o in poisoned.outputs] == [o.token_ids for o in clean.outputs]
    assert [o.spec for o in poisoned.outputs] == [o.spec for o in clean.outputs]
    assert poisoned.engine.stats == clean.engine.stats


@pytest.mark.parametrize("case", LOSSLESS_CASES)
def test_preemption_under_speculation_recomputes_both_pools(tiny_llama, spec_kwargs, case):
    prompts = make_prompts(8, seed=3)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    spec = run(tiny_llama, prompts, params, poison=True, num_pages=24, speculative_num_draft_tokens=4,
               **spec_kwargs(case))
    assert sum(o.num_preemptions for o in spec.outputs) > 0, "the pool was meant to be too small"
    plain = run(tiny_llama, prompts, params)
    assert [o.token_ids for o in spec.outputs] == [o.token_ids for o in plain.outputs]


@pytest.mark.parametrize("case", LOSSLESS_CASES)
def test_sampled_speculation_is_reproducible_and_valid(tiny_llama, spec_kwargs, case):
    prompts = make_prompts(4, seed=7)
    kw = {"speculative_num_draft_tokens": 4, **spec_kwargs(case)}
    batched = run(tiny_llama, prompts, SAMPLED, **kw)
    assert_sampled_batch_valid(tiny_llama, prompts, batched, 4, **kw)
    unseeded = run(tiny_llama, prompts, SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True), **kw)
    assert all(len(o.token_ids) == 12 for o in unseeded.outputs)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("config", SEEDED_CONFIGS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
@pytest.mark.parametrize("case", LOSSLESS_CASES)
def test_a_seeded_request_samples_what_plain_decoding_samples(tiny_llama, spec_kwargs, case, config, batch):
    assert_seeded_like_plain(tiny_llama, config, batch, speculative_num_draft_tokens=4, **spec_kwargs(case))


OPS = traffic(min_prompt=4, new_tokens=(4, 16))


@pytest.mark.parametrize("case", LOSSLESS_CASES)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_no_page_or_state_leaks_under_random_traffic(tiny_llama, spec_kwargs, case, ops):
    engine = make_engine(tiny_llama, num_pages=7, speculative_num_draft_tokens=4, **spec_kwargs(case))
    replay_traffic(engine, ops)
