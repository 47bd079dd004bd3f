"""The server through the official openai client: chat, completions, streaming, logprobs, n > 1, seeds,
stop strings, usage.spec, /metrics; greedy output equals the offline LLM.generate output."""
import openai
import pytest

from specserve.engine import LLM
from specserve.server.app import stable_text
from specserve.types import RequestOutput, SamplingParams
from tests.e2e import KV_BYTES, ServerProcess, save_tiny_model

MODEL = "tiny-llama"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(tiny_folder, tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("logs") / "server.log", model=tiny_folder)
    yield srv
    assert srv.stop() == 0 and "Traceback" not in srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_folder):
    return LLM(model_path=str(tiny_folder), memory_bytes=int(KV_BYTES), num_threads=1)


def streamed(chunks) -> tuple[dict[int, str], dict[int, str], object]:
    """Concatenated text and finish reason per choice index, and the usage chunk."""
    texts, finishes, usage = {}, {}, None
    for chunk in chunks:
        usage = chunk.usage or usage
        for c in chunk.choices:
            delta = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (delta or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    return texts, finishes, usage


@pytest.mark.parametrize("text, finished, stops, stable", [
    ("ab\ufffd", False, (), "ab"),               # the start of a multi-byte character
    ("ab\ufffd", True, (), "ab\ufffd"),
    ("hello wo", False, ("world",), "hello "),    # may become the stop string
    ("hello wx", False, ("world",), "hello wx"),
    ("a\n", False, ("\n\n", "xyz"), "a"),
])
def test_stable_text_holds_back_what_may_change(text, finished, stops, stable):
    out = RequestOutput("r", None, [], text, [1], finished, "stop" if finished else None)
    assert stable_text(out, stops) == stable


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_chat_equals_offline_generate(client, offline):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=32)
    prompt = offline.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ref = offline.generate([offline.tokenizer.encode(prompt, add_special_tokens=False)],
                           SamplingParams(temperature=0, max_new_tokens=32))[0]
    choice = resp.choices[0]
    assert choice.message.content == ref.text and choice.finish_reason == ref.finish_reason
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_a_repeated_prompt_reports_cached_tokens(client):
    prompt = "A shared system prompt that is longer than one KV page of sixteen tokens. " * 2
    first = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=4)
    second = client.completions.create(model=MODEL, prompt=prompt + "And more.", temperature=0, max_tokens=4)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert second.usage.prompt_tokens_details.cached_tokens <= first.usage.prompt_tokens


def test_greedy_completion_and_logprobs_equal_offline_generate(client, offline):
    resp = client.completions.create(model=MODEL, prompt="The sea is", temperature=0, max_tokens=20, logprobs=2,
                                     extra_body={"ignore_eos": True})
    ref = offline.generate("The sea is", SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True,
                                                        logprobs=True, top_logprobs=2))[0]
    choice = resp.choices[0]
    assert choice.text == ref.text and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert len(choice.logprobs.tokens) == 20 == len(choice.logprobs.top_logprobs)


def test_streaming_chat_equals_non_streaming(client):
    kwargs = dict(model=MODEL, messages=CHAT, temperature=1.0, seed=7, max_tokens=48, n=2)
    full = client.chat.completions.create(**kwargs)
    texts, finishes, usage = streamed(client.chat.completions.create(**kwargs, stream=True,
                                                                     stream_options={"include_usage": True}))
    # random bytes from the tiny model: split multi-byte characters must never reach the stream
    assert texts == {c.index: c.message.content for c in full.choices}
    assert finishes == {c.index: c.finish_reason for c in full.choices}
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.model_extra["spec"]["verify_ct"] == full.usage.model_extra["spec"]["verify_ct"]


