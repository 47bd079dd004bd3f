"""DFLASH and DSPARK through the engine: lossless against plain decoding over gamma × batch × window
policy with NaN-poisoned free pages (tokens, logprobs, target KV), the draft context against a
from-scratch recomputation (also after preemption), identical proposals with and without poison,
sampled runs, and page/state leaks under random traffic."""
from __future__ import annotations

import functools
import time
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from specserve.engine import Engine
from specserve.kv_pages import KVGeometry
from specserve.loader import LoadedCheckpoint
from specserve.models.block_drafter import BlockDrafterCheckpoint, random_block_drafter
from specserve.speculative.cost_table import STARTUP_ROWS, CostTable
from specserve.speculative.ngram import one_hot_like, prompt_lookup
from specserve.speculative.windows import BudgetPlanner, Candidate
from specserve.types import SamplingParams
from tests import spec_harness
from tests.spec_harness import (
    BATCHES,
    BLOCK_CASES,
    GREEDY,
    MATRIX_ENGINE,
    PROMPTS,
    SAMPLED,
    SEEDED_CONFIGS,
    Run,
    assert_draft_context_exact,
    assert_pages_released,
    assert_same_as_plain,
    assert_sampled_batch_valid,
    assert_seeded_like_plain,
    assert_stats_consistent,
    capture_draft_context,
    make_engine,
    make_prompts,
    mean_accept_length,
    record_proposals,
    replay_traffic,
    run,
    traffic,
)

GAMMAS = [1, 2, 4, 5, 8, 16]


def agreeing_drafter(target: LoadedCheckpoint, outputs: list[list[int]]) -> BlockDrafterCheckpoint:
    """A DSPARK drafter that memorised the target's greedy outputs on PROMPTS: its Markov head maps each
    token to the one most often seen after it (one rank per transition, dominating the random base
    logits). Its confidence head is sure after half of those tokens and unsure after all others, so
    windows get cut on chains that the drafter would in fact get right."""
    pairs = Counter((a, b) for out in outputs for a, b in zip(out, out[1:]))
    following = {}
    for (a, b), _ in pairs.most_common():
        following.setdefault(a, b)
    vocab = sorted({t for pair in following.items() for t in pair} | set(range(0, 257, 3)))
    draft_id = {t: i for i, t in enumerate(vocab)}
    ckpt = random_block_drafter(target.config, token_map=torch.tensor(vocab), markov_rank=len(following), seed=5,
                                dtype=torch.float64)
    w = ckpt.weights
    w["markov.w1.weight"].zero_()
    w["markov.w2.weight"].zero_()
    for j, (a, b) in enumerate(following.items()):
        w["markov.w1.weight"][draft_id[a], j] = 1.0
        w["markov.w2.weight"][draft_id[b], j] = 1e3
    w["confidence.weight"].zero_()[0, target.config.hidden_size::2] = 8.0
    w["confidence.bias"].fill_(-4.0)
    return ckpt


@pytest.fixture(scope="module")
def plain(tiny_llama) -> Run:
    return run(tiny_llama, PROMPTS, GREEDY, **MATRIX_ENGINE)


@pytest.fixture(scope="module")
def plain_int8(tiny_llama):
    """Plain int8 decoding per KV cache dtype (auto: the float64 compute dtype's; int8: the kernel's int8 path)."""
    return functools.cache(lambda kv_cache_dtype: run(tiny_llama, PROMPTS, GREEDY, quantization="int8",
                                                      kv_cache_dtype=kv_cache_dtype, **MATRIX_ENGINE))


