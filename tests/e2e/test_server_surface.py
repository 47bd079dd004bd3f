"""What a client sees of the API surface beyond generation, through the app in-process: model ids and
routes, auth headers, /tokenize /detokenize /version, gauges from startup, and every parameter either
honoured (logit_bias, echo with prompt logprobs, best_of = n, user, response_format text / json_object /
json_schema, regex, ebnf) or refused by name."""
from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient

from specserve.config import engine_config
from specserve.engine import Engine
from specserve.server.app import create_app
from tests.e2e import KV_BYTES, save_tiny_model

KEY = "sk-surface"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine(tiny_folder):
    return Engine(engine_config(str(tiny_folder), memory_bytes=int(KV_BYTES), num_threads=1))


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, api_key=KEY), headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def model_id(client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


def completion(client, **body) -> dict:
    resp = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_the_model_id_is_the_served_name_or_the_path_as_given(engine, tiny_folder, client):
    assert model_id(client) == str(tiny_folder)
    with TestClient(create_app(engine, served_model_name="my-model")) as named:
        assert model_id(named) == "my-model"
        assert named.get("/v1/models/my-model").json()["id"] == "my-model"
        resp = named.get("/v1/models/other")
        assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"


def test_get_routes_answer_head_and_401_says_how_to_authenticate(client):
    for path in ("/health", "/metrics", "/version", "/v1/models"):
        assert client.head(path).status_code == 200, path
    resp = client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert resp.status_code == 401 and resp.headers["WWW-Authenticate"] == "Bearer"


def test_kv_gauges_exist_before_the_first_request(engine):
    with TestClient(create_app(engine)) as fresh:
        text = fresh.get("/metrics").text
    assert 'specserve_kv_pages_free{pool="target"}' in text and "specserve_num_requests_running 0.0" in text


def test_tokenize_detokenize_and_version(client, engine):
    ids = client.post("/tokenize", json={"prompt": "hello world"}).json()
    assert ids["tokens"] == engine.tokenizer.encode("hello world") and ids["count"] == len(ids["tokens"])
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == engine.encode("hi", chat=True)
    assert client.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"] == "hello world"
    bad = client.post("/detokenize", json={"tokens": [10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = client.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    assert both.status_code == 422 and "exactly one of prompt and messages" in both.json()["error"]["message"]
    assert client.get("/version").json()["version"]


def test_logit_bias_is_honoured_and_checked(client, engine):
    token = engine.tokenizer.encode("z")[0]
    biased = completion(client, logit_bias={str(token): 100})
    assert biased["choices"][0]["text"] == "z" * 6
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
        "logit_bias": {str(token): 100}}).json()
    assert chat["choices"][0]["message"]["content"] == "z" * 4
    assert completion(client)["choices"][0]["text"] != "z" * 6
    for bias, status, words in [({"999999": 5}, 400, "outside the vocabulary"), ({"5": 101}, 422, "[-100, 100]"),
                                ({"x": 1}, 422, "token ids")]:
        resp = client.post("/v1/completions", json={"prompt": "hi", "logit_bias": bias})
        assert resp.status_code == status and resp.json()["error"]["param"] == "logit_bias"
        assert words in resp.json()["error"]["message"]


def test_echo_puts_the_prompt_before_the_completion(client):
    plain = completion(client)["choices"][0]["text"]
    assert completion(client, echo=True)["choices"][0]["text"] == "hello" + plain
    streamed = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "temperature": 0,
                                                    "echo": True, "stream": True}).text
    assert '"text":"hello' in streamed.replace(" ", "")


