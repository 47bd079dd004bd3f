"""Structured output under speculation: a grammar (any JSON, a JSON schema, a regex or EBNF) compiled by
xgrammar masks the target's logits at every row of a request's verify window.

Before the target runs, each constrained request's matcher walks its drafts: row k's mask is the set of tokens
the grammar allows after drafts 1..k, and the matcher is rolled back when the walk ends (commit advances it by
the tokens actually emitted). A draft the grammar forbids cannot be accepted, so the window ends there: a
deterministic draft is dropped (the verifier's argmax or race winner could never equal it), a sampled one is
kept as the window's last draft, because speculative sampling is exact for any drafter distribution q only
if a draft drawn from q is verified against q: its sure rejection (p' of it is 0) then samples the residual
max(p' - q, 0). The verifier sees the masked target (p'), so greedy output equals plain decoding under the same
grammar and sampled output is distributed as the target restricted to it.
"""
from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

import torch

from specserve.types import Grammar, Proposal, StepPlan

if TYPE_CHECKING:
    import xgrammar


class GrammarCompiler:
    """Compiles a request's grammar for one tokenizer (compiled grammars are cached by xgrammar)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]) -> None:
        import xgrammar as xgr  # imported here: engines without structured output never pay for it
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)

    def matcher(self, grammar: Grammar) -> xgrammar.GrammarMatcher:
        """A fresh matcher at the start of the grammar; a grammar that does not compile is a ValueError that
        names the parameter."""
        c = self._compiler
        try:
            if grammar.kind in ("json_object", "json_schema"):
                # OpenAI's json_object is any JSON object. One space after separators and no free whitespace:
                # with free whitespace a small model pads its JSON with blank lines.
                schema = grammar.value if grammar.kind == "json_schema" else '{"type": "object"}'
                json.loads(schema)
                compiled = c.compile_json_schema(schema, any_whitespace=False)
            elif grammar.kind == "regex":
                compiled = c.compile_regex(grammar.value)
            else:
                compiled = c.compile_grammar(grammar.value)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"{grammar.param}: not a valid {grammar.kind.replace('_', ' ')}: "
                             f"{error_text(exc)}") from None
        return self._xgr.GrammarMatcher(compiled)


def error_text(exc: Exception) -> str:
    """The first line of an xgrammar error, without its "[time] source.cc:line: " prefix."""
    text = str(exc).strip()
    return re.sub(r"^\[[\d:]+\] \S+: ", "", text.splitlines()[0]) if text else type(exc).__name__


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's token bitmask [rows, ceil(vocab / 32)] int32 → allowed tokens [rows, vocab] bool."""
    bits = torch.arange(32, dtype=torch.int32)
    return ((bitmask[:, :, None] >> bits) & 1).bool().view(bitmask.shape[0], -1)[:, :vocab_size]


def constrain(plan: StepPlan, proposal: Proposal, vocab_size: int) -> tuple[Proposal, torch.Tensor | None]:
    """The proposal with each constrained request's drafts cut where the grammar forbids one, and the allowed
    tokens of every verify row ([num_rows, vocab] bool, rows as the verifier counts them), or None when no
    request has a grammar."""
    if not any(s.samples and s.request.grammar_matcher is not None for s in plan.scheduled):
        return proposal, None
    import xgrammar as xgr
    drafts, probs = list(proposal.draft_tokens), list(proposal.draft_probs)
    confidences = list(proposal.confidences) if proposal.confidences else []
    rows: list[torch.Tensor] = []
    for i, sched in enumerate(plan.scheduled):
        if not sched.samples:
            continue
        matcher = sched.request.grammar_matcher
        if matcher is None:
            rows.append(torch.ones(1 + len(drafts[i]), vocab_size, dtype=torch.bool))
            continue
        bitmask = xgr.allocate_token_bitmask(1 + len(drafts[i]), vocab_size)
        n = _walk(matcher, drafts[i], sampled=probs[i] is not None, bitmask=bitmask)
        drafts[i] = drafts[i][:n]
        if probs[i] is not None:
            probs[i] = probs[i][:n]
        if confidences and confidences[i] is not None:
            confidences[i] = confidences[i][:n]
        rows.append(unpack(bitmask[:1 + n], vocab_size))
    return Proposal(tuple(drafts), tuple(probs), tuple(confidences)), torch.cat(rows)


def _walk(matcher, drafts: tuple[int, ...], sampled: bool, bitmask: torch.Tensor) -> int:
    """Fill bitmask row k with what the grammar allows after drafts 1..k, and return how many drafts to
    verify: up to the first one the grammar forbids, that one included when it was sampled (a sampled draft
    is verified against the distribution it came from, and the verifier's sure rejection then draws from the
    residual; dropping it would bias that row toward p). Rows past the walk stay all-allowed: they are never
    reached. The matcher ends where it started."""
    matcher.fill_next_token_bitmask(bitmask, 0)
    accepted, forbidden = 0, False
    for k, token in enumerate(drafts):
        if not (int(bitmask[k, token >> 5]) >> (token & 31)) & 1:
            forbidden = True
            break
        if not matcher.accept_token(token):
            raise RuntimeError(f"grammar matcher refused token {token} that its own mask allowed")
        accepted += 1
        if matcher.is_terminated():
            break       # a stop token: commit ends the request there
        matcher.fill_next_token_bitmask(bitmask, k + 1)
    if accepted:
        matcher.rollback(accepted)
    return accepted + (forbidden and sampled)