@pytest.fixture(scope="module")
def drafters(tiny_llama, plain, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("drafters")
    ckpts = {
        "dflash": random_block_drafter(tiny_llama.config, "DFLASH", num_layers=2, qk_norm=True, seed=1,
                                       anchor_slot=True, dtype=torch.float64),
        "dflash_next": random_block_drafter(tiny_llama.config, "DFLASH", num_layers=2, seed=3, anchor_feature=True,
                                            dtype=torch.float64),
        "dspark": random_block_drafter(tiny_llama.config, token_map=torch.arange(128) * 2, seed=2, dtype=torch.float64),
        "agree": agreeing_drafter(tiny_llama, [o.token_ids for o in plain.outputs]),
    }
    for name, ckpt in ckpts.items():
        ckpt.save(root / name)
    # Each extra verify row costs a tenth of a one-row forward: a fixed table keeps runs deterministic.
    CostTable((1, 64), (1.0, 7.3)).save(root / "cost.json")
    return {name: str(root / name) for name in [*ckpts, "cost.json"]}


def drive(engine: Engine, prompts, params, poison: bool = True) -> Run:
    return spec_harness.drive(engine, prompts, params, poison)


@pytest.fixture(scope="module")
def spec_run(tiny_llama, drafters):
    @functools.cache
    def go(case: str, gamma: int, batch: int, quantization: str = "none", chunk: int | None = None,
           kv_cache_dtype: str = "auto"):
        engine = make_engine(tiny_llama, speculative_block_size=gamma, quantization=quantization, **MATRIX_ENGINE,
                             max_prefill_chunk=chunk, kv_cache_dtype=kv_cache_dtype, **BLOCK_CASES[case](drafters))
        context, seen = capture_draft_context(engine), record_proposals(engine)
        return drive(engine, PROMPTS[:batch], GREEDY[:batch]), context, seen
    return go


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("case", ["dflash", "dflash-next", "dspark-budget", "dspark-threshold", "dspark-hybrid"])
def test_greedy_block_drafting_is_lossless(plain, spec_run, case, gamma, batch):
    spec, *_ = spec_run(case, gamma, batch)
    assert_same_as_plain(spec, Run(plain.outputs[:batch], plain.kv, plain.engine))
    assert_stats_consistent(spec, gamma)
    assert_pages_released(spec.engine)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("case", ["dflash", "dspark-budget", "dspark-threshold", "dspark-hybrid"])
def test_greedy_block_drafting_is_lossless_with_int8(plain_int8, spec_run, case, gamma, batch, kv_cache_dtype):
    spec, *_ = spec_run(case, gamma, batch, "int8", kv_cache_dtype=kv_cache_dtype)
    want = plain_int8(kv_cache_dtype)
    assert_same_as_plain(spec, Run(want.outputs[:batch], want.kv, want.engine))
    assert_stats_consistent(spec, gamma)
    assert_pages_released(spec.engine)


@pytest.mark.parametrize("case", ["dflash", "dspark-budget", "dspark-threshold"])
def test_draft_context_equals_a_recomputation_from_scratch(spec_run, case):
    spec, context, _ = spec_run(case, 5, 16)
    assert_draft_context_exact(spec.engine, context)


def test_acceptance_follows_the_drafter(spec_run):
    # whole prompts per step (no prefill-chunk cap): the planner's windows depend on the rows beside them
    assert mean_accept_length(spec_run("dflash", 8, 4, chunk=64)[0]) < 1.3, "a random drafter should rarely agree"
    for case in ("dspark-budget", "dspark-threshold"):
        assert mean_accept_length(spec_run(case, 8, 4, chunk=64)[0]) > 2.5
        assert mean_accept_length(spec_run(case, 16, 4, chunk=64)[0]) > mean_accept_length(
            spec_run(case, 2, 4, chunk=64)[0])


@pytest.mark.parametrize("case", ["dspark-budget", "dspark-threshold"])
def test_windows_differ_per_request_and_follow_confidence(spec_run, case):
    """The agreeing drafter is sure (c ≈ 0.98) after half of its memorised tokens and unsure (c ≈ 0.02)
    after the others: both policies verify up to gamma drafts on a sure chain and cut at an unsure draft."""
    *_, seen = spec_run(case, 8, 16)
    full = cut = 0
    for plan, _, proposal in seen:
        for s, drafts, conf in zip(plan.scheduled, proposal.draft_tokens, proposal.confidences):
            if conf is None:
                continue
            assert len(conf) == len(drafts) <= min(8, s.max_drafts)
            assert all(c > 0.9 for c in conf[:-1]), "a window never runs on past an unsure draft"
            full += len(drafts) == min(8, s.max_drafts)
            cut += len(drafts) < min(8, s.max_drafts)
    assert full > 10 and cut > 10


def count_blocks(engine: Engine) -> list[tuple[int, int]]:
    """(proposal number from 0, requests drafted for) of each block forward of `engine`."""
    calls = []
    block_hidden = engine.proposer.drafter.block_hidden

    def counting(input_ids, positions, meta, pool, anchor_context=None):
        calls.append((engine.proposer.policy.num_steps - 1, sum(c.batch for c in meta.chunks)))
        return block_hidden(input_ids, positions, meta, pool, anchor_context)

    engine.proposer.drafter.block_hidden = counting
    return calls


def test_a_block_runs_every_slot_however_few_rows_it_drafts(tiny_llama, plain, drafters):
    """The planner drafts only the rows a window may use, but the block keeps all gamma slots the scheduler
    reserved: a drafter trained on whole blocks reads its later slots in its first rows."""
    engine = make_engine(tiny_llama, **MATRIX_ENGINE, **BLOCK_CASES["dspark-budget"](drafters))
    proposer, seen = engine.proposer, []
    run_block, block_hidden = proposer._run_block, proposer.drafter.block_hidden

    lead = int(proposer.drafter.config.anchor_slot)

    def recording_block(plan, jobs):
        slots = sum(min(proposer.gamma, plan.scheduled[job.index].max_drafts) + lead for job in jobs)
        seen.append([slots, sum(job.num_drafts for job in jobs), None])
        return run_block(plan, jobs)

    def recording_hidden(input_ids, *args):
        seen[-1][2] = len(input_ids)
        return block_hidden(input_ids, *args)

    proposer._run_block, proposer.drafter.block_hidden = recording_block, recording_hidden
    assert_same_as_plain(drive(engine, PROMPTS, GREEDY), plain)
    assert seen and all(ran == slots for slots, _, ran in seen)
    assert any(drafted < slots for slots, drafted, _ in seen)


def test_planner_skips_blocks_that_cannot_pay_off(tiny_llama, drafters, tmp_path):
    """When an extra verify row costs a whole forward no window pays off (bar steps that also run a
    prefill chunk, whose rows make one more row relatively cheap): after each request's first
    block the planner skips the block, the requests drafting again together to re-measure after
    PROBE_EVERY steps, then twice as many each time. Outputs stay plain decoding's."""
    CostTable((1, 64), (1.0, 64.0)).save(tmp_path / "dear.json")
    prompts, params = PROMPTS[:4], SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True, logprobs=True,
                                                   top_logprobs=2)
    want = run(tiny_llama, prompts, params, **MATRIX_ENGINE)
    # whole prompts per step, so that the steps that carry a prefill are the first ones of each request
    engine = make_engine(tiny_llama, **MATRIX_ENGINE, max_prefill_chunk=64, speculative_algorithm="DSPARK",
                         speculative_draft_model_path=drafters["agree"],
                         speculative_dspark_cost_table_path=str(tmp_path / "dear.json"))
    blocks, seen = count_blocks(engine), record_proposals(engine)
    spec = drive(engine, prompts, params)
    assert_same_as_plain(spec, want)
    assert_pages_released(engine)
    assert not engine.proposer.policy.forecast
    # only a prefill chunk in the same forward makes a row cheap enough relative to the step
    assert all(max(s.num_feed for s in plan.scheduled) > 1 for plan, _, proposal in seen if any(proposal.draft_tokens))
    every, steps = BudgetPlanner.PROBE_EVERY, engine.proposer.policy.num_steps
    assert steps > 4 * every
    # one block per request before it has a forecast (in the steps that start its decoding), then only
    # in probing steps, at steps 8, 16, 32, 64, ... (the intervals double while no window pays off)
    first = [(step, n) for step, n in blocks if step % every]
    probes = [step for step, _ in blocks if step % every == 0 and step > 0]
    assert sum(n for _, n in first) <= 4 and all(step < every for step, _ in first)
    assert probes == [every * 2 ** k for k in range(len(probes))] and every * 2 ** len(probes) > steps


