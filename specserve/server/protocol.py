"""The OpenAI request and response shapes that specserve serves, as pydantic models.

Requests validate strictly (a string is not a number, 2.0 is not an integer) so that every bad field is
reported by name, and a field this server does not honour is refused by name rather than ignored; the
extension fields top_k, min_p, ignore_eos, regex and ebnf ride along with the OpenAI ones."""
from __future__ import annotations

import json
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from specserve.server.tools import call_grammar
from specserve.types import MAX_TOP_LOGPROBS, Grammar, SamplingParams

MAX_N = 16
NAME = r"^[A-Za-z0-9_-]{1,64}$"     # OpenAI's rule for function and response-format names


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError("must be a non-empty string or a list of non-empty strings")
    return tuple(stops)


def _prompts(value: Any) -> list[str | list[int]]:
    """str | list[str] | list[int] | list[list[int]] → a list of prompts (text or token ids)."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(_is_int(t) for t in value)):
        prompts = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) or isinstance(p, list) for p in value):
        prompts = value
    else:
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")
    for p in prompts:
        if isinstance(p, list) and not all(_is_int(t) for t in p):
            raise ValueError("token-id prompts must hold integers only")
        if not p or (isinstance(p, str) and not p.strip()):
            raise ValueError("is empty: give at least one token")
    return prompts


def _content(value: Any) -> str | None:
    """A message's content: a string or a list of {"type": "text", "text": ...} parts, joined; None stays None
    (an assistant turn may have none)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise ValueError('must be a string or a list of {"type": "text", "text": "..."} parts')


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """{"token id": bias in [-100, 100]} → ((id, bias), ...)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ValueError('must be an object mapping token ids to biases, e.g. {"50256": -100}')
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise ValueError(f"biases must be numbers in [-100, 100], got {bias!r} for token {key}")
        out.append((int(key), float(bias)))
    return tuple(out)


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid", populate_by_name=True)
    name: str = Field(pattern=NAME)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")   # {} admits any JSON value
    strict: bool | None = None      # the output always follows the schema, strict or not


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema" and only with it')
        return self

    @property
    def grammar(self) -> Grammar | None:
        if self.type == "json_object":
            return Grammar("json_object")
        if self.json_schema is not None:
            return Grammar("json_schema", json.dumps(self.json_schema.schema_))
        return None


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = None
    stop: Annotated[tuple[str, ...], BeforeValidator(_stop)] = ()
    n: int = Field(1, ge=1, le=MAX_N)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: Annotated[tuple[tuple[int, float], ...], BeforeValidator(_logit_bias)] = ()
    response_format: ResponseFormat | None = None
    regex: str | None = Field(None, min_length=1)   # SGLang's extensions: the output matches this regex
    ebnf: str | None = Field(None, min_length=1)    # or this EBNF grammar (GBNF style, root rule `root`)
    user: str | None = None      # OpenAI's end-user id for abuse monitoring: accepted, it does not shape output

    @field_validator("response_format", "regex", "ebnf")
    @classmethod
    def _one_grammar(cls, value: Any, info: ValidationInfo) -> Any:
        """At most one of response_format (beyond text), regex and ebnf, and none with ignore_eos."""
        if value is None or (isinstance(value, ResponseFormat) and value.type == "text"):
            return value
        earlier = info.data.get("response_format")
        given = [name for name in ("response_format", "regex", "ebnf") if name != info.field_name
                 and info.data.get(name) is not None and not (name == "response_format" and earlier.type == "text")]
        if given:
            raise ValueError(f"give at most one of response_format, regex and ebnf (got {given[0]} too)")
        if info.data.get("ignore_eos"):
            raise ValueError("cannot be combined with ignore_eos: the output ends where the grammar does")
        return value

    @property
    def grammar(self) -> Grammar | None:
        if self.regex is not None:
            return Grammar("regex", self.regex)
        if self.ebnf is not None:
            return Grammar("ebnf", self.ebnf)
        return self.response_format.grammar if self.response_format is not None else None

    @property
    def max_tokens_field(self) -> tuple[str, int | None]:
        """(the field that limits new tokens, its value; None: up to the context)."""
        return "max_tokens", self.max_tokens

    @property
    def logprob_params(self) -> tuple[bool, int]:
        """(logprobs, top_logprobs) as SamplingParams takes them."""
        return False, 0

    @property
    def prompt_logprobs(self) -> bool:
        return False

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_new_tokens: int, index: int) -> SamplingParams:
        """Parameters of choice `index`; seeded choices get seed + index so n > 1 gives n different samples."""
        logprobs, top_logprobs = self.logprob_params
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            min_p=self.min_p, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=None if self.seed is None else self.seed + index, stop=self.stop, ignore_eos=self.ignore_eos,
            logprobs=logprobs, top_logprobs=top_logprobs, prompt_logprobs=self.prompt_logprobs,
            logit_bias=self.logit_bias, grammar=self.grammar)


class CompletionRequest(_GenerationRequest):
    prompt: Annotated[list[str | list[int]], BeforeValidator(_prompts)]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if best_of is not None and best_of != n:
            raise ValueError(f"best_of must equal n ({n}): server-side best-of sampling is not supported, "
                             "ask for n choices instead")
        return best_of

    @property
    def logprob_params(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0

    @property
    def prompt_logprobs(self) -> bool:
        """echo with logprobs returns the prompt tokens' logprobs too, as OpenAI's legacy API and vLLM do."""
        return self.echo and self.logprobs is not None


class FunctionCall(_Strict):
    name: str
    arguments: str          # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | None, BeforeValidator(_content)] = ""
    name: str | None = None
    tool_calls: list[ToolCall] | None = None     # an assistant turn's calls
    tool_call_id: str | None = None              # a tool turn answers this call

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: a {self.role} message needs content (a string), got null")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only an assistant message carries them, not a {self.role} message")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("tool_call_id: a tool message needs the id of the call it answers, and only it")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it (a call's arguments as an object when they are JSON)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in self.tool_calls]
        return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FunctionDefinition(_Strict):
    name: str = Field(pattern=NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None      # the arguments always follow the parameters when the call is constrained


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_among_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        if choice is None or choice == "none":
            return choice
        names = [t.function.name for t in info.data.get("tools") or []]
        if not names:
            raise ValueError(f"{choice if isinstance(choice, str) else 'a named function'} needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"names function {choice.function.name!r}, which is not among the tools "
                             f"({', '.join(names)})")
        if choice != "auto" and info.data.get("ignore_eos"):
            raise ValueError("a forced call cannot be combined with ignore_eos: the output ends with the call")
        response_format = info.data.get("response_format")
        if choice != "auto" and ((response_format is not None and response_format.type != "text")
                                 or info.data.get("regex") is not None or info.data.get("ebnf") is not None):
            raise ValueError("a forced call constrains the output already: drop response_format, regex or ebnf")
        return choice

    @cached_property
    def grammar(self) -> Grammar | None:
        """A forced tool call's grammar (a ValueError naming tools when a parameters schema cannot be
        enforced), else response_format's, regex's or ebnf's."""
        if forced := self.forced_functions:
            return call_grammar(forced, self.parallel_tool_calls)
        return super().grammar

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the output's tool-call blocks become message.tool_calls."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_functions(self) -> list[dict[str, Any]]:
        """The functions the output must call (tool_choice required or named), else []."""
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return []
        return [t.function.model_dump(exclude_none=True) for t in self.tools
                if self.tool_choice == "required" or t.function.name == self.tool_choice.function.name]

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def max_tokens_field(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    @property
    def logprob_params(self) -> tuple[bool, int]:
        return self.logprobs, self.top_logprobs or 0


# ---- responses --------------------------------------------------------------------------------------

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class SpecUsage(BaseModel):
    """specserve's extension: speculative decoding statistics summed over the response's choices."""
    verify_ct: int
    accept_length: float            # emitted tokens per verify step (bonus token included)
    num_accepted_drafts: int
    num_proposed_drafts: int
    accepted_histogram: list[int]   # [k] = verify steps that accepted exactly k drafts


class PromptTokensDetails(BaseModel):
    cached_tokens: int              # prompt tokens served by the radix prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    spec: SpecUsage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []              # None: the first prompt token (echo)
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ToolCallDelta(ToolCall):
    index: int


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
