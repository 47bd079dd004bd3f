"""The OpenAI-compatible HTTP server: FastAPI endpoints over the AsyncEngine, OpenAI-style errors,
bearer-token auth, Prometheus metrics, and a SIGTERM that drains in-flight requests and exits 0. With
--dp-size N it fronts N engine replicas (replicas.py); one that dies makes the server drain the rest and exit 1.

Status codes: 400 body is not JSON, or a value does not fit this model (prompt or max_tokens beyond the
context, token id outside the vocabulary, chat template refused the messages); 401 wrong or missing API key;
404 unknown model or route; 413 body over MAX_BODY_BYTES; 422 body does not fit the schema (missing
field, wrong type, value out of range); 503 (with Retry-After) queue full or shutting down; 500 the engine
failed while running the request, or its replica died."""
from __future__ import annotations

import asyncio
import copy
import hmac
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import jinja2
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve import __version__
from specserve.config import engine_config
from specserve.engine import Engine
from specserve.grammar import GrammarCompiler
from specserve.loader import EMBEDDED_NAME
from specserve.loader.tokenizer import chat_token_ids
from specserve.server.async_engine import AsyncEngine, EngineError, LocalReplica, Submission, Unavailable
from specserve.server.metrics import EngineSnapshot, Metrics
from specserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SpecUsage,
    TokenizeRequest,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from specserve.server.replicas import RemoteReplica, replica_args
from specserve.server.tools import OPEN, parse_tool_calls, template_takes_tools
from specserve.types import Grammar, RequestOutput, SamplingParams, SpecStats

MAX_BODY_BYTES = 1 << 20
RETRY_AFTER_S = 1
DONE = "data: [DONE]\n\n"

Req = TypeVar("Req", bound=BaseModel)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        kind = "authentication_error" if self.status == 401 else (
            "invalid_request_error" if self.status < 500 else "server_error")
        body = ErrorResponse(error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


# a \uD800-\uDBFF escape not followed by a \uDC00-\uDFFF one, or a \uDC00-\uDFFF escape on its own
LONE_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                            r"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def validation_error(exc: ValidationError, body: bytes = b"") -> ApiError:
    """The first schema violation, as `field.path: what is wrong (got value)`."""
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        if surrogate := LONE_SURROGATE.search(body.decode("utf-8", "replace")):
            return ApiError(400, f"the body is not valid JSON: it holds the lone UTF-16 surrogate "
                                 f"{surrogate.group(0)}, which is not a character; send valid Unicode text")
        return ApiError(400, f"the body is not valid JSON: {err['msg'].removeprefix('Invalid JSON: ')}")
    param = ".".join(str(part) for part in err["loc"]) or None
    if err["type"] == "extra_forbidden":
        return ApiError(422, f"{param}: is not a parameter this server honours, so it is refused rather than "
                             "ignored (the README lists the supported ones)", param=param)
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] != "missing" and isinstance(err.get("input"), str | int | float | bool | None):
        message += f" (got {err['input']!r})"
    return ApiError(422, f"{param or 'request body'}: {message}", param=param)


