import dataclasses

import pytest
import torch

from specserve import sampling
from specserve.speculative import verify as verify_module
from specserve.speculative.verify import verify
from specserve.types import Proposal, Request, SamplingParams, ScheduledRequest, StepPlan

GREEDY = SamplingParams(temperature=0.0)
VOCAB = 8
NUM_DRAWS = 20000


def _plan(requests: list[Request], samples: list[bool] | None = None) -> StepPlan:
    samples = samples or [True] * len(requests)
    return StepPlan(tuple(ScheduledRequest(r, r.num_computed_tokens, 1, s, 4)
                          for r, s in zip(requests, samples)))


def _request(params: SamplingParams, prompt=(0,), output=(), rid="r") -> Request:
    return Request(rid, list(prompt), params, output_token_ids=list(output))


def _argmax(logits: torch.Tensor) -> list[int]:
    return logits.argmax(-1).tolist()


# ---------------------------------------------------------------------------------- greedy

def test_zero_drafts_is_argmax():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    requests = [_request(GREEDY, rid=str(i)) for i in range(5)]
    result = verify(logits, _plan(requests), Proposal.none(5))
    assert [r.emitted for r in result.per_request] == [(t,) for t in _argmax(logits)]
    assert all(r.num_accepted == 0 and r.logprobs == () for r in result.per_request)


@pytest.mark.parametrize("mismatch", [0, 1, 3, None])
def test_greedy_longest_prefix_then_bonus(mismatch):
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    target = _argmax(logits)
    drafts = list(target[:4])
    if mismatch is not None:
        drafts[mismatch] = (drafts[mismatch] + 1) % 50
    result = verify(logits, _plan([_request(GREEDY)]), Proposal((tuple(drafts),), (None,)))
    n = 4 if mismatch is None else mismatch
    assert result.per_request[0].emitted == tuple(target[:n + 1])
    assert result.per_request[0].num_accepted == n


def test_greedy_rule_for_greedy_request_with_sampled_drafter():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(2))
    target = _argmax(logits)
    q = torch.full((2, 10), 0.1)   # a drafter that liked every token equally
    proposal = Proposal(((target[0], (target[1] + 1) % 10),), (q,))
    result = verify(logits, _plan([_request(GREEDY)]), proposal)
    assert result.per_request[0].emitted == (target[0], target[1])


def test_greedy_argmax_of_penalised_rows_sees_earlier_drafts():
    logits = torch.tensor([[0.0, 5.0, 4.9, 0.0],      # token 1 is in the prompt: 5 / 2 < 4.9
                           [0.0, 0.0, 4.0, 3.9],      # draft 2 was just accepted: 4 / 2 < 3.9
                           [0.0, 0.0, 0.0, 1.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    result = verify(logits, _plan([_request(params, prompt=(1,))]), Proposal(((2, 3),), (None,)))
    assert result.per_request[0].emitted == (2, 3, 3)
    unpenalised = verify(logits, _plan([_request(GREEDY, prompt=(1,))]), Proposal(((2, 3),), (None,)))
    assert unpenalised.per_request[0].emitted == (1,)


def test_prefill_chunks_have_no_rows():
    logits = torch.randn(1 + 3, 20, generator=torch.Generator().manual_seed(3))
    target = _argmax(logits)
    requests = [_request(GREEDY, rid=str(i)) for i in range(3)]
    proposal = Proposal(((), (), tuple(target[1:3])), (None, None, None))
    result = verify(logits, _plan(requests, [True, False, True]), proposal)
    assert result.per_request[0].emitted == (target[0],)
    assert result.per_request[1] is None
    assert result.per_request[2].emitted == tuple(target[1:4])


def test_row_count_must_match():
    with pytest.raises(ValueError, match="logit rows"):
        verify(torch.zeros(2, 5), _plan([_request(GREEDY)]), Proposal.none(1))


def test_mixed_greedy_and_sampled_batch():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(4))
    target = _argmax(logits)
    requests = [_request(GREEDY, rid="a"), _request(SamplingParams(temperature=1.0, seed=1), rid="b"),
                _request(GREEDY, rid="c")]
    proposal = Proposal(((target[0],), (5,), (target[4],)),
                        (None, torch.full((1, 30), 1 / 30), None))
    result = verify(logits, _plan(requests), proposal, torch.Generator().manual_seed(0))
    assert result.per_request[0].emitted == (target[0], target[1])
    assert result.per_request[2].emitted == (target[4], target[5])
    assert 1 <= len(result.per_request[1].emitted) <= 2


# ---------------------------------------------------------------------------------- logprobs

@pytest.mark.parametrize("seed", [3, None], ids=["coupled", "rejection"])
def test_logprobs_under_speculation_are_raw_rows(seed):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4 + 3, 40, generator=gen)
    params = SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.5, seed=seed,
                            logprobs=True, top_logprobs=3)
    requests = [_request(params, prompt=(1, 2, 3), rid="a"),
                _request(dataclasses.replace(params, temperature=0.0, top_logprobs=0), rid="b")]
    q = torch.softmax(torch.randn(3, 40, generator=gen), -1)
    proposal = Proposal((tuple(_argmax(logits[:3])), (7, 7)), (q, None))
    result = verify(logits, _plan(requests), proposal, gen)
    raw = torch.log_softmax(logits, dim=-1)
    for r, start, k in ((result.per_request[0], 0, 3), (result.per_request[1], 4, 0)):
        assert len(r.logprobs) == len(r.emitted)
        for j, token in enumerate(r.emitted):
            assert r.logprobs[j] == pytest.approx(raw[start + j, token].item(), abs=1e-6)
        assert len(r.top_logprobs) == (len(r.emitted) if k else 0)
        for j, top in enumerate(r.top_logprobs):
            assert list(top) == raw[start + j].topk(k).indices.tolist()