def test_echo_with_logprobs_scores_the_prompt_tokens_too(client, engine):
    prompt = engine.tokenizer.encode("hello there")
    body = {"prompt": "hello there", "max_tokens": 3, "temperature": 0, "logprobs": 2}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    echoed = client.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]["logprobs"]
    n = len(prompt)
    assert echoed["tokens"][:n] == [engine.tokenizer.decode([t]) for t in prompt]
    assert echoed["token_logprobs"][0] is None and echoed["top_logprobs"][0] is None
    assert all(lp <= 0 for lp in echoed["token_logprobs"][1:n]) and len(echoed["top_logprobs"][1]) == 2
    # the completion's own entries follow unchanged, their offsets after the prompt's tokens
    assert echoed["tokens"][n:] == plain["tokens"] and echoed["token_logprobs"][n:] == plain["token_logprobs"]
    assert echoed["text_offset"][n] == sum(len(t) for t in echoed["tokens"][:n])
    # the alternatives at prompt token 2 are those the model gives after the first two tokens
    step = client.post("/v1/completions", json={"prompt": prompt[:2], "max_tokens": 1, "temperature": 0,
                                                "logprobs": 2}).json()["choices"][0]["logprobs"]["top_logprobs"][0]
    assert echoed["top_logprobs"][2] == pytest.approx(step, abs=1e-4)


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of", "best_of must equal n"),
    ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix", "refused rather than ignored"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema"}}, "response_format",
     "json_schema is required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "regex": "a+",
                              "response_format": {"type": "json_object"}}, "regex",
     "give at most one of response_format, regex and ebnf"),
    ("/v1/completions", {"prompt": "hi", "ebnf": 'root ::= "a"', "ignore_eos": True}, "ebnf",
     "cannot be combined with ignore_eos"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
     "tool_choice", "needs tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "functions": []},
     "functions", "refused"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages.0",
     "a user message needs content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "foo": 1}, "foo", "refused"),
])
def test_parameters_that_are_not_honoured_are_refused_by_name(client, path, body, param, words):
    resp = client.post(path, json=body)
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_honoured_extras_are_accepted(client):
    base = {"prompt": "hello", "max_tokens": 3, "temperature": 0}
    assert client.post("/v1/completions", json={**base, "best_of": 1, "user": "u-1"}).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                         {"role": "user", "content": "again"}], "max_tokens": 3,
            "response_format": {"type": "text"}}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200


COLOR_SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                                 "n": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["color", "n"]}


@pytest.mark.parametrize("constraint, check", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": COLOR_SCHEMA}}},
     lambda text: json.loads(text)["color"] in ("red", "green") and 1 <= json.loads(text)["n"] <= 9),
    ({"response_format": {"type": "json_object"}}, lambda text: isinstance(json.loads(text), dict)),
    ({"regex": "(yes|no)"}, lambda text: text in ("yes", "no")),
    ({"ebnf": 'root ::= "x" [0-9] [0-9]'}, lambda text: re.fullmatch(r"x\d\d", text) is not None),
])
@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_is_honoured(client, constraint, check, stream):
    body = {"messages": [{"role": "user", "content": "pick"}], "max_tokens": 40, "temperature": 0, **constraint}
    if not stream:
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        text, finish = choice["message"]["content"], choice["finish_reason"]
    else:
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
            chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        finish = next(c["choices"][0]["finish_reason"] for c in reversed(chunks) if c["choices"])
    if "json_object" not in str(constraint):     # a random model can keep an open object going past 40 tokens
        assert finish == "stop"
    assert finish == "length" or check(text), text


def test_logprobs_under_a_grammar_are_the_raw_models(client):
    """Tokens are chosen under the grammar; their logprobs and alternatives are the unconstrained model's."""
    body = {"messages": [{"role": "user", "content": "pick"}], "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 5}
    constrained = client.post("/v1/chat/completions", json={**body, "regex": "[0-9]+"})
    assert constrained.status_code == 200, constrained.text
    for entry in constrained.json()["choices"][0]["logprobs"]["content"]:
        assert entry["token"].isdigit() and len(entry["top_logprobs"]) == 5
        assert all(alt["logprob"] <= 0 for alt in entry["top_logprobs"])
        assert entry["logprob"] <= entry["top_logprobs"][0]["logprob"]


@pytest.mark.parametrize("constraint, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "not a valid json schema"),
    ({"regex": "(ab"}, "regex", "not a valid regex"),
    ({"ebnf": "root ::= "}, "ebnf", "not a valid ebnf"),
])
def test_a_grammar_that_does_not_compile_is_a_400_naming_its_parameter(client, constraint, param, words):
    resp = client.post("/v1/completions", json={"prompt": "hi", **constraint})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param and words in resp.json()["error"]["message"]


def test_a_lone_surrogate_is_named(client):
    body = b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'
    resp = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 400 and "lone UTF-16 surrogate \\ud800" in resp.json()["error"]["message"]
    pair = b'{"messages": [{"role": "user", "content": "a\\ud83d\\ude00b"}], "max_tokens": 2}'
    assert client.post("/v1/chat/completions", content=pair, headers={"Content-Type": "application/json"}
                       ).status_code == 200
