import math

import pytest
import torch

from specserve import sampling
from specserve.types import SamplingParams

DTYPES = [torch.float32, torch.float64]


def _logits_of(probs: list[float], dtype: torch.dtype) -> torch.Tensor:   # -> [1, vocab]
    return torch.tensor([probs], dtype=torch.float64).log().to(dtype)


def _check(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual[0].double(), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_temperature_only(dtype):
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]], dtype=dtype)
    probs = sampling.process(logits, SamplingParams(temperature=0.5))
    e = [math.exp(x / 0.5) for x in (1.0, 2.0, 0.5, -1.0)]
    _check(probs, [x / sum(e) for x in e])
    assert probs.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_top_k(dtype):
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5, 2.5]], dtype=dtype)
    probs = sampling.process(logits, SamplingParams(top_k=2))
    a, b = math.exp(3.0), math.exp(2.5)
    _check(probs, [0.0, a / (a + b), 0.0, 0.0, b / (a + b)])
    for off in (0, -1, 5, 9):   # off, or at least the vocab: no filtering
        _check(sampling.process(logits, SamplingParams(top_k=off)), logits[0].double().softmax(-1).tolist())


@pytest.mark.parametrize("dtype", DTYPES)
def test_top_p(dtype):
    logits = _logits_of([0.5, 0.05, 0.3, 0.15], dtype)
    # Smallest set of most likely tokens holding at least top_p of the mass.
    _check(sampling.process(logits, SamplingParams(top_p=0.75)), [0.5 / 0.8, 0.0, 0.3 / 0.8, 0.0])
    _check(sampling.process(logits, SamplingParams(top_p=0.85)), [0.5 / 0.95, 0.0, 0.3 / 0.95, 0.15 / 0.95])
    _check(sampling.process(logits, SamplingParams(top_p=0.1)), [1.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_min_p(dtype):
    logits = _logits_of([0.5, 0.05, 0.3, 0.15], dtype)
    _check(sampling.process(logits, SamplingParams(min_p=0.2)), [0.5 / 0.95, 0.0, 0.3 / 0.95, 0.15 / 0.95])


@pytest.mark.parametrize("dtype", DTYPES)
def test_filter_order_is_top_k_top_p_min_p(dtype):
    logits = _logits_of([0.4, 0.3, 0.2, 0.1], dtype)
    # top-p sees the top-k survivors renormalised: 4/7 >= 0.5 alone (0.4 < 0.5 would keep two).
    _check(sampling.process(logits, SamplingParams(top_k=2, top_p=0.5)), [1.0, 0.0, 0.0, 0.0])
    # min-p after top-p: top-p keeps {0, 1}; 3/7 >= 0.6 * 4/7, so both stay (min-p first would
    # keep {0, 1} and then top-p 0.5 would keep only 0).
    _check(sampling.process(logits, SamplingParams(top_p=0.5, min_p=0.6)), [4 / 7, 3 / 7, 0.0, 0.0])
    # Temperature comes first: at T=0.5 the probs are squared before top-p.
    sq = [x * x for x in (0.4, 0.3, 0.2, 0.1)]
    _check(sampling.process(logits, SamplingParams(temperature=0.5, top_p=0.6)),
           [sq[0] / (sq[0] + sq[1]), sq[1] / (sq[0] + sq[1]), 0.0, 0.0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_is_one_hot_lowest_id_on_ties(dtype):
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, 3.0, 3.0, 3.0]], dtype=dtype)
    assert sampling.greedy_tokens(logits).tolist() == [1, 0]
    probs = sampling.process(logits, SamplingParams(temperature=0.0))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def _reference_penalties(row, params, prompt, history):
    out = []
    for v, x in enumerate(row):
        if v in prompt or v in history:
            x = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
        count = history.count(v)
        out.append(x - params.frequency_penalty * count - params.presence_penalty * (count > 0))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_penalties_per_row_see_earlier_drafts(dtype):
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25)
    prompt, output, drafts = [1, 2], [2, 3, 3], [4, 3, 5]
    logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(0), dtype=dtype)
    got = sampling.apply_penalties(logits, params, prompt, output, drafts)
    for k in range(4):
        expected = _reference_penalties(logits[k].tolist(), params, prompt, output + drafts[:k])
        torch.testing.assert_close(got[k], torch.tensor(expected, dtype=dtype))
    assert got.dtype == dtype


