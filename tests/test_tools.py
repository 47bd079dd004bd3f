"""Tool calls (specserve/server/tools.py): which templates take tools, the grammar that forces a call, and the
parser that turns the model's call blocks into OpenAI tool_calls."""
import json

import pytest
import xgrammar as xgr

from specserve.grammar import GrammarCompiler
from specserve.server.tools import call_grammar, parse_tool_calls, template_takes_tools
from tests.conftest import CHAT_TEMPLATE

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                 "required": ["city"]}}
TIME = {"name": "get_time"}


def test_a_template_takes_tools_when_it_renders_them():
    class Tok:
        chat_template = CHAT_TEMPLATE
    assert not template_takes_tools(Tok())
    Tok.chat_template = "{% if tools %}{{ tools | tojson }}{% endif %}" + CHAT_TEMPLATE
    assert template_takes_tools(Tok())


def test_call_blocks_become_tool_calls_and_the_rest_stays_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me check.\n\n"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]
    content, (first,) = parse_tool_calls(text, parallel=False)
    assert first["function"]["name"] == "get_weather" and content.endswith(
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])
    assert parse_tool_calls("plain answer") == ("plain answer", [])
    assert parse_tool_calls(text.split("\n", 1)[1])[0] is None      # only whitespace outside the calls


@pytest.mark.parametrize("parallel", [True, False])
def test_the_call_grammar_admits_calls_of_the_given_functions_only(tiny_llama, parallel):
    tok = tiny_llama.tokenizer
    compiler = GrammarCompiler(tok, tiny_llama.config.vocab_size, {tok.eos_token_id})
    g = call_grammar([WEATHER, TIME], parallel)
    assert g.param == "tools"

    def accepts(text: str) -> bool:
        matcher = compiler.matcher(g)
        return all(matcher.accept_token(t) for t in tok.encode(text)) and matcher.is_completed()

    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    clock = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert accepts(weather) and accepts(clock)
    assert not accepts(weather.replace("get_weather", "get_wind"))
    assert not accepts(weather.replace('{"city": "Oslo"}', "{}"))          # city is required
    assert accepts(weather + "\n" + clock) == parallel


def test_a_function_or_property_named_root_keeps_its_name(tiny_llama):
    """The parallel grammar renames its start rule; a literal "root" inside the call must survive."""
    tok = tiny_llama.tokenizer
    root = {"name": "root", "parameters": {"type": "object", "properties": {"root": {"enum": ["root"]}},
                                           "required": ["root"]}}
    matcher = GrammarCompiler(tok, tiny_llama.config.vocab_size, {tok.eos_token_id}).matcher(call_grammar([root], True))
    call = '<tool_call>\n{"name": "root", "arguments": {"root": "root"}}\n</tool_call>'
    assert all(matcher.accept_token(t) for t in tok.encode(call)) and matcher.is_completed()


def test_a_parameters_schema_xgrammar_cannot_take_is_named():
    with pytest.raises(ValueError, match="^tools: a function's parameters"):
        call_grammar([{"name": "f", "parameters": {"type": "nonsense"}}], True)
    assert isinstance(xgr.Grammar.from_ebnf(call_grammar([WEATHER], True).value), xgr.Grammar)
