"""Continuous batching, chunked prefill, preemption and stop handling on a tiny float64 model."""
import random

import pytest
import torch

from specserve.engine import LLM, Engine
from specserve.train.features import TargetPass
from specserve.types import SamplingParams
from tests.spec_harness import assert_pages_released

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


def make_llm(ckpt, **kw) -> LLM:
    kw = {"dtype": "float64", "page_size": 4, "num_pages": 256, **kw}
    return LLM(checkpoint=ckpt, **kw)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def run_alone(ckpt, prompt, params=GREEDY):
    return make_llm(ckpt).generate([prompt], params)[0]


def drive_with_arrivals(engine: Engine, reqs: list[list[int]], params: list[SamplingParams], seed: int = 0):
    """Add requests a few at a time between steps; return finished outputs by request id."""
    rng = random.Random(seed)
    pending = list(enumerate(reqs))
    finals = {}
    while pending or engine.has_unfinished:
        for _ in range(rng.randrange(0, 4)):
            if pending:
                i, p = pending.pop(0)
                engine.add_request(p, params[i], request_id=str(i))
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_twenty_mixed_requests_with_arrivals_match_each_run_alone(tiny_llama):
    reqs = prompts(20)
    params = [SamplingParams(temperature=0.0, max_new_tokens=random.Random(i).randrange(1, 20), ignore_eos=True)
              for i in range(20)]
    llm = make_llm(tiny_llama, max_num_batched_tokens=48, max_running_requests=8)
    finals = drive_with_arrivals(llm.engine, reqs, params)
    for i, p in enumerate(reqs):
        alone = run_alone(tiny_llama, p, params[i])
        assert finals[str(i)].token_ids == alone.token_ids, f"request {i} differs when batched"
        assert len(alone.token_ids) == params[i].max_new_tokens
    assert_pages_released(llm.engine)


def test_preemption_under_page_pressure_recomputes_without_corruption(tiny_llama):
    reqs = prompts(10, seed=3)
    params = [SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)] * 10
    llm = make_llm(tiny_llama, num_pages=24, max_num_batched_tokens=64)
    outs = llm.generate(reqs, params)
    assert sum(o.num_preemptions for o in outs) > 0, "the pool was meant to be too small"
    for p, out in zip(reqs, outs):
        assert out.token_ids == run_alone(tiny_llama, p, params[0]).token_ids
    assert_pages_released(llm.engine)


def test_seeded_sampling_is_reproducible_regardless_of_batch(tiny_llama):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_new_tokens=15, ignore_eos=True)
    reqs = prompts(6, seed=5)
    batched = make_llm(tiny_llama).generate(reqs, params)
    alone = run_alone(tiny_llama, reqs[2], params)
    assert batched[2].token_ids == alone.token_ids
    other = run_alone(tiny_llama, reqs[2], SamplingParams(temperature=0.8, top_p=0.9, seed=99, max_new_tokens=15,
                                                        ignore_eos=True))
    assert other.token_ids != alone.token_ids


def test_logprobs_are_the_models_log_softmax(tiny_llama):
    params = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True, logprobs=True, top_logprobs=3)
    out = make_llm(tiny_llama).generate([[5, 6, 7]], params)[0]
    assert len(out.logprobs) == 5 and len(out.top_logprobs) == 5
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert max(top.values()) == pytest.approx(lp)       # greedy: the chosen token is the top one
        assert top[tok] == pytest.approx(lp) and len(top) == 3 and lp <= 0


def test_prompt_logprobs_are_the_models_log_softmax_over_the_prompt(tiny_llama):
    """Computed across prefill chunks, never from the prefix cache (the second identical request recomputes),
    the first token without one; the reference is the training side's own pass over the prompt."""
    prompt = prompts(1, seed=11)[0] + prompts(1, seed=12)[0] + [7] * 9
    params = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True, prompt_logprobs=True, top_logprobs=2)
    llm = make_llm(tiny_llama, max_num_batched_tokens=8)
    first, again = llm.generate([prompt], params)[0], llm.generate([prompt], params)[0]
    reference = TargetPass(tiny_llama, (0,), 257, "none", torch.float64)([prompt])
    probs = torch.zeros(len(prompt), 257, dtype=torch.float64)
    probs.scatter_(1, reference.top_ids[0], reference.top_probs[0].double())
    want = [probs[j - 1, prompt[j]].log().item() for j in range(1, len(prompt))]
    for out in (first, again):
        assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
        assert out.prompt_logprobs[1:] == pytest.approx(want, abs=1e-6)
        assert all(len(top) == 2 and max(top.values()) >= lp for top, lp in zip(out.prompt_top_logprobs[1:],
                                                                                out.prompt_logprobs[1:]))
    assert again.num_cached_tokens == 0 and first.token_ids == again.token_ids
    plain = make_llm(tiny_llama).generate([prompt], GREEDY)[0]
    assert plain.prompt_logprobs is None and plain.token_ids[:3] == first.token_ids