def unavailable(exc: Unavailable) -> ApiError:
    return ApiError(503, str(exc), code="unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})


def sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def stable_text(out: RequestOutput, stops: tuple[str, ...], hold_from: str = "") -> str:
    """The part of the cumulative text that later tokens cannot change: without a trailing incomplete
    UTF-8 character (decoded as U+FFFD), without a suffix that may be the start of a stop string, and before
    `hold_from` (a tool call's opening tag: the call goes out whole, parsed, at the end)."""
    if out.finished:
        return out.text
    text = out.text.rstrip("\ufffd")
    if hold_from and (at := text.find(hold_from)) >= 0:
        return text[:at]
    marks = (*stops, hold_from) if hold_from else stops
    hold = max((k for s in marks for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[:len(text) - hold]


@dataclass
class Progress:
    """How much of one choice has been sent."""
    stops: tuple[str, ...]
    hold_from: str = ""
    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0      # completions logprobs: characters covered by the tokens sent
    echoed: bool = False      # completions with echo: the prompt's text went out

    def advance(self, out: RequestOutput) -> tuple[str, int]:
        """New stable text, and the index of the first token not sent yet."""
        text = stable_text(out, self.stops, self.hold_from)
        new, self.text_len = text[self.text_len:], max(self.text_len, len(text))
        start, self.num_tokens = self.num_tokens, len(out.token_ids)
        return new, start


class EventStream(StreamingResponse):
    """Server-sent events that abort the request's engine work however the response ends
    (finished, failed, or the client went away mid-stream)."""

    def __init__(self, events: AsyncIterator[str], submission: Submission) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.submission = submission

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.submission.abort()


class OpenAIServer:
    """The endpoints. `engine` is replica 0 (its tokenizer and limits are the server's: every replica loads the
    same model); `remotes` are replicas 1.. in processes of their own."""

    def __init__(self, engine: Engine, served_model_name: str | None, api_key: str | None,
                 max_queued_requests: int, remotes: Sequence[RemoteReplica] = ()) -> None:
        self.metrics = Metrics()
        max_running = (1 + len(remotes)) * engine.config.scheduler.max_running_requests
        self.core = AsyncEngine([LocalReplica(engine), *remotes], self.metrics, max_running + max_queued_requests,
                                engine.config.cache.page_size)
        # handlers encode with their own copy: the engine thread decodes with engine.tokenizer, and one
        # Rust tokenizer object must not be used by two threads at once
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.vocab_size = engine.model_config.vocab_size
        self.eos_token_ids = set(engine.eos_token_ids)
        self._grammar_compiler: GrammarCompiler | None = None
        self.max_model_len = engine.max_model_len
        self.model_name = served_model_name or engine.config.model_path or EMBEDDED_NAME
        self.api_key = api_key
        self.created = int(time.time())
        self.metrics.observe(0, EngineSnapshot.of(engine))     # the gauges exist before the first request

    # ---- endpoints --------------------------------------------------------------------------------
    async def health(self) -> Response:
        if self.core.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> ModelList:
        self.check_api_key(request)
        return ModelList(data=[self.model_card()])

    async def model(self, request: Request, model_id: str) -> ModelCard:
        self.check_api_key(request)
        self.check_model(model_id)
        return self.model_card()

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_model_len)

    async def version(self) -> dict:
        return {"version": __version__}

    async def tokenize(self, request: Request) -> dict:
        self.check_api_key(request)
        req = await self.parse(request, TokenizeRequest)
        self.check_model(req.model)
        if req.messages is not None:
            tokens = self.encode_messages(req.messages)
        else:
            tokens = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len}

    async def detokenize(self, request: Request) -> dict:
        self.check_api_key(request)
        req = await self.parse(request, DetokenizeRequest)
        self.check_model(req.model)
        self.check_token_ids(req.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    async def completions(self, request: Request) -> Response:
        self.check_api_key(request)
        req = await self.parse(request, CompletionRequest)
        self.check_model(req.model)
        prompts = [self.encode_prompt(p) for p in req.prompt]
        echoes = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in req.prompt] if req.echo else []
        fmt = CompletionFormat(self, req, f"cmpl-{uuid.uuid4().hex}", echoes=echoes)
        return await self.generate(request, prompts, fmt)

    async def chat_completions(self, request: Request) -> Response:
        self.check_api_key(request)
        req = await self.parse(request, ChatCompletionRequest)
        self.check_model(req.model)
        prompt = self.encode_chat(req)
        return await self.generate(request, [prompt], ChatFormat(self, req, f"chatcmpl-{uuid.uuid4().hex}"))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # ---- request → engine -------------------------------------------------------------------------
    def check_api_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model: {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def parse(self, request: Request, schema: type[Req]) -> Req:
        too_large = ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise too_large
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > MAX_BODY_BYTES:
                raise too_large
        try:
            return schema.model_validate_json(bytes(body))
        except ValidationError as exc:
            raise validation_error(exc, bytes(body)) from None

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"{param}: token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                           param=param)

    def check_grammar(self, grammar: Grammar) -> None:
        """A grammar that does not compile is the client's error (400), named before any work starts."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        try:
            self._grammar_compiler.matcher(grammar)
        except ValueError as exc:
            raise ApiError(400, str(exc), param=grammar.param) from None

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        self.check_token_ids(prompt, "prompt")
        return prompt

    def encode_chat(self, req: ChatCompletionRequest) -> list[int]:
        return self.encode_messages(req.messages, req.tools)

    def encode_messages(self, messages: list[ChatMessage], tools: list[Tool] | None = None) -> list[int]:
        chat = [m.template_dict() for m in messages]
        if tools and not template_takes_tools(self.tokenizer):
            raise ApiError(400, f"tools: the chat template of {self.model_name} does not render tools, so the model "
                                "cannot be told about them; serve a model whose template takes tools (e.g. Qwen2.5)",
                           param="tools")
        try:
            return chat_token_ids(self.tokenizer, chat, [t.model_dump(exclude_none=True) for t in tools or []] or None)
        except jinja2.TemplateError as exc:
            raise ApiError(400, f"messages: the model's chat template rejected them: {exc}", param="messages")

    def jobs(self, req: CompletionRequest | ChatCompletionRequest,
             prompts: list[list[int]]) -> list[tuple[list[int], SamplingParams]]:
        """n engine requests per prompt, with max_tokens checked against the context left."""
        self.check_token_ids([t for t, _ in req.logit_bias], "logit_bias")
        try:
            grammar = req.grammar
        except ValueError as exc:
            raise ApiError(400, str(exc), param="tools") from None
        if grammar is not None:
            self.check_grammar(grammar)
        jobs = []
        for ids in prompts:
            room = self.max_model_len - len(ids)
            if room < 1:
                param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
                raise ApiError(400, f"{param}: the prompt has {len(ids)} tokens but the context holds "
                                    f"{self.max_model_len} tokens including at least one new token",
                               param=param, code="context_length_exceeded")
            param, wanted = req.max_tokens_field
            if wanted is not None and wanted > room:
                raise ApiError(400, f"{param}: {wanted} new tokens do not fit the context: the prompt has "
                                    f"{len(ids)} tokens and the context holds {self.max_model_len}, so at most "
                                    f"{room}", param=param, code="context_length_exceeded")
            jobs += [(ids, req.sampling_params(wanted or room, i)) for i in range(req.n)]
        return jobs

    async def generate(self, request: Request, prompts: list[list[int]],
                       fmt: CompletionFormat | ChatFormat) -> Response:
        # off the event loop: compiling a grammar (a JSON schema, a forced tool call) can take a while
        jobs = await asyncio.to_thread(self.jobs, fmt.req, prompts)
        try:
            sub = self.core.submit(jobs)
        except Unavailable as exc:
            raise unavailable(exc) from None
        prompt_tokens = sum(len(p) for p in prompts)
        if fmt.req.stream:
            return EventStream(self.events(sub, fmt, prompt_tokens), sub)
        finals = await self.collect(request, sub)
        if finals is None:
            return Response(status_code=499)    # the client went away; its requests were aborted
        choices = [fmt.choice(i, out.text, out, fmt.progress(), 0) for i, out in enumerate(finals)]
        return JSONResponse(fmt.response(choices, usage_of(prompt_tokens, finals)).model_dump())

    async def collect(self, request: Request, sub: Submission) -> list[RequestOutput] | None:
        """Final outputs in choice order, or None when the client disconnects first."""
        finals: list[RequestOutput] = [None] * len(sub.ids)

        async def run() -> None:
            async for index, out in sub.outputs():
                finals[index] = out

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(run()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                return None
            try:
                work.result()
            except EngineError as exc:
                raise ApiError(500, str(exc), code="engine_error") from None
            except ValueError as exc:
                raise ApiError(400, str(exc)) from None
            return finals
        finally:
            work.cancel()
            watch.cancel()
            sub.abort()

    async def events(self, sub: Submission, fmt: CompletionFormat | ChatFormat,
                     prompt_tokens: int) -> AsyncIterator[str]:
        for first in fmt.first_chunks():
            yield sse(first)
        progress = [fmt.progress() for _ in sub.ids]
        finals: list[RequestOutput] = [None] * len(sub.ids)
        wants_logprobs = fmt.req.logprob_params[0]
        try:
            async for index, out in sub.outputs():
                text, start = progress[index].advance(out)
                if text or out.finished or (wants_logprobs and start < len(out.token_ids)):
                    yield sse(fmt.response([fmt.choice(index, text, out, progress[index], start)]))
                finals[index] = out
        except (EngineError, ValueError) as exc:
            code = "engine_error" if isinstance(exc, EngineError) else None
            yield sse(ErrorResponse(error=ErrorInfo(message=str(exc), type="server_error", code=code)))
        else:
            if fmt.req.include_usage:
                yield sse(fmt.response([], usage_of(prompt_tokens, finals)))
        yield DONE


# ---- engine output → OpenAI shapes -------------------------------------------------------------------

@dataclass
class CompletionFormat:
    server: OpenAIServer
    req: CompletionRequest
    id: str
    created: int = field(default_factory=lambda: int(time.time()))
    echoes: list[str] = field(default_factory=list)     # with echo: each prompt's text, put before its choices

    def first_chunks(self) -> list[BaseModel]:
        return []

    def progress(self) -> Progress:
        return Progress(self.req.stop)

    def choice(self, index: int, text: str, out: RequestOutput, progress: Progress, start: int) -> CompletionChoice:
        """`text` and the tokens from `start` on: all of them, or what is new in a stream; with echo, the
        first choice of a request starts with the prompt (and its tokens' logprobs)."""
        echo = bool(self.echoes) and not progress.echoed
        logprobs = None
        if self.req.logprobs is not None:
            logprobs = CompletionLogprobs(top_logprobs=[] if self.req.logprobs else None)
            if echo:
                for token_id, lp, top in zip(out.prompt_token_ids, out.prompt_logprobs, out.prompt_top_logprobs):
                    self.add_logprob(logprobs, progress, token_id, lp, top)
            for i in range(start, len(out.token_ids)):
                self.add_logprob(logprobs, progress, out.token_ids[i], out.logprobs[i],
                                 out.top_logprobs[i] if self.req.logprobs else None)
        if echo:
            text, progress.echoed = self.echoes[index // self.req.n] + text, True
        return CompletionChoice(index=index, text=text, logprobs=logprobs,
                                finish_reason=out.finish_reason if out.finished else None)

    def add_logprob(self, logprobs: CompletionLogprobs, progress: Progress, token_id: int, logprob: float | None,
                    top: dict[int, float] | None) -> None:
        token = self.server.token_text(token_id)
        logprobs.tokens.append(token)
        logprobs.token_logprobs.append(logprob)
        logprobs.text_offset.append(progress.text_offset)
        progress.text_offset += len(token)
        if self.req.logprobs:
            logprobs.top_logprobs.append(None if top is None else {self.server.token_text(t): lp
                                                                   for t, lp in top.items()})

    def response(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.server.model_name, choices=choices,
                                  usage=usage)


@dataclass
class ChatFormat:
    server: OpenAIServer
    req: ChatCompletionRequest
    id: str
    created: int = field(default_factory=lambda: int(time.time()))

    def first_chunks(self) -> list[BaseModel]:
        return [self.response([ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
                for i in range(self.req.n)]

    def progress(self) -> Progress:
        return Progress(self.req.stop, OPEN if self.req.parses_tool_calls else "")

    def choice(self, index: int, text: str, out: RequestOutput, progress: Progress,
               start: int) -> ChatChoice | ChatChunkChoice:
        """`text`: the whole text, or in a stream the part not sent yet (with a tool call, all of it arrives at
        the finish, since progress holds it back from the opening tag on)."""
        logprobs = None
        if self.req.logprobs:
            logprobs = ChatLogprobs(content=[self.token_logprob(out, i) for i in range(start, len(out.token_ids))])
        finish_reason = out.finish_reason if out.finished else None
        content, calls = text, []
        if out.finished and self.req.parses_tool_calls:
            content, calls = parse_tool_calls(text, self.req.parallel_tool_calls)
            if calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        if self.req.stream:
            delta = Delta(content=content if not calls else content or None,
                          tool_calls=[ToolCallDelta(index=i, **c) for i, c in enumerate(calls)] or None)
            return ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        message = AssistantMessage(content=content, tool_calls=[ToolCall(**c) for c in calls] or None)
        return ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=finish_reason)

    def response(self, choices: list, usage: Usage | None = None) -> ChatCompletionChunk | ChatCompletionResponse:
        kind = ChatCompletionChunk if self.req.stream else ChatCompletionResponse
        return kind(id=self.id, created=self.created, model=self.server.model_name, choices=choices, usage=usage)

    def top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.server.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    def token_logprob(self, out: RequestOutput, i: int) -> TokenLogprob:
        top = sorted((out.top_logprobs[i] if out.top_logprobs else {}).items(), key=lambda kv: -kv[1])
        return TokenLogprob(**self.top_logprob(out.token_ids[i], out.logprobs[i]).model_dump(),
                            top_logprobs=[self.top_logprob(t, lp) for t, lp in top])


def usage_of(prompt_tokens: int, finals: list[RequestOutput]) -> Usage:
    completion_tokens = sum(len(o.token_ids) for o in finals)
    total = SpecStats()
    for o in finals:
        total.merge(o.spec)
    spec = SpecUsage(verify_ct=total.verify_ct,
                     accept_length=round(completion_tokens / total.verify_ct, 4) if total.verify_ct else 0.0,
                     num_accepted_drafts=total.num_accepted_drafts, num_proposed_drafts=total.num_proposed_drafts,
                     accepted_histogram=total.accepted_histogram)
    cached = PromptTokensDetails(cached_tokens=max((o.num_cached_tokens for o in finals), default=0))
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=cached, spec=spec)


def create_app(engine: Engine, served_model_name: str | None = None, api_key: str | None = None,
               max_queued_requests: int = 256, remotes: Sequence[RemoteReplica] = ()) -> FastAPI:
    server = OpenAIServer(engine, served_model_name, api_key, max_queued_requests, remotes)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.core.start()
        yield
        await server.core.stop()

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.server = server
    app.add_api_route("/health", server.health, methods=["GET", "HEAD"])
    app.add_api_route("/metrics", server.prometheus, methods=["GET", "HEAD"])
    app.add_api_route("/version", server.version, methods=["GET", "HEAD"])
    app.add_api_route("/v1/models", server.models, methods=["GET", "HEAD"])
    app.add_api_route("/v1/models/{model_id:path}", server.model, methods=["GET", "HEAD"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return ApiError(exc.status_code, message, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return ApiError(500, f"internal server error: {type(exc).__name__}: {exc}").response()

    return app


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: keep listening, but /health and new requests answer 503 (with Retry-After); give
    in-flight requests `grace_s` to finish, abort the rest, then close the socket and exit 0. A second
    signal stops at once. A replica that dies starts the same drain, and `exit_code` becomes 1."""

    def __init__(self, config: uvicorn.Config, core: AsyncEngine, grace_s: float) -> None:
        super().__init__(config)
        self.core, self.grace_s = core, grace_s
        self.draining = False
        self.exit_code = 0
        core.on_failure = self.fail

    def handle_exit(self, sig: int, frame) -> None:
        # uvicorn's own handler would close the socket at once (connection refused during the drain) and
        # re-raise the signal once shut down, so the process would die of SIGTERM instead of exiting 0
        if self.draining:
            self.force_exit = self.force_exit or sig == signal.SIGINT
            self.should_exit = True
            return
        self.drain()

    def fail(self) -> None:
        self.exit_code = 1
        if not self.draining:
            self.drain()

    def drain(self) -> None:
        self.draining = True
        self.core.drain(self.grace_s, lambda: setattr(self, "should_exit", True))


def serve(engine_args: dict, host: str = "127.0.0.1", port: int = 30000, max_queued_requests: int = 256,
          api_key: str | None = None, served_model_name: str | None = None, shutdown_timeout: float = 10.0) -> int:
    """Serve until SIGTERM (exit status 0) or a replica's death (1); `engine_args["dp_size"]` replicas."""
    dp_size = engine_args.get("dp_size", 1)
    if dp_size < 1:
        raise ValueError(f"--dp-size must be at least 1, got {dp_size}")
    # replicas 1.. load in their processes while replica 0 loads here
    remotes = [RemoteReplica(i, replica_args(engine_args, i)) for i in range(1, dp_size)]
    engine: Engine | None = None
    try:
        engine = Engine(engine_config(**replica_args(engine_args, 0)))
        for remote in remotes:
            remote.wait_ready()
        app = create_app(engine, served_model_name, api_key, max_queued_requests, remotes)
        # uvicorn cancels whatever is left after its own timeout; ours aborts requests before that
        config = uvicorn.Config(app, host=host, port=port, log_level="info",
                                timeout_graceful_shutdown=shutdown_timeout + 5)
        server = DrainingServer(config, app.state.server.core, shutdown_timeout)
        server.run()
        return server.exit_code
    finally:
        for remote in remotes:
            remote.kill()       # no orphan, however serving ended
        if engine is not None:
            engine.close()