def test_streaming_completion_with_logprobs(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", temperature=0.8, seed=3, max_tokens=40, logprobs=3)
    full = client.completions.create(**kwargs).choices[0]
    text, logprobs, offsets = "", [], []
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            text += c.text
            logprobs += c.logprobs.token_logprobs
            offsets += c.logprobs.text_offset
    assert text == full.text
    assert logprobs == full.logprobs.token_logprobs and offsets == full.logprobs.text_offset
    assert all(1 <= len(top) <= 3 for top in full.logprobs.top_logprobs)   # keys are decoded tokens


def test_chat_top_logprobs_are_sorted_and_greedy_picks_the_first(client):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=16, logprobs=True,
                                          top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for token in content:
        tops = [t.logprob for t in token.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert token.logprob == pytest.approx(tops[0])


def test_seeded_sampling_is_reproducible_and_choices_differ(client):
    kwargs = dict(model=MODEL, messages=CHAT, temperature=1.0, top_p=0.95, seed=1234, n=3, max_tokens=24,
                  presence_penalty=0.5, frequency_penalty=0.2, extra_body={"top_k": 100, "min_p": 0.01})
    a, b = client.chat.completions.create(**kwargs), client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1       # choice i samples with seed + i


def test_stop_sequences_cut_the_text_in_both_modes(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", temperature=0.7, seed=5, max_tokens=60,
                  extra_body={"ignore_eos": True})
    text = client.completions.create(**kwargs).choices[0].text
    stop = next(text[i:i + 2] for i in range(8, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    expected = text[:text.index(stop)]
    resp = client.completions.create(**kwargs, stop=[stop, "never appears"])
    assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "stop"
    texts, finishes, _ = streamed(client.completions.create(**kwargs, stop=stop, stream=True))
    assert texts == {0: expected} and finishes == {0: "stop"}


def test_completion_prompt_batches_and_token_ids(client, offline):
    ids = offline.tokenizer.encode("hi")
    resp = client.completions.create(model=MODEL, prompt=["hi", ids], n=2, temperature=0, max_tokens=6)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert len({c.text for c in resp.choices}) == 1
    assert resp.usage.prompt_tokens == 2 * len(ids)


def test_usage_spec_and_metrics(client, server):
    resp = client.completions.create(model=MODEL, prompt="hi", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    spec = resp.usage.model_extra["spec"]
    assert spec["verify_ct"] == 8 and spec["accept_length"] == 1.0 and spec["num_proposed_drafts"] == 0
    m = server.wait_idle()
    assert m["specserve_time_to_first_token_seconds_count"] > 0
    assert m["specserve_time_per_output_token_seconds_count"] > 0
    assert m["specserve_prompt_tokens_total"] > 0 and m["specserve_generation_tokens_total"] >= 8
    assert m["specserve_spec_verify_calls_total"] == m["specserve_generation_tokens_total"]   # no speculation
    assert m['specserve_kv_pages_free{pool="target"}'] > 0


@pytest.mark.real_model
def test_real_model_greedy_chat_equals_offline(tmp_path):
    server = ServerProcess(tmp_path / "server.log", "--kv-cache-memory", "50000000")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Name three colors."}]
        model = client.models.list().data[0].id
        resp = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24)
        llm = LLM(memory_bytes=50_000_000)
        ref = llm.generate("Name three colors.", SamplingParams(temperature=0, max_new_tokens=24), chat=True)[0]
        assert resp.choices[0].message.content == ref.text
        assert resp.usage.completion_tokens == len(ref.token_ids)
    finally:
        assert server.stop() == 0


def test_seeded_requests_are_the_same_alone_under_load_and_as_choices(tiny_folder, tmp_path):
    """With speculation on, a seeded request returns the same text alone and while six others run beside it,
    and choice i of an n = 3 request is the n = 1 request with seed + i (coupled sampling)."""
    import concurrent.futures

    server = ServerProcess(tmp_path / "server.log", "--speculative-algorithm", "NGRAM", model=tiny_folder)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        seeded = dict(model=MODEL, messages=CHAT, temperature=0.8, max_tokens=48, seed=77)

        def ask(**kwargs) -> list[str]:
            return [c.message.content for c in client.chat.completions.create(**kwargs).choices]

        alone = ask(**seeded)
        with concurrent.futures.ThreadPoolExecutor(7) as pool:
            others = [pool.submit(ask, model=MODEL, temperature=1.0, max_tokens=40 + i,
                                  messages=[{"role": "user", "content": f"Story number {i}, please."}])
                      for i in range(6)]
            loaded = pool.submit(ask, **seeded).result()
            assert all(len(f.result()) == 1 for f in others)
        assert loaded == alone
        choices = ask(**{**seeded, "n": 3})
        assert choices == [ask(**{**seeded, "seed": 77 + i})[0] for i in range(3)]
    finally:
        assert server.stop() == 0 and "Traceback" not in server.log()