def test_draft_context_is_written_when_a_block_runs(tiny_llama, drafters, tmp_path):
    """While the planner skips blocks, committed tokens keep their target features and no context K/V is
    written; when a request's block runs, everything before its anchor is written first."""
    CostTable((1, 64), (1.0, 64.0)).save(tmp_path / "dear.json")
    prompts, params = PROMPTS[:4], SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True, logprobs=True,
                                                   top_logprobs=2)
    engine = make_engine(tiny_llama, **MATRIX_ENGINE, max_prefill_chunk=64, speculative_algorithm="DSPARK",
                         speculative_draft_model_path=drafters["agree"],
                         speculative_dspark_cost_table_path=str(tmp_path / "dear.json"))
    proposer, kept_rows, blocks = engine.proposer, [], []
    run_block, commit = proposer._run_block, proposer.commit

    def checked_block(plan, jobs):
        assert all(job.request.request_id not in proposer.unwritten for job in jobs)
        blocks.append(len(jobs))
        return run_block(plan, jobs)

    def counting_commit(plan, result, out):
        commit(plan, result, out)
        kept_rows.append(sum(len(aux) for _, parts in proposer.unwritten.values() for aux in parts))

    proposer._run_block, proposer.commit = checked_block, counting_commit
    assert_same_as_plain(drive(engine, prompts, params), run(tiny_llama, prompts, params, **MATRIX_ENGINE))
    assert blocks and max(kept_rows) >= 4 * BudgetPlanner.PROBE_EVERY
    assert not proposer.unwritten, "released requests keep nothing"


