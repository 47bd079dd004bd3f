"""Plain data passed between the stages of a step: schedule → propose → forward → verify → commit."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.detokenizer import IncrementalText

MAX_TOP_LOGPROBS = 20


GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf")


@dataclass(frozen=True)
class Grammar:
    """Structured output: the output must match this grammar (any JSON object for json_object, else `value`:
    a JSON schema as text, a regex or an EBNF grammar)."""
    kind: str
    value: str = ""
    source: str = ""        # the API parameter it came from, when not the kind's own (tools)

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"invalid grammar kind {self.kind!r}: use one of {', '.join(GRAMMAR_KINDS)}")
        if self.kind != "json_object" and not self.value:
            raise ValueError(f"{self.param}: the {self.kind.replace('_', ' ')} is empty")

    @property
    def param(self) -> str:
        """The API parameter that carries it."""
        return self.source or {"regex": "regex", "ebnf": "ebnf"}.get(self.kind, "response_format")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0             # 0 means greedy
    top_k: int = 0                       # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False     # the prompt tokens' logprobs too (with top_logprobs alternatives each)
    logit_bias: tuple[tuple[int, float], ...] = ()    # (token id, added to its logit) as in OpenAI's API
    grammar: Grammar | None = None    # structured output (specserve/grammar.py)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether the logits are adjusted before sampling (penalties or a logit bias)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0 or bool(self.logit_bias))

    def validate(self) -> None:
        def bad(field_name: str, why: str) -> ValueError:
            return ValueError(f"invalid sampling parameter {field_name}: {why}")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", f"must be an integer >= 1, got {self.max_new_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise bad(name, f"must be in [-2, 2], got {value!r}")
        if not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise bad("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty")
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias):
            raise bad("logit_bias", "token ids must be >= 0 and biases in [-100, 100]")
        if self.grammar is not None and self.ignore_eos:
            raise bad("ignore_eos", f"cannot be combined with {self.grammar.param}: the output ends where the "
                                    "grammar does")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    verify_ct: int = 0
    num_proposed_drafts: int = 0
    num_accepted_drafts: int = 0
    num_emitted_tokens: int = 0
    accepted_histogram: list[int] = field(default_factory=list)   # [k] = steps that accepted k drafts

    @property
    def accept_length(self) -> float:
        return self.num_emitted_tokens / self.verify_ct if self.verify_ct else 0.0

    def record(self, num_proposed: int, num_accepted: int, num_emitted: int) -> None:
        self.verify_ct += 1
        self.num_proposed_drafts += num_proposed
        self.num_accepted_drafts += num_accepted
        self.num_emitted_tokens += num_emitted
        if len(self.accepted_histogram) <= num_accepted:
            self.accepted_histogram.extend([0] * (num_accepted + 1 - len(self.accepted_histogram)))
        self.accepted_histogram[num_accepted] += 1

    def copy(self) -> SpecStats:
        return SpecStats(self.verify_ct, self.num_proposed_drafts, self.num_accepted_drafts, self.num_emitted_tokens,
                         list(self.accepted_histogram))

    def merge(self, other: SpecStats) -> None:
        self.verify_ct += other.verify_ct
        self.num_proposed_drafts += other.num_proposed_drafts
        self.num_accepted_drafts += other.num_accepted_drafts
        self.num_emitted_tokens += other.num_emitted_tokens
        for k, count in enumerate(other.accepted_histogram):
            if len(self.accepted_histogram) <= k:
                self.accepted_histogram.append(0)
            self.accepted_histogram[k] += count

    def as_dict(self) -> dict:
        return {
            "verify_ct": self.verify_ct,
            "num_proposed_drafts": self.num_proposed_drafts,
            "num_accepted_drafts": self.num_accepted_drafts,
            "accept_length": round(self.accept_length, 4),
            "accepted_histogram": list(self.accepted_histogram),
        }


@dataclass
class Request:
    """Engine-side state of one request; mutated only by Engine.commit and the scheduler's page ops."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)     # None for the first prompt token
    prompt_top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    pages: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0          # tokens whose target KV is valid
    num_cached_tokens: int = 0            # of those, taken from the prefix cache at admission
    num_preemptions: int = 0
    first_token_time: float | None = None
    stop_text_len: int | None = None      # text cut at a stop string
    text: IncrementalText = field(default_factory=IncrementalText)   # the output's text so far
    stats: SpecStats = field(default_factory=SpecStats)
    grammar_matcher: Any = None           # xgrammar matcher at the end of the output, for a request with a grammar

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: feed tokens [start, start+num_feed) and, if it reaches the end
    of the sequence, sample (or verify up to `max_drafts` draft tokens appended after them)."""
    request: Request
    start: int                 # position of the first fed token (= num_computed_tokens)
    num_feed: int              # known tokens fed this step (prefill chunk or the anchor)
    samples: bool              # True when the chunk reaches the last known token
    max_drafts: int = 0        # draft slots reserved for this step


@dataclass(frozen=True)
class StepPlan:
    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[Request, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class Proposal:
    """Drafts for each scheduled request, in plan order. `draft_probs[i]` is the exact distribution
    the drafts were sampled from ([num_drafts, vocab]) or None for deterministic drafts."""
    draft_tokens: tuple[tuple[int, ...], ...]
    draft_probs: tuple[torch.Tensor | None, ...]
    confidences: tuple[tuple[float, ...] | None, ...] = ()

    @staticmethod
    def none(num_requests: int) -> Proposal:
        return Proposal(((),) * num_requests, (None,) * num_requests)


@dataclass(frozen=True)
class RequestVerifyResult:
    emitted: tuple[int, ...]                 # accepted drafts then the bonus token
    num_accepted: int
    logprobs: tuple[float, ...] = ()
    top_logprobs: tuple[dict[int, float], ...] = ()


@dataclass(frozen=True)
class VerifyResult:
    per_request: tuple[RequestVerifyResult | None, ...]   # None for prefill chunks that do not sample


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float | None] | None = None      # with prompt_logprobs, once the prompt is computed
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    spec: SpecStats = field(default_factory=SpecStats)    # this request's speculation so far
    num_preemptions: int = 0
    num_cached_tokens: int = 0            # prompt tokens served by the prefix cache
    time_to_first_token: float | None = None
