"""Tool calls through the chat API, in-process, on a tiny model whose chat template renders tools (Hermes /
Qwen2.5 call blocks): tool_choice named and required produce well-formed calls of the given functions
(streamed too), auto parses what the model writes, none leaves the text alone; history with calls renders; a
template without tools and a tool_choice without tools are refused by name; the official openai client against a
real speculating server process gets calls and schema-constrained JSON."""
from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from specserve.config import engine_config
from specserve.engine import Engine
from specserve.server.app import create_app
from tests.conftest import CHAT_TEMPLATE, save_hf_folder, tiny_checkpoint
from tests.e2e import KV_BYTES, ServerProcess

TOOLS_TEMPLATE = ("{% if tools %}<|system|>tools: {% for t in tools %}{{ t | tojson }}{% endfor %}\n{% endif %}"
                  "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                  "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}\n"
                  "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time",
                                          "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "weather in Oslo?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    ckpt = tiny_checkpoint("llama")
    ckpt.tokenizer.chat_template = TOOLS_TEMPLATE
    folder = save_hf_folder(ckpt, tmp_path_factory.mktemp("tools"))
    engine = Engine(engine_config(str(folder), memory_bytes=int(KV_BYTES), num_threads=1))
    with TestClient(create_app(engine)) as c:
        yield c


def chat(client, **body) -> dict:
    resp = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 120, "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_a_forced_call_is_well_formed_and_calls_a_given_function(client, tool_choice):
    choice = chat(client, tools=[WEATHER, CLOCK], tool_choice=tool_choice, parallel_tool_calls=False)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
    if isinstance(tool_choice, dict):
        assert name == "get_weather"
    assert (name == "get_weather" and isinstance(arguments["city"], str) and len(arguments["city"]) <= 8) or \
        (name == "get_time" and arguments == {})


def test_a_streamed_call_arrives_whole_in_the_last_delta(client):
    body = {"messages": ASK, "max_tokens": 120, "temperature": 0, "stream": True, "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False}
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert all("<tool_call>" not in (d["delta"].get("content") or "") for d in deltas)
    last = deltas[-1]
    assert last["finish_reason"] == "tool_calls"
    (call,) = last["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    unstreamed = chat(client, tools=[WEATHER], tool_choice=body["tool_choice"], parallel_tool_calls=False)
    assert call["function"]["arguments"] == unstreamed["message"]["tool_calls"][0]["function"]["arguments"]


def test_auto_and_none_leave_a_plain_answer_as_content(client):
    for tool_choice in ("auto", "none"):
        choice = chat(client, tools=[WEATHER], tool_choice=tool_choice, max_tokens=8)
        assert choice["message"].get("tool_calls") is None and choice["finish_reason"] in ("stop", "length")
    # the random model writes no call block; with tools auto its text comes back unchanged
    free = chat(client, max_tokens=8)
    auto = chat(client, tools=[WEATHER], tool_choice="auto", max_tokens=8)
    assert isinstance(free["message"]["content"], str) and auto["message"]["content"] is not None


def test_a_conversation_with_calls_and_their_results_renders(client):
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12 C and rain"}]
    resp = client.post("/tokenize", json={"messages": messages})
    assert resp.status_code == 200
    rendered = client.post("/detokenize", json={"tokens": resp.json()["tokens"]}).json()["prompt"]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in rendered
    assert "<|tool|>12 C and rain" in rendered
    assert chat(client, messages=messages, tools=[WEATHER], max_tokens=4)["finish_reason"] == "length"


@pytest.mark.parametrize("body, param, words", [
    ({"tool_choice": "required"}, "tool_choice", "required needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not among the tools (get_weather)"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0", "tool_call_id"),
    ({"tools": [WEATHER], "tool_choice": "required", "regex": "a"}, "tool_choice", "drop response_format"),
    ({"tools": [WEATHER], "tool_choice": "required", "ignore_eos": True}, "tool_choice", "ignore_eos"),
])
def test_inconsistent_tool_fields_are_422s_that_say_why(client, body, param, words):
    resp = client.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["param"] == param and words in resp.json()["error"]["message"]


def test_a_parameters_schema_that_cannot_be_enforced_is_a_400_naming_tools(client):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    resp = client.post("/v1/chat/completions", json={"messages": ASK, "tools": [bad], "tool_choice": "required"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools"


def test_a_template_without_tools_refuses_them(tmp_path):
    ckpt = tiny_checkpoint("llama")
    assert ckpt.tokenizer.chat_template == CHAT_TEMPLATE
    engine = Engine(engine_config(str(save_hf_folder(ckpt, tmp_path)), memory_bytes=int(KV_BYTES), num_threads=1))
    with TestClient(create_app(engine)) as plain:
        resp = plain.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools"
    assert "does not render tools" in resp.json()["error"]["message"]


def test_the_openai_client_gets_calls_and_schema_output_from_a_speculating_server(tmp_path):
    ckpt = tiny_checkpoint("llama")
    ckpt.tokenizer.chat_template = TOOLS_TEMPLATE
    folder = save_hf_folder(ckpt, tmp_path / "model")
    server = ServerProcess(tmp_path / "server.log", "--speculative-algorithm", "NGRAM", model=folder)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        done = client.chat.completions.create(
            model="tiny-llama", messages=ASK, tools=[WEATHER], max_tokens=120, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
        assert done.choices[0].finish_reason == "tool_calls"
        call = done.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        out = client.chat.completions.create(
            model="tiny-llama", messages=ASK, max_tokens=40, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}})
        assert out.choices[0].finish_reason == "stop" and isinstance(json.loads(out.choices[0].message.content)["ok"],
                                                                   bool)
    finally:
        server.stop()