def test_blocks_that_cost_more_than_they_win_are_skipped(tiny_llama, drafters):
    """The sure drafter and cheap verify rows: free blocks run in most steps; blocks whose rows cost ten
    target rows each run only before a request has a forecast and when probing. Outputs stay plain."""
    prompts, params = PROMPTS[:4], SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True, logprobs=True,
                                                   top_logprobs=2)
    want = run(tiny_llama, prompts, params, **MATRIX_ENGINE)
    blocks = {}
    for block_cost in (0.0, 10.0):
        engine = make_engine(tiny_llama, **MATRIX_ENGINE, **{**BLOCK_CASES["dspark-budget"](drafters),
                                                            "speculative_dspark_block_cost": block_cost})
        blocks[block_cost] = count_blocks(engine)
        assert_same_as_plain(drive(engine, prompts, params), want)
    every = BudgetPlanner.PROBE_EVERY
    assert len(blocks[0.0]) > 20
    assert all(step % every == 0 for step, _ in blocks[10.0] if step >= every) and len(blocks[10.0]) < 10


def test_a_block_is_charged_for_its_steps_context_not_for_catching_up(tiny_llama, drafters):
    """The planner's measured block time includes the context the block writes first while the request drafts
    every step (at most a window's tokens), not the context of steps it skipped: that price was paid for
    skipping, and charging it made blocks look dearer the more of them were skipped."""
    prompts, params = PROMPTS[:4], SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    seen = []
    for block_cost in (0.0, 10.0):          # free blocks draft every step; dear ones only probe
        engine = make_engine(tiny_llama, **MATRIX_ENGINE, **{**BLOCK_CASES["dspark-budget"](drafters),
                                                            "speculative_dspark_block_cost": block_cost,
                                                            "speculative_block_size": 4})
        proposer, log = engine.proposer, []
        write, flush, timed = proposer.drafter.write_context, proposer.flush_context, proposer.policy.timed

        def slow_write(*args, write=write):
            time.sleep(0.05)
            return write(*args)

        def recording_flush(requests, flush=flush, log=log):
            log.append((flush(requests), len(requests)))
            return log[-1][0]

        def recording_timed(rows, seconds, timed=timed, log=log):
            seen.append((*log[-1], seconds))
            timed(rows, seconds)

        proposer.drafter.write_context, proposer.flush_context = slow_write, recording_flush
        proposer.policy.timed = recording_timed
        drive(engine, prompts, params)
    window = proposer.gamma + 1
    steady = [seconds for written, jobs, seconds in seen if 0 < written <= window * jobs]
    catching_up = [seconds for written, jobs, seconds in seen if written > window * jobs]
    assert steady and catching_up
    assert min(steady) >= 0.05 > max(catching_up)


