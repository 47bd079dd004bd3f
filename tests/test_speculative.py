"""The speculative package's seams: flag validation (every error names its flag), the registry's
defaults, and plain decoding's null proposer."""
from __future__ import annotations

import pytest

from specserve.config import SpecConfig
from specserve.speculative import DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS, NoProposer, validate_spec
from specserve.types import Request, SamplingParams, ScheduledRequest, StepPlan


@pytest.mark.parametrize("spec, message", [
    (SpecConfig(algorithm="MEDUSA"), "--speculative-algorithm 'MEDUSA' is not supported: choose one of NONE, NGRAM"),
    (SpecConfig(algorithm="NGRAM", num_draft_tokens=MAX_DRAFT_TOKENS + 1),
     rf"--speculative-num-draft-tokens must be in \[1, {MAX_DRAFT_TOKENS}\], got {MAX_DRAFT_TOKENS + 1}"),
    (SpecConfig(algorithm="NGRAM", num_draft_tokens=-2), r"--speculative-num-draft-tokens must be in \[1, 64\]"),
    (SpecConfig(algorithm="STANDALONE"), "STANDALONE needs --speculative-draft-model-path"),
    (SpecConfig(algorithm="EAGLE", ngram_hybrid=True), "--speculative-ngram-hybrid needs DSPARK's confidences"),
    (SpecConfig(algorithm="NGRAM", ngram_min=3, ngram_max=2), r"1 <= min <= max, got 3..2"),
    (SpecConfig(algorithm="NGRAM", ngram_min=0), r"1 <= min <= max, got 0..4"),
])
def test_every_bad_flag_is_named(spec, message):
    with pytest.raises(ValueError, match=message):
        validate_spec(spec)


def test_names_are_case_insensitive_and_draft_counts_default_per_algorithm():
    assert validate_spec(SpecConfig(algorithm="none")) == SpecConfig(algorithm="none")
    for algorithm, k in DEFAULT_DRAFT_TOKENS.items():
        checked = validate_spec(SpecConfig(algorithm=algorithm.lower(), draft_model_path="x"))
        assert (checked.algorithm, checked.num_draft_tokens) == (algorithm, k)
    assert validate_spec(SpecConfig(algorithm="NGRAM", num_draft_tokens=7)).num_draft_tokens == 7


def test_plain_decoding_proposes_nothing_and_keeps_no_state():
    proposer = NoProposer()
    req = Request("r", [1, 2, 3], SamplingParams())
    req.num_computed_tokens = 2
    plan = StepPlan((ScheduledRequest(req, 2, 1, True),))
    assert proposer.propose(plan).draft_tokens == ((),)
    assert proposer.draft_slots(req) == 0 and proposer.context_length(req) == 2
    assert proposer.kv_geometry is None and proposer.aux_layer_ids == ()
    with pytest.raises(TypeError, match="no draft KV"):
        proposer.attach_pool(None)