def test_penalty_semantics_by_hand():
    logits = torch.tensor([[2.0, -1.0, 2.0, 2.0, 2.0]])
    rep = sampling.apply_penalties(logits, SamplingParams(repetition_penalty=2.0), [0], [1])
    assert rep.tolist() == [[1.0, -2.0, 2.0, 2.0, 2.0]]   # prompt and output, sign-aware
    # frequency / presence count output tokens only, never the prompt.
    fp = sampling.apply_penalties(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
                                  [4], [2, 2, 3])
    assert fp.tolist() == [[2.0, -1.0, 2.0 - 1.0 - 0.25, 2.0 - 0.5 - 0.25, 2.0]]
    assert sampling.apply_penalties(logits, SamplingParams(), [0], [1]) is logits


def test_arrival_times_depend_on_seed_and_position_only():
    times = sampling.arrival_times(7, 10, 1000)
    assert times.shape == (1000,) and (times >= 0).all()
    assert torch.equal(sampling.arrival_times(7, 10, 1000), times)
    assert not torch.equal(sampling.arrival_times(7, 11, 1000), times)
    assert not torch.equal(sampling.arrival_times(8, 10, 1000), times)
    assert torch.equal(sampling.arrival_times(7, 10, 500), times[:500])   # token v's time, whatever the vocabulary


def test_arrival_times_are_exponential():
    times = torch.cat([sampling.arrival_times(3, p, 1000) for p in range(20)])
    assert abs(times.mean().item() - 1.0) < 0.02 and abs(times.var().item() - 1.0) < 0.05
    assert abs((times > 1.0).double().mean().item() - math.exp(-1)) < 0.01


def test_the_race_winner_is_a_sample_of_the_distribution():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    wins = torch.bincount(torch.tensor([sampling.race_winner(probs, 11, p) for p in range(20000)]), minlength=5)
    assert wins[1] == 0
    assert ((wins / 20000 - probs).abs() < 0.012).all()
    assert sampling.race_winner(probs * 7, 11, 3) == sampling.race_winner(probs, 11, 3)   # scale-free


def test_a_seeded_draft_is_the_race_winner_and_an_unseeded_one_follows_the_generator():
    q = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(0)), -1)
    assert sampling.draw_draft(q, 5, 9) == sampling.race_winner(q, 5, 9)
    a = [sampling.draw_draft(q, None, 9, torch.Generator().manual_seed(2)) for _ in range(2)]
    assert a[0] == a[1]
    u = sampling.uniforms(3, torch.Generator().manual_seed(5))
    assert torch.equal(u, sampling.uniforms(3, torch.Generator().manual_seed(5))) and len(set(u.tolist())) == 3


@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_inverse_cdf(dtype):
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 4, dtype=dtype)
    u = torch.tensor([0.0, 0.2499, 0.25, 1.0 - 2.0**-53], dtype=torch.float64)
    assert sampling.sample(probs, u).tolist() == [1, 1, 3, 3]
    # Unnormalised rows are scaled by their total.
    assert sampling.sample(probs * 3, u).tolist() == [1, 1, 3, 3]


@pytest.mark.parametrize("dtype", DTYPES)
def test_logprobs_are_raw_log_softmax(dtype):
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(2), dtype=dtype)
    tokens = torch.tensor([0, 7, 49, 3, 3])
    chosen, top = sampling.logprobs(logits, tokens, num_top=6)
    reference = torch.log_softmax(logits.double(), dim=-1)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for k in range(5):
        assert chosen[k] == pytest.approx(reference[k, tokens[k]].item(), abs=tol)
        assert len(top[k]) == 6
        values = list(top[k].values())
        assert values == sorted(values, reverse=True)
        best = reference[k].topk(6)
        assert list(top[k]) == best.indices.tolist()
        assert values == pytest.approx(best.values.tolist(), abs=tol)
    chosen0, top0 = sampling.logprobs(logits, tokens)
    assert chosen0 == chosen and top0 == [{}] * 5


def test_logit_bias_is_added_before_the_penalties():
    logits = torch.tensor([[1.0, 2.0, 3.0, -1.0]])
    params = SamplingParams(logit_bias={0: 5.0, 3: -100.0})
    assert params.logit_bias == ((0, 5.0), (3, -100.0)) and params.has_penalties
    assert sampling.apply_penalties(logits, params, [], []).tolist() == [[6.0, 2.0, 3.0, -101.0]]
    both = SamplingParams(logit_bias={1: 1.0}, repetition_penalty=2.0)
    assert sampling.apply_penalties(logits, both, [1], []).tolist() == [[1.0, 1.5, 3.0, -1.0]]
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={2: 101.0})