def test_block_cost_defaults_to_the_weights_ratio(tiny_llama, drafters):
    kw = {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": drafters["agree"],
          "speculative_dspark_cost_table_path": drafters["cost.json"]}
    engine = make_engine(tiny_llama, **kw)
    ratio = engine.proposer.drafter.block_row_weights() / engine.model.row_weights()
    assert ratio > 0 and engine.proposer.policy.relative_block_cost == ratio
    assert engine.proposer.policy.measure_overhead, "by default the blocks' measured overhead counts too"
    drive(engine, PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=8))
    assert engine.proposer.policy.block_overhead is not None
    given = make_engine(tiny_llama, **kw, speculative_dspark_block_cost=0.5)
    assert given.proposer.policy.relative_block_cost == 0.5 and not given.proposer.policy.measure_overhead
    with pytest.raises(ValueError, match="--speculative-dspark-block-cost must be >= 0"):
        make_engine(tiny_llama, **kw, speculative_dspark_block_cost=-1.0)


def test_poisoned_free_pages_change_no_proposal(tiny_llama, drafters):
    prompts = make_prompts(8, seed=5)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_new_tokens=14, ignore_eos=True)
              for i in range(8)]
    proposals = []
    for poison in (False, True):
        engine = make_engine(tiny_llama, speculative_block_size=4, max_num_batched_tokens=48,
                             **BLOCK_CASES["dspark-random"](drafters))
        seen = record_proposals(engine)
        drive(engine, prompts, params, poison=poison)
        proposals.append([p for *_, p in seen])
    for clean, poisoned in zip(*proposals, strict=True):
        assert clean.draft_tokens == poisoned.draft_tokens and clean.confidences == poisoned.confidences
        for a, b in zip(clean.draft_probs, poisoned.draft_probs):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
        assert all(all(0.0 < c < 1.0 for c in conf) for conf in poisoned.confidences if conf)


