"""STANDALONE: build-time checks, the drafter's own KV (caught up, clamped, released), q for sampled
requests, and loading the drafter from --speculative-draft-model-path."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from specserve import sampling
from specserve.attention.sdpa import AttentionMetadata, SeqSpan
from specserve.kv_pages import KVPool
from specserve.speculative.draft_model import DraftModelProposer
from specserve.types import Request, SamplingParams, ScheduledRequest, StepPlan
from tests.conftest import save_hf_folder
from tests.spec_harness import first_layers, make_engine, run

STANDALONE = {"speculative_algorithm": "STANDALONE"}
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)


def test_vocab_size_mismatch_names_both_models(tiny_llama):
    draft = first_layers(tiny_llama, 1)
    draft = dataclasses.replace(draft, config=dataclasses.replace(draft.config, vocab_size=300))
    with pytest.raises(ValueError, match=r"draft model tiny-llama-first1 has vocab_size 300 but the target "
                                         r"tiny-llama has 257"):
        make_engine(tiny_llama, draft, **STANDALONE)


def test_tokenizer_mismatch_is_refused(tiny_llama):
    vocab = {**tiny_llama.tokenizer.get_vocab(), "<eos>": 0}
    draft = dataclasses.replace(first_layers(tiny_llama, 1), tokenizer=SimpleNamespace(get_vocab=lambda: vocab))
    with pytest.raises(ValueError, match="different tokenizer from the target tiny-llama"):
        make_engine(tiny_llama, draft, **STANDALONE)


def test_draft_pool_has_the_drafters_geometry(tiny_llama):
    engine = make_engine(tiny_llama, first_layers(tiny_llama, 1), **STANDALONE)
    assert engine.draft_pool.geometry.num_layers == 1 and engine.pool.geometry.num_layers == 2
    assert engine.draft_pool.num_pages == engine.pool.num_pages


def _plan_for(engine, prompts, params, max_drafts, samples=True) -> StepPlan:
    scheduled = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        req = Request(str(i), prompt, p)
        req.pages = engine.allocator.allocate(-(-(len(prompt) + max_drafts) // engine.pool.page_size))
        scheduled.append(ScheduledRequest(req, 0, len(prompt), samples, max_drafts if samples else 0))
    return StepPlan(tuple(scheduled))


def _reference_logits(proposer: DraftModelProposer, tokens: list[int]) -> torch.Tensor:
    """The drafter alone on a fresh pool: logits after every token, [len(tokens), vocab]."""
    pool = KVPool(proposer.kv_geometry, 64, 4)
    meta = AttentionMetadata.build([SeqSpan(list(range(64)), 0, len(tokens))], 4, pool.null_slot)
    hidden, _ = proposer.model.forward(torch.tensor(tokens), torch.arange(len(tokens)), meta, pool)
    return proposer.model.logits(hidden)


def test_drafts_are_the_drafters_own_greedy_continuation(tiny_llama):
    engine = make_engine(tiny_llama, first_layers(tiny_llama, 1), speculative_num_draft_tokens=5, **STANDALONE)
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3], [1]]
    plan = _plan_for(engine, prompts, [GREEDY] * 3, 3)
    proposal = engine.proposer.propose(plan)
    assert proposal.draft_probs == (None, None, None)
    for prompt, drafts in zip(prompts, proposal.draft_tokens):
        assert len(drafts) == 3   # max_drafts, not K
        logits = _reference_logits(engine.proposer, prompt + list(drafts[:-1]))
        assert tuple(logits[len(prompt) - 1:].argmax(-1).tolist()) == drafts


def test_sampled_drafts_come_with_their_exact_distribution(tiny_llama):
    engine = make_engine(tiny_llama, first_layers(tiny_llama, 1), speculative_num_draft_tokens=4, **STANDALONE)
    params = [SamplingParams(temperature=0.7, top_k=3, seed=11), SamplingParams(temperature=1.3, top_p=0.8, seed=12)]
    prompts = [[5, 6, 7], [40, 41]]
    proposal = engine.proposer.propose(_plan_for(engine, prompts, params, 4))
    for prompt, p, drafts, q in zip(prompts, params, proposal.draft_tokens, proposal.draft_probs):
        assert q.shape == (4, tiny_llama.config.vocab_size)
        logits = _reference_logits(engine.proposer, prompt + list(drafts[:-1]))[len(prompt) - 1:]
        torch.testing.assert_close(q, sampling.process(logits, p), rtol=0, atol=1e-12)
        assert all(q[i, t] > 0 for i, t in enumerate(drafts))
    assert (proposal.draft_probs[0] > 0).sum(-1).tolist() == [3] * 4
    again = make_engine(tiny_llama, first_layers(tiny_llama, 1), speculative_num_draft_tokens=4, **STANDALONE)
    assert again.proposer.propose(_plan_for(again, prompts, params, 4)).draft_tokens == proposal.draft_tokens


def test_prefill_chunks_get_no_drafts_and_no_draft_state(tiny_llama):
    engine = make_engine(tiny_llama, first_layers(tiny_llama, 1), **STANDALONE)
    proposal = engine.proposer.propose(_plan_for(engine, [[1, 2, 3]], [GREEDY], 4, samples=False))
    assert proposal.draft_tokens == ((),) and not engine.proposer.num_valid


def test_draft_kv_of_valid_tokens_matches_a_fresh_drafter_through_preemption(tiny_llama):
    """After every step, each running request's draft KV over its valid prefix equals what the drafter
    computes from scratch, and the valid prefix never covers an uncommitted token."""
    engine = make_engine(tiny_llama, first_layers(tiny_llama, 1), num_pages=20, speculative_num_draft_tokens=5,
                         **STANDALONE)
    proposer, pool = engine.proposer, engine.draft_pool
    reqs = [engine.requests[engine.add_request([3 * i + j for j in range(1 + 4 * i)], GREEDY)] for i in range(6)]
    checked = 0
    while engine.has_unfinished:
        engine.step()
        for req in engine.scheduler.running:
            n = proposer.num_valid.get(req.request_id, 0)
            assert n <= req.num_computed_tokens
            if n:
                fresh = KVPool(proposer.kv_geometry, 64, 4)
                meta = AttentionMetadata.build([SeqSpan(list(range(64)), 0, n)], 4, fresh.null_slot)
                proposer.model.forward(torch.tensor(req.all_token_ids[:n]), torch.arange(n), meta, fresh)
                slots = [req.pages[p // 4] * 4 + p % 4 for p in range(n)]
                torch.testing.assert_close(pool.k[:, slots], fresh.k[:, :n], rtol=0, atol=1e-12)
                torch.testing.assert_close(pool.v[:, slots], fresh.v[:, :n], rtol=0, atol=1e-12)
                checked += 1
    assert checked > 20 and sum(r.num_preemptions for r in reqs) > 0
    assert not proposer.num_valid


def test_qwen_target_with_a_drafter_of_its_first_layer_is_lossless(tiny_qwen):
    prompts = [[5, 6, 7, 5, 6, 7], [100, 3], [42] * 9]
    params = [GREEDY, GREEDY, dataclasses.replace(GREEDY, repetition_penalty=1.5, frequency_penalty=0.5)]
    plain = run(tiny_qwen, prompts, params)
    spec = run(tiny_qwen, prompts, params, draft=first_layers(tiny_qwen, 1), poison=True,
               speculative_num_draft_tokens=4, **STANDALONE)
    assert [o.token_ids for o in spec.outputs] == [o.token_ids for o in plain.outputs]
    assert sum(o.spec.num_accepted_drafts for o in spec.outputs) > 0


def test_drafter_with_a_shorter_context_drafts_at_the_targets_positions(tiny_llama):
    short = first_layers(tiny_llama, 1)
    short = dataclasses.replace(short, config=dataclasses.replace(short.config, max_position_embeddings=16))
    prompt = list(range(10, 30))
    plain = run(tiny_llama, [prompt], GREEDY)
    spec = run(tiny_llama, [prompt], GREEDY, draft=short, speculative_num_draft_tokens=4, **STANDALONE)
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids


def test_draft_model_path_is_loaded(tiny_llama, tmp_path):
    draft = first_layers(tiny_llama, 1)
    save_hf_folder(draft, tmp_path)
    prompts = [[5, 6, 7], [9, 9, 9, 9]]
    spec = run(tiny_llama, prompts, GREEDY, speculative_draft_model_path=str(tmp_path),
               speculative_num_draft_tokens=4, **STANDALONE)
    assert spec.engine.proposer.model.config.num_layers == 1
    assert [o.token_ids for o in spec.outputs] == [o.token_ids for o in run(tiny_llama, prompts, GREEDY).outputs]
