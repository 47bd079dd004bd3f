"""Structured output under speculation (specserve/grammar.py): the draft walk cuts what the grammar forbids and
leaves the matcher where it was; greedy output under a grammar is the same with every proposer as without one;
sampled output is distributed as the target restricted to the grammar; every output matches its grammar."""
from __future__ import annotations

import json
import re

import pytest
import torch
import xgrammar as xgr

from specserve import grammar, sampling
from specserve.models.block_drafter import random_block_drafter
from specserve.speculative.verify import verify
from specserve.types import Grammar, Proposal, Request, SamplingParams, ScheduledRequest, StepPlan
from tests.spec_harness import LOSSLESS_CASES, assert_pages_released, make_prompts, run
from tests.test_verify import _chi2_pvalue

REGEX = r"(ab|ba)+c"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"]}
GRAMMARS = {"regex": Grammar("regex", REGEX), "json-schema": Grammar("json_schema", json.dumps(SCHEMA))}


def _plan(requests: list[Request]) -> StepPlan:
    return StepPlan(tuple(ScheduledRequest(r, r.num_computed_tokens, 1, True, 8) for r in requests))


def _allowed_text(tokenizer, allowed: torch.Tensor) -> set[str]:   # allowed: [vocab] bool
    return {tokenizer.decode([t]) for t in allowed.nonzero().flatten().tolist()}


def test_unpack_matches_xgrammars_own_mask(tiny_llama):
    vocab = tiny_llama.config.vocab_size
    matcher = grammar.GrammarCompiler(tiny_llama.tokenizer, vocab, {256}).matcher(GRAMMARS["json-schema"])
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask, 0)
    logits = torch.zeros(1, vocab)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    assert torch.equal(grammar.unpack(bitmask, vocab), logits.isfinite())
    assert _allowed_text(tiny_llama.tokenizer, grammar.unpack(bitmask, vocab)[0]) == {"{"}


def test_the_walk_cuts_at_the_first_forbidden_draft_and_rolls_the_matcher_back(tiny_llama):
    tok, vocab = tiny_llama.tokenizer, tiny_llama.config.vocab_size
    compiler = grammar.GrammarCompiler(tok, vocab, {256})
    req = Request("r", [1, 2], SamplingParams(temperature=0.0, grammar=GRAMMARS["regex"]))
    req.grammar_matcher = compiler.matcher(GRAMMARS["regex"])
    free = Request("f", [1, 2], SamplingParams(temperature=0.0))
    drafts = tuple(tok.encode("abxa"))
    proposal = Proposal((drafts, drafts), (None, None), ((0.9,) * 4, (0.8,) * 4))
    new, allowed = grammar.constrain(_plan([req, free]), proposal, vocab)
    assert new.draft_tokens == (drafts[:2], drafts) and new.confidences == ((0.9,) * 2, (0.8,) * 4)
    assert allowed.shape == (3 + 5, vocab)
    assert [_allowed_text(tok, row) for row in allowed[:3]] == [{"a", "b"}, {"b"}, {"a", "b", "c"}]
    assert allowed[3:].all()
    # the matcher is back at the start: the same walk again gives the same rows
    again, allowed_again = grammar.constrain(_plan([req]), Proposal((drafts,), (None,)), vocab)
    assert again.draft_tokens == (drafts[:2],) and torch.equal(allowed_again, allowed[:3])
    # no request with a grammar: nothing to do
    assert grammar.constrain(_plan([free]), Proposal((drafts,), (None,)), vocab) == (Proposal((drafts,), (None,)), None)


def test_a_sampled_forbidden_draft_stays_as_the_windows_last_draft(tiny_llama):
    """A forbidden sampled draft is verified (surely rejected, so its row samples the residual of its own q);
    the drafts after it go, and the row after it is never reached."""
    tok, vocab = tiny_llama.tokenizer, tiny_llama.config.vocab_size
    req = Request("r", [1], SamplingParams(temperature=1.0, grammar=GRAMMARS["regex"]))
    req.grammar_matcher = grammar.GrammarCompiler(tok, vocab, {256}).matcher(GRAMMARS["regex"])
    a, b, x = tok.encode("abx")
    q = torch.softmax(torch.randn(3, vocab, dtype=torch.float64), -1)
    new, allowed = grammar.constrain(_plan([req]), Proposal(((a, x, b),), (q,)), vocab)
    assert new.draft_tokens == ((a, x),) and torch.equal(new.draft_probs[0], q[:2])
    assert [_allowed_text(tok, row) for row in allowed[:2]] == [{"a", "b"}, {"b"}] and allowed[2].all()
    greedy = Request("g", [1], SamplingParams(temperature=0.0, grammar=GRAMMARS["regex"]))
    greedy.grammar_matcher = req.grammar_matcher
    assert grammar.constrain(_plan([greedy]), Proposal(((a, x, b),), (None,)), vocab)[0].draft_tokens == ((a,),)