@pytest.mark.parametrize("case", ["dflash", "dspark-threshold"])
def test_preemption_rebuilds_the_draft_context(tiny_llama, drafters, case):
    prompts = make_prompts(8, seed=3)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    engine = make_engine(tiny_llama, num_pages=24, speculative_block_size=4, **BLOCK_CASES[case](drafters))
    context = capture_draft_context(engine)
    spec = drive(engine, prompts, params)
    assert sum(o.num_preemptions for o in spec.outputs) > 0, "the pool was meant to be too small"
    plain = run(tiny_llama, prompts, params)
    assert [o.token_ids for o in spec.outputs] == [o.token_ids for o in plain.outputs]
    assert_draft_context_exact(engine, context)
    assert not engine.proposer.num_valid


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("config", SEEDED_CONFIGS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
@pytest.mark.parametrize("case", ["dflash", "dspark-budget", "dspark-random", "dspark-hybrid"])
def test_a_seeded_request_samples_what_plain_decoding_samples(tiny_llama, drafters, case, config, batch):
    assert_seeded_like_plain(tiny_llama, config, batch, speculative_block_size=4, **BLOCK_CASES[case](drafters))


@pytest.mark.parametrize("case", ["dflash", "dspark-random", "dspark-threshold"])
def test_sampled_block_drafting_is_reproducible_and_valid(tiny_llama, drafters, case):
    prompts = make_prompts(4, seed=7)
    kw = {"speculative_block_size": 4, **BLOCK_CASES[case](drafters)}
    engine = make_engine(tiny_llama, **kw)
    seen = record_proposals(engine)
    batched = drive(engine, prompts, SAMPLED)
    assert_sampled_batch_valid(tiny_llama, prompts, batched, 4, **kw)
    token_map = engine.proposer.drafter.token_map
    outside = torch.ones(tiny_llama.config.vocab_size, dtype=torch.bool)
    outside[token_map] = False
    for *_, proposal in seen:   # q is the distribution each draft was drawn from, zero off the draft vocabulary
        for drafts, q in zip(proposal.draft_tokens, proposal.draft_probs):
            if drafts:
                assert q.shape == (len(drafts), tiny_llama.config.vocab_size) and not q[:, outside].any()
                torch.testing.assert_close(q.sum(-1), torch.ones(len(drafts), dtype=q.dtype))
                assert (q[torch.arange(len(drafts)), list(drafts)] > 0).all()


def test_penalties_and_stops_inside_accepted_windows_stay_lossless(tiny_llama, plain, drafters):
    """Greedy drafts under penalties go through the full-vocabulary path; stop tokens end requests in the
    middle of accepted runs, so commit must skip finished requests."""
    params = [SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True, repetition_penalty=1.3)
              if i % 2 else
              SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True, stop_token_ids=(out.token_ids[-1],))
              for i, out in enumerate(plain.outputs[:8])]
    params.append(SamplingParams(temperature=0.7, seed=3, max_new_tokens=16, ignore_eos=True, presence_penalty=0.5))
    prompts = PROMPTS[:9]
    kw = {"speculative_block_size": 8, **BLOCK_CASES["dspark-threshold"](drafters)}
    spec = run(tiny_llama, prompts, params, poison=True, **kw)
    want = run(tiny_llama, prompts, params)
    assert [o.token_ids for o in spec.outputs[:8]] == [o.token_ids for o in want.outputs[:8]]
    assert any(o.finish_reason == "stop" and o.spec.num_accepted_drafts for o in spec.outputs)
    alone = run(tiny_llama, prompts[8:], params[8:], **kw)
    assert alone.outputs[0].token_ids == spec.outputs[8].token_ids


def test_a_context_gap_stops_drafting_instead_of_reading_unwritten_kv(tiny_llama, drafters):
    """Target KV that appears without a draft context leaves a gap that commit cannot fill: that request
    never drafts, the others do. (The gap is injected by hand, which the prefix cache would undo.)"""
    engine = make_engine(tiny_llama, speculative_block_size=4, disable_radix_cache=True,
                         **BLOCK_CASES["dflash"](drafters))
    seen = record_proposals(engine)
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    gap, other = engine.add_request([5, 6, 7, 8, 9], params), engine.add_request([5, 6, 7, 8, 9], params)
    engine.requests[gap].num_computed_tokens = 2
    while engine.has_unfinished:
        engine.step()
        assert gap not in engine.proposer.num_valid
    drafts = {s.request.request_id: d for plan, _, p in seen for s, d in zip(plan.scheduled, p.draft_tokens) if d}
    assert other in drafts and gap not in drafts


def test_dspark_measures_a_cost_table_at_startup_without_a_saved_one(tiny_llama, drafters):
    engine = make_engine(tiny_llama, speculative_algorithm="DSPARK", speculative_draft_model_path=drafters["dspark"])
    assert isinstance(engine.proposer.policy, BudgetPlanner) and engine.proposer.policy.cost.rows == STARTUP_ROWS
    out = drive(engine, make_prompts(2), SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in out.outputs)


