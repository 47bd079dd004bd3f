"""Load on an NGRAM server: 32 concurrent streaming clients × 4 requests with mixed parameters finish
without errors and leave every KV page free; a client that goes away aborts its request; a short request is
not stuck behind a long prefill (the embedded model)."""
import asyncio
import random
import time

import httpx
import openai
import pytest

from tests.e2e import ServerProcess, save_tiny_model

MODEL = "tiny-llama"
CONTEXT = 2048
CLIENTS, REQUESTS_PER_CLIENT = 32, 4
PROMPTS = ["Once upon a time", "abc abc abc abc", "The sea is", "1, 2, 3, 4, 5,", "Tell me a story about a cat."]
ABORTED = 'specserve_requests_finished_total{finish_reason="abort"}'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny"), max_positions=CONTEXT)
    srv = ServerProcess(tmp_path_factory.mktemp("logs") / "server.log", "--speculative-algorithm", "NGRAM",
                        model=folder)
    yield srv
    assert srv.stop() == 0 and "Traceback" not in srv.log()


def mixed_request(rng: random.Random) -> tuple[str, dict]:
    kwargs = dict(model=MODEL, stream=True, stream_options={"include_usage": True},
                  max_tokens=rng.choice([4, 16, 32, 64]), temperature=rng.choice([0.0, 0.7, 1.0]),
                  top_p=rng.choice([1.0, 0.9]), n=rng.choice([1, 1, 2]), seed=rng.choice([None, rng.randrange(1000)]),
                  stop=rng.choice([None, ["\n"], "ab"]), presence_penalty=rng.choice([0.0, 0.5]),
                  extra_body={"ignore_eos": rng.random() < 0.5, "top_k": rng.choice([0, 40])})
    prompt = rng.choice(PROMPTS)
    if rng.random() < 0.5:
        return "chat", {**kwargs, "messages": [{"role": "user", "content": prompt}],
                        **({"logprobs": True, "top_logprobs": 2} if rng.random() < 0.3 else {})}
    return "completion", {**kwargs, "prompt": prompt, **({"logprobs": 1} if rng.random() < 0.3 else {})}


async def run_client(client: openai.AsyncOpenAI, client_id: int) -> list[tuple[int, dict, object]]:
    rng = random.Random(client_id)
    results = []
    for _ in range(REQUESTS_PER_CLIENT):
        kind, kwargs = mixed_request(rng)
        api = client.chat.completions if kind == "chat" else client.completions
        finishes, usage = {}, None
        async for chunk in await api.create(**kwargs):
            usage = chunk.usage or usage
            finishes.update({c.index: c.finish_reason for c in chunk.choices if c.finish_reason})
        results.append((kwargs["n"], finishes, usage))
    return results


async def run_load(url: str) -> list:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        return await asyncio.gather(*(run_client(client, c) for c in range(CLIENTS)), return_exceptions=True)


def test_concurrent_streaming_clients(server):
    outcomes = asyncio.run(run_load(server.url))
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert not errors, errors[:3]
    results = [r for client_results in outcomes for r in client_results]
    assert len(results) == CLIENTS * REQUESTS_PER_CLIENT
    for n, finishes, usage in results:
        assert sorted(finishes) == list(range(n)) and set(finishes.values()) <= {"stop", "length"}
        assert usage is not None and usage.completion_tokens >= n

    m = server.wait_idle()
    assert m['specserve_kv_pages_free{pool="target"}'] > 0
    assert m.get(ABORTED, 0) == 0
    assert m["specserve_spec_proposed_drafts_total"] > 0 and m["specserve_spec_accepted_drafts_total"] > 0
    assert m['specserve_spec_accepted_position_total{position="1"}'] > 0
    assert m["specserve_spec_accept_length"] > 1.0


def wait_aborted(server: ServerProcess, count: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while server.metrics().get(ABORTED, 0) < count:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.1)


def test_disconnect_mid_stream_aborts_and_frees_pages(server):
    aborted = server.metrics().get(ABORTED, 0)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=CONTEXT - 8, stream=True,
                                       extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream):
        pass
    stream.close()
    wait_aborted(server, aborted + 1)
    assert server.wait_idle()[ABORTED] == aborted + 1


def test_disconnect_while_waiting_for_a_whole_response_aborts_it(server):
    aborted = server.metrics().get(ABORTED, 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", timeout=httpx.Timeout(30, read=0.5),
                   json={"prompt": "hi", "max_tokens": CONTEXT - 8, "ignore_eos": True})
    wait_aborted(server, aborted + 1)
    assert server.wait_idle()[ABORTED] == aborted + 1


@pytest.mark.real_model
def test_a_short_request_is_not_stuck_behind_a_long_prefill(tmp_path):
    """The embedded model prefills a ~3,000-token prompt in 256-token steps; a short chat request sent meanwhile
    gets its first token long before the long prompt does (its prefill is capped while others wait)."""
    server = ServerProcess(tmp_path / "server.log", "--kv-cache-memory", "400000000", "--max-num-batched-tokens",
                           "256")
    try:
        long_prompt = "The history of the city is long and full of surprises. " * 250

        async def first_token_s(client: openai.AsyncOpenAI, content: str, delay: float) -> float:
            await asyncio.sleep(delay)
            start = time.perf_counter()
            stream = await client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": content}], max_tokens=4,
                temperature=0, stream=True)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    return time.perf_counter() - start
            return time.perf_counter() - start

        async def both() -> tuple[float, float]:
            async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                          timeout=120) as client:
                return tuple(await asyncio.gather(first_token_s(client, long_prompt, 0.0),
                                                  first_token_s(client, "Say hi.", 0.5)))

        long_ttft, short_ttft = asyncio.run(both())
        assert short_ttft < 3.0 and short_ttft + 0.5 < long_ttft, (short_ttft, long_ttft)
    finally:
        server.stop()