def test_top_logprobs_without_logprobs_flag(tiny_llama):
    params = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True, top_logprobs=2)
    out = make_llm(tiny_llama).generate([[5, 6, 7]], params)[0]
    assert len(out.top_logprobs) == 3 and all(len(t) == 2 for t in out.top_logprobs)


def test_stop_token_and_max_tokens_and_eos(tiny_llama):
    llm = make_llm(tiny_llama)
    free_run = llm.generate([[1, 2, 3]], GREEDY)[0]
    stop_tok = free_run.token_ids[4]
    first = free_run.token_ids.index(stop_tok)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True,
                                                    stop_token_ids=(stop_tok,)))[0]
    assert out.token_ids == free_run.token_ids[:first + 1] and out.finish_reason == "stop"
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 12


def test_stop_string_cuts_text_and_generation(tiny_llama):
    llm = make_llm(tiny_llama)
    free_run = llm.generate([[1, 2, 3]], GREEDY)[0]
    stop = free_run.text[3:5]
    assert stop
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True,
                                                    stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.text == free_run.text[:free_run.text.find(stop)]
    assert free_run.token_ids[:len(out.token_ids)] == out.token_ids


def test_abort_frees_pages(tiny_llama):
    llm = make_llm(tiny_llama)
    engine = llm.engine
    rid = engine.add_request([1, 2, 3, 4, 5], GREEDY)
    engine.step()
    assert engine.allocator.num_free < engine.allocator.num_pages
    out = engine.abort(rid)
    assert out.finish_reason == "abort"
    assert_pages_released(engine)
    assert not engine.has_unfinished


def test_chat_prompt_uses_template(tiny_llama):
    engine = make_llm(tiny_llama).engine
    ids = engine.encode("hi", chat=True)
    assert engine.tokenizer.decode(ids) == "<|user|>hi\n<|assistant|>"


@pytest.mark.parametrize("bad, message", [
    ("", "prompt is empty"),
    ([], "prompt is empty"),
    ([1] * 600, "longer than the context"),
    ([100000], "outside the vocabulary"),
])
def test_bad_prompts_raise_clear_errors(tiny_llama, bad, message):
    llm = make_llm(tiny_llama)
    with pytest.raises(ValueError, match=message):
        llm.generate([bad] if isinstance(bad, list) else bad, GREEDY)
    assert not llm.engine.has_unfinished


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_logprobs": 21}, "top_logprobs"),
])
def test_bad_sampling_params_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_coupled_sampling_gives_unseeded_sampled_requests_a_seed(tiny_llama):
    sampled, greedy = SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)
    coupled = LLM(checkpoint=tiny_llama, num_pages=16, page_size=4).engine
    rejection = LLM(checkpoint=tiny_llama, num_pages=16, page_size=4, speculative_sampling="rejection").engine
    seeds = {}
    for name, engine in (("coupled", coupled), ("rejection", rejection)):
        ids = [engine.add_request([1, 2, 3], p) for p in (sampled, sampled, greedy)]
        seeds[name] = [engine.requests[i].params.seed for i in ids]
    assert all(isinstance(s, int) for s in seeds["coupled"][:2]) and seeds["coupled"][0] != seeds["coupled"][1]
    assert seeds["coupled"][2] is None and seeds["rejection"] == [None, None, None]
    with pytest.raises(ValueError, match="--speculative-sampling must be coupled or rejection, got 'greedy'"):
        LLM(checkpoint=tiny_llama, num_pages=16, page_size=4, speculative_sampling="greedy")


def test_an_engine_is_one_data_parallel_replica(tiny_llama):
    with pytest.raises(ValueError, match="--dp-size 2: an engine is one replica; `specserve serve` runs replicas"):
        LLM(checkpoint=tiny_llama, num_pages=8, dp_size=2)