class ToyMatcher:
    """A grammar over an 8-token vocabulary with xgrammar's matcher interface: the first token must be in
    {1, 2, 3, 5}; after token t the next must be in {t, t+1, t+3, 7} (mod 8)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def allowed(self) -> set[int]:
        if not self.tokens:
            return {1, 2, 3, 5}
        t = self.tokens[-1]
        return {t, (t + 1) % 8, (t + 3) % 8, 7}

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index] = sum(1 << t for t in self.allowed())

    def accept_token(self, token: int) -> bool:
        ok = token in self.allowed()
        if ok:
            self.tokens.append(token)
        return ok

    def rollback(self, n: int) -> None:
        del self.tokens[len(self.tokens) - n:]

    def is_terminated(self) -> bool:
        return False


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection", "coupled"])
def test_sampled_speculation_under_a_grammar_emits_the_targets_restricted_distribution(seeded):
    """Two drafts from a drafter with mass on forbidden tokens; the first two emitted tokens of many requests
    follow p restricted to the grammar at each position (chi-square, as tests/test_verify.py)."""
    assert _two_token_fit(seeded) > 1e-3


def test_the_statistic_catches_a_dropped_forbidden_sampled_draft(monkeypatch):
    walk = grammar._walk
    monkeypatch.setattr(grammar, "_walk", lambda matcher, drafts, sampled, bitmask: walk(matcher, drafts, False,
                                                                                          bitmask))
    assert _two_token_fit(seeded=False) < 1e-3


def _two_token_fit(seeded: bool) -> float:
    vocab, n = 8, 12000
    gen = torch.Generator().manual_seed(3)
    t0, t1, t2 = torch.randn(vocab, generator=gen), torch.randn(vocab, vocab, generator=gen), torch.randn(vocab)
    q0 = torch.softmax(1.5 * torch.randn(vocab, generator=gen), -1)
    q1 = torch.softmax(1.5 * torch.randn(vocab, vocab, generator=gen), -1)
    params = SamplingParams(temperature=0.9)
    tokens = []
    for i in range(n):
        p = SamplingParams(temperature=0.9, seed=i) if seeded else params
        req = Request(str(i), [0], p)
        req.grammar_matcher = ToyMatcher()
        d0 = int(torch.multinomial(q0, 1, generator=gen))
        d1 = int(torch.multinomial(q1[d0], 1, generator=gen))
        proposal = Proposal(((d0, d1),), (torch.stack([q0, q1[d0]]),))
        proposal, allowed = grammar.constrain(_plan([req]), proposal, vocab)
        kept = proposal.draft_tokens[0]
        logits = torch.stack([t0, *([t1[kept[0]]] if kept else []), *([t2] if len(kept) > 1 else [])])
        emitted = verify(logits, _plan([req]), proposal, gen, allowed).per_request[0].emitted
        if len(emitted) == 1:
            req.grammar_matcher.accept_token(emitted[0])
            req.output_token_ids.append(emitted[0])
            plain, allowed = grammar.constrain(_plan([req]), Proposal.none(1), vocab)
            emitted += verify(t1[emitted[0]][None], _plan([req]), plain, gen, allowed).per_request[0].emitted
        tokens.append(emitted[:2])
    tokens = torch.tensor(tokens)
    mask0 = torch.zeros(vocab, dtype=torch.bool)
    mask0[[1, 2, 3, 5]] = True
    mask1 = torch.zeros(vocab, vocab, dtype=torch.bool)
    for t in range(vocab):
        mask1[t, [t, (t + 1) % 8, (t + 3) % 8, 7]] = True
    p0 = sampling.process(t0.masked_fill(~mask0, float("-inf"))[None].double(), params)[0]
    p1 = sampling.process(t1.masked_fill(~mask1, float("-inf")).double(), params)
    first = torch.bincount(tokens[:, 0], minlength=vocab)
    joint = torch.bincount(tokens[:, 0] * vocab + tokens[:, 1], minlength=vocab * vocab)
    return min(_chi2_pvalue(first, p0), _chi2_pvalue(joint, p0[:, None] * p1))


@pytest.fixture(scope="module")
def block_drafters(tiny_llama, tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("grammar-drafters")
    random_block_drafter(tiny_llama.config, "DFLASH", num_layers=1, seed=1, dtype=torch.float64).save(root / "dflash")
    random_block_drafter(tiny_llama.config, token_map=torch.arange(200), seed=2,
                         dtype=torch.float64).save(root / "dspark")
    return {"dflash": {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": str(root / "dflash")},
            "dspark-hybrid": {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": str(root / "dspark"),
                              "speculative_dspark_confidence_threshold": 0.0, "speculative_ngram_hybrid": True}}


PROMPTS = make_prompts(8, seed=4)
ENGINE = {"max_num_batched_tokens": 64}


def _params(g: Grammar, **kw) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=12 + 5 * i, grammar=g, **{"temperature": 0.0, **kw}) for i in range(8)]


def _matches(g: Grammar, text: str, finish_reason: str) -> bool:
    """A finished output matches the grammar; one cut by its length is a prefix of a match."""
    if finish_reason == "length":
        return True
    if g.kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    value = json.loads(text)
    return (set(value) == {"name", "n"} and isinstance(value["name"], str) and len(value["name"]) <= 6
            and isinstance(value["n"], int) and 0 <= value["n"] <= 99)


@pytest.mark.parametrize("grammar_name", GRAMMARS)
@pytest.mark.parametrize("case", [*LOSSLESS_CASES, "dflash", "dspark-hybrid"])
def test_greedy_speculation_under_a_grammar_equals_plain_decoding_under_it(tiny_llama, block_drafters, case,
                                                                           grammar_name):
    g = GRAMMARS[grammar_name]
    kw = block_drafters[case] if case in block_drafters else LOSSLESS_CASES[case][0](tiny_llama)
    plain = run(tiny_llama, PROMPTS, _params(g), **ENGINE)
    spec = run(tiny_llama, PROMPTS, _params(g), poison=True, speculative_num_draft_tokens=4, **ENGINE, **kw)
    assert [o.token_ids for o in spec.outputs] == [o.token_ids for o in plain.outputs]
    assert all(_matches(g, o.text, o.finish_reason) for o in plain.outputs)
    assert any(o.finish_reason == "stop" for o in plain.outputs)
    if case in ("ngram", "standalone-agree", "eagle"):      # drafters that agree with the target get drafts in
        assert spec.engine.stats.num_accepted_drafts > 0
    assert_pages_released(spec.engine)


def test_a_seeded_request_under_a_grammar_samples_what_plain_decoding_samples(tiny_llama):
    params = _params(GRAMMARS["regex"], temperature=0.8, seed=7)
    plain = run(tiny_llama, PROMPTS, params, **ENGINE)
    spec = run(tiny_llama, PROMPTS, params, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4, **ENGINE)
    assert [o.token_ids for o in spec.outputs] == [o.token_ids for o in plain.outputs]
    assert all(_matches(GRAMMARS["regex"], o.text, o.finish_reason) for o in spec.outputs)


def test_a_bad_grammar_is_refused_at_admission_by_the_parameter_that_carried_it(tiny_llama):
    from tests.spec_harness import make_engine
    engine = make_engine(tiny_llama)
    with pytest.raises(ValueError, match=r"^regex: not a valid regex: .*parenthesis"):
        engine.add_request([1, 2], SamplingParams(grammar=Grammar("regex", "(ab")))
    with pytest.raises(ValueError, match=r"^response_format: not a valid json schema"):
        engine.add_request([1, 2], SamplingParams(grammar=Grammar("json_schema", "{not json")))
    with pytest.raises(ValueError, match="ignore_eos: cannot be combined with ebnf"):
        SamplingParams(ignore_eos=True, grammar=Grammar("ebnf", 'root ::= "a"'))
    assert not engine.has_unfinished
