"""Bad requests get an OpenAI-style error naming the field, with the right status, and the server stays
healthy; a full queue answers 503 + Retry-After; an engine failure fails its request with 500; SIGTERM
drains while still listening (503s) and exits 0."""
import json
import signal
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from specserve.config import engine_config
from specserve.engine import Engine
from specserve.server.app import MAX_BODY_BYTES, create_app
from tests.e2e import KV_BYTES, ServerProcess, save_tiny_model
from tests.spec_harness import assert_pages_released

KEY = "sk-test"
CONTEXT = 2048
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 4}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), max_positions=CONTEXT)


@pytest.fixture(scope="module")
def server(tiny_folder, tmp_path_factory):
    # one running and one queued request at most, so that a third is turned away
    srv = ServerProcess(tmp_path_factory.mktemp("logs") / "server.log", "--api-key", KEY,
                        "--max-running-requests", "1", "--max-queued-requests", "1", model=tiny_folder)
    yield srv
    assert srv.stop() == 0 and "Traceback" not in srv.log()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as client:
        yield client


def with_(base: dict, **changes) -> dict:
    return {**{k: v for k, v in base.items() if k not in changes}, **{k: v for k, v in changes.items() if v != ...}}


BAD = [
    # (path, body, status, param, words in the message); `...` removes a field
    ("/v1/chat/completions", b'{"messages": [', 400, None, "not valid JSON"),
    ("/v1/chat/completions", with_(CHAT, messages=...), 422, "messages", "Field required"),
    ("/v1/chat/completions", with_(CHAT, messages=[]), 422, "messages", "at least 1 item"),
    ("/v1/chat/completions", with_(CHAT, messages="hi"), 422, "messages", "valid array"),
    ("/v1/chat/completions", with_(CHAT, messages=[{"role": "user", "content": 5}]), 422, "messages.0.content",
     "string"),
    ("/v1/chat/completions", with_(CHAT, messages=[{"role": "robot", "content": "x"}]), 422, "messages.0.role",
     "user"),
    ("/v1/completions", with_(COMPLETION, prompt=...), 422, "prompt", "Field required"),
    ("/v1/completions", with_(COMPLETION, prompt=""), 422, "prompt", "empty"),
    ("/v1/completions", with_(COMPLETION, prompt=[]), 422, "prompt", "must be"),
    ("/v1/completions", with_(COMPLETION, prompt=[1, 100000]), 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", with_(COMPLETION, max_tokens="4"), 422, "max_tokens", "valid integer"),
    ("/v1/completions", with_(COMPLETION, temperature="hot"), 422, "temperature", "valid number"),
    ("/v1/completions", with_(COMPLETION, stream="yes"), 422, "stream", "valid boolean"),
    ("/v1/completions", with_(COMPLETION, max_tokens=0), 422, "max_tokens", "greater than or equal to 1"),
    ("/v1/completions", with_(COMPLETION, max_tokens=-5), 422, "max_tokens", "greater than or equal to 1"),
    ("/v1/completions", with_(COMPLETION, max_tokens=CONTEXT), 400, "max_tokens", "context"),
    ("/v1/chat/completions", with_(CHAT, max_completion_tokens=CONTEXT), 400, "max_completion_tokens", "context"),
    ("/v1/completions", with_(COMPLETION, temperature=-0.1), 422, "temperature", "greater than or equal to 0"),
    ("/v1/completions", with_(COMPLETION, temperature=2.1), 422, "temperature", "less than or equal to 2"),
    ("/v1/completions", with_(COMPLETION, top_p=0), 422, "top_p", "greater than 0"),
    ("/v1/completions", with_(COMPLETION, top_p=1.5), 422, "top_p", "less than or equal to 1"),
    ("/v1/chat/completions", with_(CHAT, logprobs=True, top_logprobs=21), 422, "top_logprobs", "20"),
    ("/v1/completions", with_(COMPLETION, logprobs=21), 422, "logprobs", "20"),
    ("/v1/completions", with_(COMPLETION, n=17), 422, "n", "16"),
    ("/v1/completions", with_(COMPLETION, stop=[""]), 422, "stop", "non-empty"),
    ("/v1/completions", with_(COMPLETION, model="gpt-4"), 404, "model", "does not exist"),
    ("/v1/chat/completions", with_(CHAT, model="gpt-4"), 404, "model", "does not exist"),
    ("/v1/completions", with_(COMPLETION, prompt="a" * CONTEXT), 400, "prompt", "context"),
    ("/v1/chat/completions", with_(CHAT, messages=[{"role": "user", "content": "a" * CONTEXT}]), 400, "messages",
     "context"),
    ("/v1/completions", with_(COMPLETION, prompt="a" * MAX_BODY_BYTES), 413, None, "larger than"),
    ("/v1/embeddings", COMPLETION, 404, None, "Not Found"),
]


@pytest.mark.parametrize("path, body, status, param, words", BAD, ids=[f"{b[2]}-{b[3]}-{b[4]}" for b in BAD])
def test_bad_request_gets_an_openai_error(http, path, body, status, param, words):
    resp = http.post(path, content=body if isinstance(body, bytes) else json.dumps(body))
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert words in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"
    if param:
        assert error["message"].startswith(f"{param}:")
    assert http.get("/health").status_code == 200


def test_api_key_is_required(server, http):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        resp = httpx.post(f"{server.url}/v1/completions", json=COMPLETION, headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200       # probes and metrics need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_openai_client_raises_the_matching_errors(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.UnprocessableEntityError, match="temperature"):
        client.completions.create(model="tiny-llama", prompt="hi", temperature=3)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny-llama", prompt="hi", max_tokens=10 * CONTEXT)


def test_full_queue_answers_503_with_retry_after(server, http):
    long = with_(COMPLETION, max_tokens=1500, stream=True, ignore_eos=True)
    with http.stream("POST", "/v1/completions", json=long) as running, \
            http.stream("POST", "/v1/completions", json=long) as queued:
        assert running.status_code == queued.status_code == 200
        resp = http.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
        assert "retry later" in resp.json()["error"]["message"]
    # both streams were closed mid-way: their requests are aborted and the server admits again
    server.wait_idle()
    deadline = time.monotonic() + 10
    while (resp := http.post("/v1/completions", json=COMPLETION)).status_code == 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert resp.status_code == 200


def test_engine_failure_fails_its_request_not_the_server(tiny_folder):
    engine = Engine(engine_config(str(tiny_folder), memory_bytes=int(KV_BYTES), num_threads=1))
    forward, faults = engine.runner.forward, []

    def faulty_forward(*args):
        if faults:
            raise RuntimeError(faults.pop())
        return forward(*args)

    engine.runner.forward = faulty_forward
    with TestClient(create_app(engine, served_model_name="tiny-llama")) as client:
        faults.append("injected fault")
        resp = client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 500 and "injected fault" in resp.json()["error"]["message"]

        faults.append("injected mid-stream fault")
        events = client.post("/v1/chat/completions", json=with_(CHAT, stream=True)).text.split("\n\n")
        assert "injected mid-stream fault" in json.loads(events[-3].removeprefix("data: "))["error"]["message"]
        assert events[-2] == "data: [DONE]"

        assert client.get("/health").status_code == 200
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    assert_pages_released(engine)


def test_sigterm_drains_while_listening_and_exits_0(tiny_folder, tmp_path):
    """During the drain the socket stays open: /health and new requests answer 503 (with Retry-After), the
    in-flight stream ends properly, then the server exits 0."""
    server = ServerProcess(tmp_path / "server.log", "--shutdown-timeout", "3", model=tiny_folder)
    body = with_(COMPLETION, max_tokens=CONTEXT - 8, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        health = httpx.get(f"{server.url}/health", timeout=5)
        turned_away = httpx.post(f"{server.url}/v1/completions", json=COMPLETION, timeout=5)
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data:")]
    assert health.status_code == 503
    assert turned_away.status_code == 503 and "shutting down" in turned_away.json()["error"]["message"]
    assert int(turned_away.headers["Retry-After"]) > 0
    # the in-flight stream ends properly: finished, or aborted once the grace period is over
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("length", "abort")
    assert server.proc.wait(30) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=2)
    assert "Traceback" not in server.log() and "ERROR" not in server.log()
