"""Speculative decoding: the proposer protocol and registry (here), the shared verifier (verify.py), the
proposers (ngram.py, draft_model.py, eagle_proposer.py, block_proposer.py), verify-window policies
(windows.py) and the target's cost table (cost_table.py).

A proposer drafts tokens for the scheduled requests (`propose`), and after the engine has committed
a step it learns what was accepted (`commit`), with the target's hidden states of that forward.
A proposer with its own KV (a draft model) declares its geometry; the engine sizes a draft pool over
the same page ids as the target's and attaches it. The prefix cache shares those page ids, so a
request that starts after `req.num_cached_tokens` cached tokens finds their draft context written:
the engine caches only positions below `context_length`."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from specserve.config import ModelConfig, SpecConfig
from specserve.kv_pages import KVGeometry, KVPool
from specserve.types import Proposal, Request, StepPlan, VerifyResult

if TYPE_CHECKING:
    from specserve.loader import LoadedCheckpoint
    from specserve.models.llama import LlamaModel
    from specserve.runner import ForwardOutput

MAX_DRAFT_TOKENS = 64


@dataclass(frozen=True)
class TargetInfo:
    """What a proposer may know about the target it drafts for."""
    model: LlamaModel
    config: ModelConfig
    tokenizer: object
    dtype: torch.dtype
    source: str            # where the checkpoint came from (a path, or a name for one built in memory)
    page_size: int         # of the engine's KV pools
    kv_dtype: torch.dtype  # of the target's KV pool (its attention runs in it)


class DraftJob(NamedTuple):
    """A request that drafts this step: its index in the plan and how many drafts it may propose."""
    index: int
    request: Request
    num_drafts: int


class Proposer(Protocol):
    kv_geometry: KVGeometry | None           # None: no draft KV pool needed
    aux_layer_ids: tuple[int, ...]           # target layers whose hidden states `commit` receives

    def attach_pool(self, pool: KVPool) -> None: ...
    def draft_slots(self, req: Request) -> int: ...
    def context_length(self, req: Request) -> int: ...   # leading positions whose draft state is written
    def propose(self, plan: StepPlan) -> Proposal: ...
    def commit(self, plan: StepPlan, result: VerifyResult, out: ForwardOutput) -> None: ...
    def release(self, req: Request) -> None: ...


class NoProposer:
    """Plain decoding: no drafts, no draft state."""
    kv_geometry: KVGeometry | None = None
    aux_layer_ids: tuple[int, ...] = ()

    def attach_pool(self, pool: KVPool) -> None:
        raise TypeError("plain decoding keeps no draft KV")

    def draft_slots(self, req: Request) -> int:
        return 0

    def context_length(self, req: Request) -> int:
        return req.num_computed_tokens

    def propose(self, plan: StepPlan) -> Proposal:
        return Proposal.none(len(plan.scheduled))

    def commit(self, plan: StepPlan, result: VerifyResult, out: ForwardOutput) -> None:
        pass

    def release(self, req: Request) -> None:
        pass


class CommittedContext:
    """For drafters whose context is written at commit for committed tokens only (EAGLE, DFLASH, DSPARK):
    `num_valid` counts each request's leading positions with written context (or, for a proposer that writes
    lazily, context kept to be written; its context_length then counts the written ones only); a request new
    to the proposer starts after its cached prefix, whose context the prefix cache kept."""
    num_valid: dict[str, int]

    def accounted_length(self, req: Request) -> int:
        """Leading positions whose context is written, or kept to be written before the next draft reads it."""
        return self.num_valid.get(req.request_id, req.num_cached_tokens)

    def context_length(self, req: Request) -> int:
        return self.accounted_length(req)

    def ready(self, req: Request) -> bool:
        """Whether the context holds every position before the anchor (the last token, not yet fed)."""
        return self.accounted_length(req) == req.num_computed_tokens == req.num_tokens - 1


# algorithm → "module:Class"; each class has
# `build(spec: SpecConfig, target: TargetInfo, draft: LoadedCheckpoint | None) -> Proposer`
# where `draft` is an already loaded draft model (tests, embedding); otherwise spec.draft_model_path is loaded.
PROPOSERS = {
    "NGRAM": "specserve.speculative.ngram:NgramProposer",
    "STANDALONE": "specserve.speculative.draft_model:DraftModelProposer",
    "EAGLE": "specserve.speculative.eagle_proposer:EagleProposer",
    "DFLASH": "specserve.speculative.block_proposer:BlockDrafterProposer",
    "DSPARK": "specserve.speculative.block_proposer:BlockDrafterProposer",
}
# Block drafters (DFLASH, DSPARK) draft --speculative-block-size tokens and ignore this number.
DEFAULT_DRAFT_TOKENS = {"NGRAM": 4, "STANDALONE": 4, "EAGLE": 3, "DFLASH": 8, "DSPARK": 8}


def validate_spec(spec: SpecConfig) -> SpecConfig:
    """Check the flags and fill defaults; every problem is a ValueError naming the flag."""
    if spec.sampling not in ("coupled", "rejection"):
        raise ValueError(f"--speculative-sampling must be coupled or rejection, got {spec.sampling!r}")
    algorithm = spec.algorithm.upper()
    if algorithm == "NONE":
        return spec
    if algorithm not in PROPOSERS:
        raise ValueError(f"--speculative-algorithm {spec.algorithm!r} is not supported: choose one of "
                         f"NONE, {', '.join(PROPOSERS)}")
    k = spec.num_draft_tokens or DEFAULT_DRAFT_TOKENS[algorithm]
    if not 1 <= k <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--speculative-num-draft-tokens must be in [1, {MAX_DRAFT_TOKENS}], got {k}")
    if algorithm == "STANDALONE" and not spec.draft_model_path:
        raise ValueError("--speculative-algorithm STANDALONE needs --speculative-draft-model-path "
                         "(a small model with the target's tokenizer)")
    if spec.ngram_hybrid and algorithm != "DSPARK":
        raise ValueError(f"--speculative-ngram-hybrid needs DSPARK's confidences, not --speculative-algorithm "
                         f"{algorithm}: use DSPARK, or NGRAM alone")
    if not 1 <= spec.ngram_min <= spec.ngram_max:
        raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {spec.ngram_min}..{spec.ngram_max}")
    return SpecConfig(**{**spec.__dict__, "algorithm": algorithm, "num_draft_tokens": k})


def build_proposer(spec: SpecConfig, target: TargetInfo, draft: LoadedCheckpoint | None = None) -> Proposer:
    if draft is not None and not spec.draft_model_path:
        spec = SpecConfig(**{**spec.__dict__, "draft_model_path": draft.source})
    spec = validate_spec(spec)
    if spec.algorithm == "NONE":
        return NoProposer()
    module, cls = PROPOSERS[spec.algorithm].split(":")
    return getattr(importlib.import_module(module), cls).build(spec, target, draft)
