"""NGRAM prompt lookup: which occurrence it copies from, how far, and what it proposes per request."""
import gzip
import itertools
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from specserve.engine import LLM
from specserve.speculative.ngram import NgramHybrid, NgramProposer, continuation_rates, longest_match, prompt_lookup
from specserve.speculative.windows import Candidate
from specserve.types import (
    Request,
    RequestVerifyResult,
    SamplingParams,
    ScheduledRequest,
    StepPlan,
    VerifyResult,
)


@pytest.mark.parametrize("tokens, ngram_min, ngram_max, k, drafts", [
    ([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3], 1, 4, 3, [8, 5, 1]),   # the most recent occurrence wins
    ([7, 2, 3, 4, 5, 3, 4, 0, 2, 3, 4], 1, 3, 3, [5, 3, 4]),     # the longest n-gram wins...
    ([7, 2, 3, 4, 5, 3, 4, 0, 2, 3, 4], 1, 2, 3, [0, 2, 3]),     # ...up to ngram_max
    ([1, 2, 3, 9, 1, 2, 3], 1, 4, 8, [9, 1, 2, 3, 9, 1, 2, 3]),  # a copy reaching the end runs on into its drafts
    ([4, 4, 4], 1, 4, 4, [4, 4, 4, 4]),
    ([1, 2, 3, 1], 2, 4, 3, []),                                 # only a 1-gram matches, below ngram_min
    ([1, 2, 3, 4], 1, 4, 3, []),
    ([5], 1, 4, 3, []),
    ([1, 2, 1, 2], 1, 4, 0, []),
])
def test_prompt_lookup(tokens, ngram_min, ngram_max, k, drafts):
    assert prompt_lookup(tokens, ngram_min, ngram_max, k) == drafts


@pytest.mark.parametrize("tokens, ngram_min, ngram_max, match", [
    ([1, 2, 3, 9, 1, 2, 3], 1, 4, (3, 2)),        # the suffix 1 2 3 ends at position 2
    ([1, 2, 3, 9, 1, 2, 3], 1, 2, (2, 2)),
    ([1, 2, 3, 1], 1, 4, (1, 0)),
    ([1, 2, 3, 1], 2, 4, (0, -1)),                # below ngram_min
    ([1, 2, 3, 4], 1, 4, (0, -1)),
    ([5], 1, 4, (0, -1)),
])
def test_longest_match(tokens, ngram_min, ngram_max, match):
    assert longest_match(tokens, ngram_min, ngram_max) == match


def hybrid_step(hybrid: NgramHybrid, req: Request, block: Candidate, accepted: int) -> Candidate:
    """One step of the hybrid on one request: weigh against `block`, verify the winner, record `accepted`."""
    plan = StepPlan((ScheduledRequest(req, len(req.all_token_ids) - 1, 1, True, 4),))
    candidates = {0: block}
    hybrid.weigh(plan, candidates, hybrid.lookups(plan, 4))
    if candidates[0].ngram_match:
        hybrid.verifying(req, candidates[0].ngram_match, len(candidates[0].drafts))
    hybrid.record(plan, VerifyResult((RequestVerifyResult((0,) * (accepted + 1), accepted),)))
    return candidates[0]


def test_hybrid_keeps_the_ngram_record_per_match_length():
    """Short matches that failed lose to the block; a long match on the same request still starts from its prior."""
    hybrid = NgramHybrid(1, 4)
    block = Candidate([7, 7, 7, 7], [], [0.25] * 4)                  # expects 0.33 accepted drafts
    short = Request("a", [5, 1, 2, 3, 6, 5], SamplingParams())      # only the 1-gram `5` matches
    assert hybrid.lookup(short, 4).confidences == list(NgramHybrid.PRIORS[1][:4])    # expects 0.48
    assert hybrid_step(hybrid, short, block, accepted=0).ngram_match == 1
    assert hybrid.per_request["a"][1].counts == [1]
    assert not hybrid_step(hybrid, short, block, accepted=0).ngram_match  # its 1-gram match has failed once
    short.output_token_ids.extend([1, 2, 3])                             # now `5 1 2 3` matches: 4 tokens
    assert hybrid.lookup(short, 4) == Candidate([6, 5, 1, 2], [], list(NgramHybrid.PRIORS[4][:4]), ngram_match=4)
    assert hybrid_step(hybrid, short, block, accepted=4).ngram_match == 4
    assert set(hybrid.per_request["a"]) == {1, 4}
    hybrid.release(short)
    assert not hybrid.per_request and not hybrid.pending


