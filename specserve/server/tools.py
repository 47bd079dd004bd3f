"""Tool calls in the Hermes / Qwen2.5 format: the chat template renders the tools, the model answers a call as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, and those blocks become `message.tool_calls`.
tool_choice "required" or a named function constrains the output to such calls through the grammar path
(specserve/grammar.py), so they are well-formed and match each function's parameters schema."""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

from specserve.grammar import error_text
from specserve.types import Grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


def template_takes_tools(tokenizer) -> bool:
    """Whether the chat template renders a `tools` list (Qwen2.5's does; SmolLM2's has no such variable)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    return re.search(r"\btools\b", template) is not None


def call_schema(function: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": function.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"]}


def call_grammar(functions: list[dict[str, Any]], parallel: bool) -> Grammar:
    """Output that is one call of one of `functions` (several, one per line, when `parallel`). A parameters
    schema that xgrammar cannot take is a ValueError naming `tools`."""
    import xgrammar as xgr
    schemas = [call_schema(f) for f in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    try:
        body = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"tools: a function's parameters are not a JSON schema this server can enforce: "
                         f"{error_text(exc)}") from None
    one = xgr.Grammar.concat(xgr.Grammar.from_ebnf(f'root ::= "{OPEN}\\n"'), body,
                             xgr.Grammar.from_ebnf(f'root ::= "\\n{CLOSE}"'))
    text = str(one)
    if parallel:
        # only the start rule's definition is renamed: a bare "root" elsewhere may sit inside a string literal
        text = re.sub(r"^root ::=", "tool_call ::=", text, count=1, flags=re.M) \
            + '\nroot ::= tool_call ("\\n" tool_call){0, -1}\n'
    return Grammar("ebnf", text, source="tools")


def parse_tool_calls(text: str, parallel: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
    """(the text outside the call blocks, None when only whitespace; the calls as OpenAI tool_calls). A block
    whose JSON has no name and arguments object stays in the text; so do the calls after the first without
    `parallel`."""
    calls, kept, last = [], [], 0
    for match in _BLOCK.finditer(text):
        try:
            value = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not (isinstance(value, dict) and isinstance(value.get("name"), str)
                and isinstance(value.get("arguments", {}), dict)):
            continue
        if calls and not parallel:
            continue        # one call only: a later block stays in the text
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": value["name"],
                                   "arguments": json.dumps(value.get("arguments", {}), ensure_ascii=False)}})
    content = "".join(kept) + text[last:]
    return (content if content.strip() else None), calls