def test_draft_pool_has_the_drafters_geometry(tiny_llama, drafters):
    engine = make_engine(tiny_llama, **BLOCK_CASES["dflash"](drafters))
    assert engine.draft_pool.geometry == KVGeometry(2, 2, 16, torch.float64)
    assert engine.runner.aux_layer_ids == (0, 1)


OPS = traffic(min_prompt=1, new_tokens=(1, 12))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_no_page_or_state_leaks_under_random_traffic(tiny_llama, drafters, ops):
    engine = make_engine(tiny_llama, num_pages=12, speculative_block_size=4,
                         **BLOCK_CASES["dspark-threshold"](drafters))
    replay_traffic(engine, ops, poison=True)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_hybrid_leaks_no_page_or_state_under_random_traffic(tiny_llama, drafters, ops):
    engine = make_engine(tiny_llama, num_pages=12, speculative_block_size=4, **BLOCK_CASES["dspark-hybrid"](drafters))
    replay_traffic(engine, ops, poison=True)
    assert not engine.proposer.hybrid.per_request and not engine.proposer.hybrid.pending


def test_hybrid_verifies_whichever_proposal_promises_more(tiny_llama, drafters):
    """Repetitive prompts give n-gram continuations the random drafter cannot match: the hybrid takes
    them (deterministic drafts, learned row confidences) and still uses the block elsewhere; greedy
    outputs equal plain decoding and a rerun samples the same tokens."""
    prompts = make_prompts(8, seed=11)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_new_tokens=20, ignore_eos=True)
              for i in range(8)]
    kw = {"speculative_block_size": 4, **BLOCK_CASES["dspark-hybrid"](drafters)}
    engine = make_engine(tiny_llama, **kw)
    seen = record_proposals(engine)
    spec = drive(engine, prompts, params)
    plain_run = run(tiny_llama, prompts, params)
    for i in range(1, 8, 2):
        assert spec.outputs[i].token_ids == plain_run.outputs[i].token_ids
    rerun = run(tiny_llama, prompts, params, **kw)
    assert [o.token_ids for o in rerun.outputs] == [o.token_ids for o in spec.outputs]
    ngram = block = 0
    for plan, seqs, proposal in seen:
        for s, tokens, drafts, q in zip(plan.scheduled, seqs, proposal.draft_tokens, proposal.draft_probs):
            if drafts and q is None and list(drafts) == prompt_lookup(tokens, 1, 4, len(drafts)):
                ngram += 1
            elif drafts:
                block += 1
    assert ngram >= 3 and block > 5