def test_a_splice_copies_the_prompt_after_the_block_drafts_that_lead_into_it():
    """Nothing earlier ends in 6, so prompt lookup alone has nothing; after the block's drafts 5 1 2 the prompt's
    `5 1 2` matches and its continuation 3 4 promises more than the block's unsure last rows."""
    hybrid = NgramHybrid(1, 4)
    req = Request("a", [5, 1, 2, 3, 4, 6], SamplingParams())
    block = Candidate([5, 1, 2, 8, 8], [], [0.9, 0.9, 0.9, 0.1, 0.1])
    plan = StepPlan((ScheduledRequest(req, len(req.all_token_ids) - 1, 1, True, 5),))
    candidates = {0: block}
    hybrid.weigh(plan, candidates, hybrid.lookups(plan, 5))
    assert candidates[0] == Candidate([5, 1, 2, 3, 4], [], [0.9, 0.9, 0.9, *NgramHybrid.PRIORS[3][:2]],
                                      ngram_match=3, ngram_from=3)
    hybrid.verifying(req, 3, 2, after=3)
    hybrid.record(plan, VerifyResult((RequestVerifyResult((5, 1, 2, 3, 0), 4),)))     # 5 1 2 3 held, 4 did not
    assert (hybrid.per_request["a"][3].sums, hybrid.per_request["a"][3].counts) == ([1.0, 0.0], [1, 1])
    hybrid.verifying(req, 3, 2, after=3)
    hybrid.record(plan, VerifyResult((RequestVerifyResult((5, 1, 0), 2),)))    # the block's third draft failed
    assert hybrid.per_request["a"][3].counts == [1, 1]                         # the n-gram rows were never judged


@pytest.mark.parametrize("drafts, confidences", [
    ([5, 1, 2, 8, 8], [0.9] * 5),                  # a sure block promises more than any splice
    ([9, 7, 8, 7, 8], [0.9, 0.9, 0.9, 0.1, 0.1]),  # no prefix of its drafts leads into the prompt
    ([5, 1, 2, 3, 4], [0.9, 0.9, 0.9, 0.1, 0.1]),  # the copy would draft what the block does
    ([5, 1, 8, 8, 8], [0.9, 0.9, 0.1, 0.1, 0.1]),  # `5 1` matches, too short a match to trust after drafts
])
def test_no_splice_where_none_would_change_or_improve_the_drafts(drafts, confidences):
    req = Request("a", [5, 1, 2, 3, 4, 6], SamplingParams())
    assert NgramHybrid(1, 4).splice(req, Candidate(drafts, [], confidences)) is None


def test_a_sampled_splice_verifies_its_copied_drafts_as_deterministic():
    """The block's sampled drafts keep their q rows; each copied draft gets a one-hot q row (a deterministic
    proposal, as prompt lookup's own drafts are verified)."""
    req = Request("a", [5, 1, 2, 3, 4, 6], SamplingParams(temperature=0.8, seed=3))
    q = [torch.softmax(torch.randn(10, generator=torch.Generator().manual_seed(k)), 0) for k in range(5)]
    spliced = NgramHybrid(1, 4).splice(req, Candidate([5, 1, 2, 8, 8], q, [0.9, 0.9, 0.9, 0.1, 0.1]))
    assert spliced.drafts == [5, 1, 2, 3, 4] and spliced.ngram_from == 3
    assert all(torch.equal(a, b) for a, b in zip(spliced.probs[:3], q[:3]))
    assert [row.nonzero().flatten().tolist() for row in spliced.probs[3:]] == [[3], [4]]
    assert [row.sum().item() for row in spliced.probs[3:]] == [1.0, 1.0]


def test_continuation_rates_count_each_row_until_the_first_miss():
    # prompt 1 2 3, answer 1 2 3 1 9; after `1 2 3` nothing matches; after `1 2 3 1` the 1-gram `1` drafts 2 3 1,
    # all held; after `.. 1 2` the 2-gram drafts 3 1 2 against 3 1 9; after `.. 1 2 3` the 3-gram drafts 1 2 3
    # against the last two tokens 1 9
    rates = continuation_rates([([1, 2, 3], [1, 2, 3, 1, 9])], 1, 4, 3)
    assert rates == {1: [1.0, 1.0, 1.0], 2: [1.0, 1.0, 0.0], 3: [1.0, 0.0, None]}


