"""Structured output under speculation: a grammar (any JSON, a JSON schema, a regex or EBNF) compiled by
xgrammar masks the target's logits at every row of a request's verify window.

Before the target runs, each constrained request's matcher walks its drafts: row k's mask is the set of tokens
the grammar allows after drafts 1..k, and the matcher is rolled back when the walk ends (commit advances it by
the tokens actually emitted). A draft the grammar forbids cannot be accepted, so the window is cut there. For
drafts sampled from a distribution q the verifier needs the distribution each kept draft was drawn from: a
draft that the grammar allows is a sample of q restricted to the allowed tokens (q'), and a forbidden one is
replaced by a fresh sample of q' (when q' has mass) and ends the window, so every kept draft is exactly a
sample of q'. The verifier then sees masked logits (p') and q', and its output is distributed as the target
under the grammar; greedy output equals plain decoding under the same grammar.
"""
from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

import torch

from specserve import sampling
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


def constrain(plan: StepPlan, proposal: Proposal, vocab_size: int,
              generator: torch.Generator | None = None) -> tuple[Proposal, torch.Tensor | None]:
    """The proposal with each constrained request's drafts cut (or the first forbidden sampled draft redrawn
    from q') and its draft distributions restricted to the grammar, and the allowed tokens of every verify
    row ([num_rows, vocab] bool, rows as the verifier counts them), or None when no request has a grammar."""
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
        kept = _walk(matcher, sched.request, drafts[i], probs[i], bitmask, vocab_size, generator)
        allowed = unpack(bitmask[:1 + len(kept[0])], vocab_size)
        drafts[i], probs[i] = kept
        if confidences and confidences[i] is not None:
            confidences[i] = confidences[i][:len(kept[0])]
        rows.append(allowed)
    new = Proposal(tuple(drafts), tuple(probs), tuple(confidences))
    return new, torch.cat(rows)


def _walk(matcher, req, drafts: tuple[int, ...], q: torch.Tensor | None,   # q: [>= len(drafts), vocab] or None
          bitmask: torch.Tensor, vocab_size: int,
          generator: torch.Generator | None) -> tuple[tuple[int, ...], torch.Tensor | None]:
    """Fill bitmask row k with what the grammar allows after the first k kept drafts; return the kept drafts
    and their distributions restricted to the grammar. The matcher ends where it started."""
    kept: list[int] = []
    kept_q: list[torch.Tensor] = []
    matcher.fill_next_token_bitmask(bitmask, 0)
    for k, token in enumerate(drafts):
        allowed = unpack(bitmask[k:k + 1], vocab_size)[0]
        redrawn = False
        if q is not None:
            restricted = torch.where(allowed, q[k], 0)
            mass = restricted.sum()
            if mass <= 0:
                break
            restricted = restricted / mass
            if not allowed[token]:
                token = sampling.draw_draft(restricted, req.params.seed, req.num_tokens + k, generator)
                redrawn = True
            kept_q.append(restricted)
        elif not allowed[token]:
            break
        if not matcher.accept_token(token):
            raise RuntimeError(f"grammar matcher refused token {token} that its own mask allowed")
        kept.append(token)
        if matcher.is_terminated():
            break       # a stop token: commit ends the request there, so the next row (left all-allowed) is cut

        matcher.fill_next_token_bitmask(bitmask, k + 1)
        if redrawn:
            break
    if kept:
        matcher.rollback(len(kept))
    kept_probs = torch.stack(kept_q).to(q.dtype) if kept_q else (None if q is None else q[:0])
    return tuple(kept), kept_probs


def masked(logits: torch.Tensor,    # [num_rows, vocab]
           allowed: torch.Tensor    # [num_rows, vocab] bool
           ) -> torch.Tensor:
    return logits.masked_fill(~allowed, float("-inf"))