def test_logprobs_same_with_and_without_speculation():
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(6))
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5)
    drafts = tuple(_argmax(logits[:3]))
    spec = verify(logits, _plan([_request(params)]), Proposal((drafts,), (None,))).per_request[0]
    assert spec.num_accepted == 3
    for j in range(4):
        plain = verify(logits[j:j + 1], _plan([_request(params, output=spec.emitted[:j])]),
                       Proposal.none(1)).per_request[0]
        assert plain.emitted[0] == spec.emitted[j]
        assert plain.logprobs[0] == spec.logprobs[j]
        assert plain.top_logprobs[0] == spec.top_logprobs[j]


def test_top_logprobs_without_logprobs():
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(6))
    result = verify(logits, _plan([_request(SamplingParams(temperature=0.0, top_logprobs=20))]),
                    Proposal.none(1)).per_request[0]
    assert len(result.logprobs) == 1 and len(result.top_logprobs[0]) == 20
    assert result.top_logprobs[0][result.emitted[0]] == result.logprobs[0]


# ---------------------------------------------------------------------------------- seeds

def _seeded_batch(seeds: list[int | None], gen_seed: int) -> list[tuple[int, ...]]:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(7)).repeat(len(seeds), 1)
    q = torch.softmax(torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(8)), -1)
    requests = [_request(SamplingParams(temperature=1.0, seed=s), output=(1, 2), rid=str(i))
                for i, s in enumerate(seeds)]
    proposal = Proposal(((2, 5, 1),) * len(seeds), (q,) * len(seeds))
    result = verify(logits, _plan(requests), proposal, torch.Generator().manual_seed(gen_seed))
    return [r.emitted for r in result.per_request]


def test_seeded_requests_reproduce_whatever_the_batch():
    seeds = list(range(40))
    alone = [_seeded_batch([s], 0)[0] for s in seeds]
    assert _seeded_batch(seeds, 1) == alone
    mixed = _seeded_batch([None, *reversed(seeds), None], 2)
    assert mixed[1:-1] == alone[::-1]
    assert len(set(alone)) > 5   # different seeds give different tokens