def test_hybrid_splices_stay_lossless_in_the_engine(tiny_llama, drafters):
    """Splices (block drafts, then a copy) are verified for greedy and sampled requests alike: greedy outputs equal
    plain decoding, a rerun samples the same tokens, and a spliced window's copied rows carry one-hot q rows. Each
    block's first three drafts are replaced by the prompt's first three tokens, claimed sure (one-hot q rows: a
    deterministic proposal), and its other drafts unsure, so the copy of the prompt after them wins."""
    prompts = make_prompts(8, seed=5)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_new_tokens=24, ignore_eos=True)
              for i in range(8)]
    kw = {"speculative_block_size": 6, "speculative_algorithm": "DSPARK", "speculative_draft_model_path":
          drafters["dspark"], "speculative_dspark_confidence_threshold": 0.0, "speculative_ngram_hybrid": True}

    def leading_into_the_prompt(engine):
        run_block = engine.proposer._run_block

        def led(plan, jobs):
            out = {}
            for i, c in run_block(plan, jobs).items():
                lead = plan.scheduled[i].request.prompt_token_ids[:min(3, len(c.drafts))]
                n = len(lead)
                probs = [one_hot_like(c.probs[0], t) for t in lead] + c.probs[n:] if c.probs else []
                out[i] = Candidate(lead + c.drafts[n:], probs, [0.95] * n + [0.05] * (len(c.drafts) - n))
            return out
        engine.proposer._run_block = led

    engine = make_engine(tiny_llama, **kw)
    leading_into_the_prompt(engine)
    spliced = {True: 0, False: 0}                 # greedy → splices that won its step
    hybrid = engine.proposer.hybrid
    weigh, verifying = hybrid.weigh, hybrid.verifying
    chosen, judged = set(), set()                 # (request id, copied drafts, block drafts before them)

    def recording_weigh(plan, candidates, lookups):
        weigh(plan, candidates, lookups)
        for i, c in candidates.items():
            if c.ngram_match and c.ngram_from:
                spliced[plan.scheduled[i].request.params.greedy] += 1
                chosen.add((plan.scheduled[i].request.request_id, len(c.drafts) - c.ngram_from, c.ngram_from))
                assert all(row[t] == 1.0 and row.sum() == 1.0 for row, t in
                           zip(c.probs[c.ngram_from:], c.drafts[c.ngram_from:]))

    def recording_verifying(req, match_length, num_drafts, after=0):
        judged.add((req.request_id, num_drafts, after))
        verifying(req, match_length, num_drafts, after)

    hybrid.weigh, hybrid.verifying = recording_weigh, recording_verifying
    spec = drive(engine, prompts, params)
    assert chosen <= judged                       # the record learns the copied rows, after the block's
    plain_run = run(tiny_llama, prompts, params)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    assert [spec.outputs[i].token_ids for i in greedy] == [plain_run.outputs[i].token_ids for i in greedy]
    again = make_engine(tiny_llama, **kw)
    leading_into_the_prompt(again)
    assert [o.token_ids for o in drive(again, prompts, params).outputs] == [o.token_ids for o in spec.outputs]
    assert spliced[True] > 0 and spliced[False] > 0


@pytest.mark.parametrize("forecast", [0.0, 100.0])
def test_no_block_runs_where_the_ngram_continuation_beats_its_forecast(tiny_llama, drafters, forecast):
    """A block whose forecast promises no more accepted drafts than the request's n-gram continuation would lose
    to it and only cost time: it does not run (forecast 0: no request with an n-gram match runs one), and blocks
    run as before where no n-gram can promise as much (forecast 100). Greedy outputs stay plain."""
    prompts = make_prompts(8, seed=11)
    params = [SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)] * 8
    engine = make_engine(tiny_llama, speculative_block_size=4, **BLOCK_CASES["dspark-hybrid"](drafters))
    proposer = engine.proposer
    proposer.policy.forecast_gain = lambda req, rows: forecast if req.request_id in proposer.policy.forecast else None
    matched, blocks = [], []          # per step the requests with an n-gram match; (step, requests) per block
    lookups, run_block = proposer.hybrid.lookups, proposer._run_block

    def recording_lookups(plan, max_rows):
        found = lookups(plan, max_rows)
        matched.append({plan.scheduled[i].request.request_id for i in found})
        return found

    def recording_block(plan, jobs):
        blocks.append((len(matched) - 1, {job.request.request_id for job in jobs}))
        return run_block(plan, jobs)

    proposer.hybrid.lookups, proposer._run_block = recording_lookups, recording_block
    spec = drive(engine, prompts, params)
    assert [o.token_ids for o in spec.outputs] == [o.token_ids for o in run(tiny_llama, prompts, params).outputs]
    known = set()                     # requests with a forecast: those that ran a block before
    overlaps = 0
    for step, ran in blocks:
        overlaps += len(ran & matched[step] & known)
        known |= ran
    assert blocks and any(matched)
    assert (overlaps == 0) if forecast == 0.0 else (overlaps > 0)


def test_hybrid_needs_dspark(tiny_llama, drafters):
    with pytest.raises(ValueError, match="--speculative-ngram-hybrid needs DSPARK"):
        make_engine(tiny_llama, **BLOCK_CASES["dflash"](drafters), speculative_ngram_hybrid=True)