def test_the_ngram_priors_are_the_measured_continuation_rates():
    """PRIORS is what benchmarks/ngram_priors.py measures on the committed answers of the embedded target."""
    path = Path(__file__).resolve().parent.parent / "data/smollm2-135m-sharegpt-regenerated.jsonl.gz"
    with gzip.open(path, "rt") as f:
        pairs = [(r["prompt_ids"], r["output_ids"]) for r in map(json.loads, itertools.islice(f, 1000))]
    rates = continuation_rates(pairs, 1, 4, 8, stride=2)
    assert {n: tuple(round(r, 2) for r in row) for n, row in rates.items()} == NgramHybrid.PRIORS


def reference_lookup(tokens, ngram_min, ngram_max, k):
    """The definition, longest n first: the latest earlier n-gram equal to the suffix, then copy on."""
    for n in range(min(ngram_max, len(tokens) - 1), ngram_min - 1, -1):
        ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e - n + 1:e + 1] == tokens[-n:]]
        if ends:
            seq = list(tokens)
            for i in range(ends[-1] + 1, ends[-1] + 1 + k):
                seq.append(seq[i])
            return seq[len(tokens):]
    return []


@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40), ngram_min=st.integers(1, 3),
       extra=st.integers(0, 3), k=st.integers(0, 9))
def test_prompt_lookup_matches_the_definition(tokens, ngram_min, extra, k):
    assert prompt_lookup(tokens, ngram_min, ngram_min + extra, k) == reference_lookup(tokens, ngram_min,
                                                                                        ngram_min + extra, k)


def test_propose_respects_reserved_slots_and_prefill_chunks():
    proposer = NgramProposer(num_draft_tokens=4, ngram_min=1, ngram_max=3)
    repeating = [1, 2, 3] * 4
    reqs = [Request(str(i), repeating, SamplingParams()) for i in range(4)]
    plan = StepPlan((ScheduledRequest(reqs[0], 0, 12, True, 4),
                     ScheduledRequest(reqs[1], 0, 12, True, 2),      # near max_new_tokens: fewer slots
                     ScheduledRequest(reqs[2], 0, 6, False, 0),      # a prefill chunk does not sample
                     ScheduledRequest(reqs[3], 0, 12, True, 0)))
    proposal = proposer.propose(plan)
    assert proposal.draft_tokens == ((1, 2, 3, 1), (1, 2), (), ())
    assert proposal.draft_probs == (None,) * 4
    assert proposer.draft_slots(reqs[0]) == 4 and proposer.kv_geometry is None


def test_engine_passes_ngram_sizes_and_rejects_bad_ones(tiny_llama):
    llm = LLM(checkpoint=tiny_llama, dtype="float64", num_pages=64, speculative_algorithm="ngram",
              speculative_ngram_min=2, speculative_ngram_max=3, speculative_num_draft_tokens=6)
    proposer = llm.engine.proposer
    assert isinstance(proposer, NgramProposer)
    assert (proposer.ngram_min, proposer.ngram_max, proposer.k) == (2, 3, 6)
    assert llm.engine.draft_pool is None
    with pytest.raises(ValueError, match="n-gram sizes"):
        LLM(checkpoint=tiny_llama, dtype="float64", num_pages=64, speculative_algorithm="NGRAM",
            speculative_ngram_min=3, speculative_ngram_max=2)


def test_repetitive_text_is_drafted_and_accepted(tiny_llama):
    # The tiny random model falls into loops quickly; a loop is exactly what prompt lookup drafts.
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    plain = LLM(checkpoint=tiny_llama, dtype="float64", num_pages=64).generate([[3, 1, 4, 1, 5]], params)[0]
    out = LLM(checkpoint=tiny_llama, dtype="float64", num_pages=64, speculative_algorithm="NGRAM",
              speculative_num_draft_tokens=8).generate([[3, 1, 4, 1, 5]], params)[0]
    assert out.token_ids == plain.token_ids
    assert out.spec.accept_length > 2 and out.spec.num_accepted_drafts > 0