def test_seeded_plain_decoding_depends_on_position_not_step():
    logits = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0, seed=42)

    def emit(output: list[int]) -> tuple[int, ...]:
        return verify(logits, _plan([_request(params, output=output)]), Proposal.none(1)).per_request[0].emitted

    emitted = [emit([0] * n) for n in range(6)]
    assert emitted == [emit([9] * n) for n in range(6)]   # same positions, different history
    assert len(set(emitted)) > 1


# ---------------------------------------------------------------------------------- lossless

def _chi2_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells expecting fewer than 5 draws are pooled."""
    observed, probs = observed.flatten().double(), probs.flatten().double()
    expected = probs * observed.sum()
    if observed[expected == 0].sum() > 0:
        return 0.0
    big, small = expected >= 5, (expected > 0) & (expected < 5)
    o = torch.cat([observed[big], observed[small].sum()[None]])
    e = torch.cat([expected[big], expected[small].sum()[None]])
    o, e = o[e > 0], e[e > 0]
    if len(e) < 2:
        return 1.0
    stat = ((o - e) ** 2 / e).sum()
    return torch.special.gammaincc(torch.tensor((len(e) - 1) / 2, dtype=torch.float64), stat / 2).item()


def _problem(seed: int):
    """Target logits: row 0, row 1 as a function of the first token, row 2; and a drafter that
    disagrees with them (q0, and q1 as a function of the first draft)."""
    gen = torch.Generator().manual_seed(seed)
    t0, t1, t2 = (torch.randn(*shape, generator=gen) for shape in ((VOCAB,), (VOCAB, VOCAB), (VOCAB,)))
    q0, q1 = (torch.softmax(1.5 * torch.randn(*shape, generator=gen), -1) for shape in ((VOCAB,), (VOCAB, VOCAB)))
    return (t0, t1, t2), (q0, q1)


def _first_two_tokens(params, target, drafter, gen, seeded=False) -> torch.Tensor:   # -> [n, 2]
    """Emit the first two tokens of NUM_DRAWS requests: one verify step with two drafts, then a
    plain step for the requests whose first step stopped after one token."""
    t0, t1, t2 = target
    n = NUM_DRAWS
    if drafter is None:   # deterministic drafts: mostly the likely token, as n-gram drafts are
        d0 = torch.where(torch.arange(n) % 4 == 0, torch.arange(n) % VOCAB, t0.argmax())
        d1 = t1[d0].argmax(-1)
        draft_probs = (None,) * n
    else:
        q0, q1 = drafter
        d0 = torch.multinomial(q0, n, replacement=True, generator=gen)
        d1 = torch.multinomial(q1[d0], 1, generator=gen).squeeze(1)
        draft_probs = tuple(torch.stack([q0.expand(n, VOCAB), q1[d0]], dim=1).unbind(0))
    logits = torch.stack([t0.expand(n, VOCAB), t1[d0], t2.expand(n, VOCAB)], dim=1).reshape(3 * n, VOCAB)
    request_params = [dataclasses.replace(params, seed=i) for i in range(n)] if seeded else [params] * n
    requests = [_request(p, rid=str(i)) for i, p in enumerate(request_params)]
    proposal = Proposal(tuple(zip(d0.tolist(), d1.tolist())), draft_probs)
    first = verify(logits, _plan(requests), proposal, gen).per_request

    short = [i for i, r in enumerate(first) if len(r.emitted) == 1]
    for i in short:
        requests[i].output_token_ids.append(first[i].emitted[0])
    second = verify(t1[[first[i].emitted[0] for i in short]], _plan([requests[i] for i in short]),
                    Proposal.none(len(short)), gen).per_request
    tokens = [r.emitted[:2] for r in first]
    for i, r in zip(short, second):
        tokens[i] = (tokens[i][0], r.emitted[0])
    return torch.tensor(tokens)


def _fit(params, target, drafter, gen, seeded=False) -> float:
    """Smallest p-value of the first token's marginal and the joint of the first two tokens."""
    tokens = _first_two_tokens(params, target, drafter, gen, seeded)
    t0, t1, _ = target
    p0 = sampling.process(t0[None].double(), params)[0]
    p1 = sampling.process(t1.double(), params)        # [first token, second token]
    first = torch.bincount(tokens[:, 0], minlength=VOCAB)
    joint = torch.bincount(tokens[:, 0] * VOCAB + tokens[:, 1], minlength=VOCAB * VOCAB)
    return min(_chi2_pvalue(first, p0), _chi2_pvalue(joint, p0[:, None] * p1))


CONFIGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=4),
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
]


@pytest.mark.parametrize("params", CONFIGS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_sampling_is_lossless(params):
    target, drafter = _problem(10)
    assert _fit(params, target, drafter, torch.Generator().manual_seed(11)) > 1e-3


@pytest.mark.parametrize("params", CONFIGS[:3], ids=lambda p: f"T{p.temperature}-k{p.top_k}")
def test_deterministic_drafter_is_lossless(params):
    target, _ = _problem(12)
    assert _fit(params, target, None, torch.Generator().manual_seed(13)) > 1e-3


@pytest.mark.parametrize("params", CONFIGS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
@pytest.mark.parametrize("sampled_drafts", [True, False], ids=["sampled-drafts", "deterministic-drafts"])
def test_coupled_sampling_is_lossless(params, sampled_drafts):
    target, drafter = _problem(14)
    assert _fit(params, target, drafter if sampled_drafts else None, torch.Generator().manual_seed(15),
                seeded=True) > 1e-3


def test_the_statistic_catches_noise_shared_across_positions(monkeypatch):
    """Race times that ignore the position make a request's consecutive tokens depend on each other."""
    times = sampling.arrival_times
    monkeypatch.setattr(sampling, "arrival_times", lambda seed, position, vocab: times(seed, 0, vocab))
    target, drafter = _problem(14)
    assert _fit(CONFIGS[0], target, drafter, torch.Generator().manual_seed(15), seeded=True) < 1e-3


@pytest.mark.parametrize("params", [CONFIGS[0], CONFIGS[4]], ids=["T1.0", "T0.7-k5-p0.9"])
def test_coupled_verification_emits_what_plain_decoding_draws(params):
    """Whatever the drafts, a seeded request emits at each position the token plain decoding with that seed
    draws there (the race winner of that row's distribution)."""
    gen = torch.Generator().manual_seed(16)
    logits = torch.randn(5, 30, generator=gen, dtype=torch.float64)
    seeded = dataclasses.replace(params, seed=99)
    plain = []
    for j in range(5):
        row = verify(logits[j:j + 1], _plan([_request(seeded, output=(1,) * j)]), Proposal.none(1))
        plain.append(row.per_request[0].emitted[0])
    for drafts in (tuple(plain[:4]), tuple(plain[:2]) + (29,), (plain[0] + 1,), ()):
        q = torch.softmax(torch.randn(len(drafts), 30, generator=gen, dtype=torch.float64), -1) if drafts else None
        request = _request(seeded, output=(1,) * 0)
        out = verify(logits[:len(drafts) + 1], _plan([request]), Proposal((drafts,), (q,))).per_request[0]
        assert out.emitted == tuple(plain[:len(out.emitted)])


BROKEN = {
    "inverted-ratio": ("_accept", lambda u, p_x, q_x: u * p_x < q_x),
    "resample-from-p": ("_residual", lambda p, q: p),
}


@pytest.mark.parametrize("broken", BROKEN)
@pytest.mark.parametrize("params", [CONFIGS[0], CONFIGS[3]], ids=["T1.0", "T0.7-p0.8"])
def test_the_statistic_catches_a_broken_verifier(monkeypatch, broken, params):
    name, wrong = BROKEN[broken]
    monkeypatch.setattr(verify_module, name, wrong)
    target, drafter = _problem(10)
    assert _fit(params, target, drafter, torch.Generator().manual_seed(11)) < 1e-3


@pytest.mark.parametrize("broken", BROKEN)
def test_the_statistic_catches_a_broken_verifier_with_deterministic_drafts(monkeypatch, broken):
    name, wrong = BROKEN[broken]
    monkeypatch.setattr(verify_module, name, wrong)
    target, _ = _problem(12)
    assert _fit(CONFIGS[0], target, None, torch.Generator().manual_seed(13)) < 1e-3
