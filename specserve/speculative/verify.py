"""The one verifier shared by plain decoding (zero drafts) and every proposer.

Greedy requests keep the longest prefix of drafts equal to the target argmax. Seeded sampled requests
(every sampled request under --speculative-sampling coupled, which gives each a seed at admission) are
verified the same way against the tokens their seed draws: at each window row the target's token is the
winner of an exponential race fixed by (seed, position) (sampling.race_winner, an exact sample of p), and
drafts are kept while they equal those tokens, so the output is the one plain decoding with that seed
produces. Unseeded sampled requests use speculative rejection sampling (accept x when u < p(x)/q(x), else
resample from max(p - q, 0)), which also emits exactly the target distribution and accepts more drafts when
the drafter's q differs from p. Stop conditions are not applied here: commit cuts the emitted tokens.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from specserve import sampling
from specserve.types import Proposal, Request, RequestVerifyResult, StepPlan, VerifyResult


class _Block(NamedTuple):
    """One sampling request's rows in the verify logits: the anchor, then one row per draft."""
    index: int                          # position in the plan
    request: Request
    start: int                          # first row in the logits
    drafts: tuple[int, ...]
    draft_probs: torch.Tensor | None    # [>= len(drafts), vocab]; None: deterministic drafts

    @property
    def end(self) -> int:
        return self.start + 1 + len(self.drafts)


def _accept(u: torch.Tensor, p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:   # [n] each
    """u < p(x)/q(x), written without the division so q(x) = 0 cannot produce nan."""
    return u * q_x < p_x


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:   # [n, vocab] each
    """max(p - q, 0), or p where that is all zero; left unnormalised since sampling normalises."""
    r = (p - q).clamp_min(0.0)
    return torch.where(r.sum(dim=-1, keepdim=True) > 0, r, p)


def verify(
    logits: torch.Tensor,               # [num_rows, vocab]: 1 + num_drafts rows per sampling request
    plan: StepPlan,
    proposal: Proposal,
    generator: torch.Generator | None = None,
    allowed: torch.Tensor | None = None,    # [num_rows, vocab] bool: the tokens grammars allow (grammar.py)
) -> VerifyResult:
    """Tokens are chosen from the penalised logits restricted to `allowed`; logprobs stay the raw model's."""
    blocks = _blocks(plan, proposal)
    num_rows = blocks[-1].end if blocks else 0
    if logits.shape[0] != num_rows:
        raise ValueError(f"verify expected {num_rows} logit rows, got {logits.shape[0]}")
    scores = _penalised(logits, blocks)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    greedy = [b for b in blocks if b.request.params.greedy]
    coupled = [b for b in blocks if not b.request.params.greedy and b.request.params.seed is not None]
    rejection = [b for b in blocks if not b.request.params.greedy and b.request.params.seed is None]
    emitted: dict[int, tuple[int, ...]] = {}
    if greedy:
        emitted |= _verify_greedy(scores, greedy)
    if coupled:
        emitted |= _verify_coupled(scores, coupled)
    if rejection:
        emitted |= _verify_rejection(scores, rejection, generator)
    return VerifyResult(_results(logits, blocks, emitted, len(plan.scheduled)))


def _blocks(plan: StepPlan, proposal: Proposal) -> list[_Block]:
    blocks, row = [], 0
    for i, (sched, drafts, probs) in enumerate(
            zip(plan.scheduled, proposal.draft_tokens, proposal.draft_probs, strict=True)):
        if sched.samples:
            blocks.append(_Block(i, sched.request, row, tuple(drafts), probs))
            row += 1 + len(drafts)
    return blocks


def _penalised(logits: torch.Tensor, blocks: list[_Block]) -> torch.Tensor:
    penalised = [b for b in blocks if b.request.params.has_penalties]
    if not penalised:
        return logits
    scores = logits.clone()
    for b in penalised:
        r = b.request
        scores[b.start:b.end] = sampling.apply_penalties(
            logits[b.start:b.end], r.params, r.prompt_token_ids, r.output_token_ids, b.drafts)
    return scores


def _verify_greedy(scores: torch.Tensor, blocks: list[_Block]) -> dict[int, tuple[int, ...]]:
    top = sampling.greedy_tokens(scores).tolist()
    emitted = {}
    for b in blocks:
        n = 0
        while n < len(b.drafts) and b.drafts[n] == top[b.start + n]:
            n += 1
        emitted[b.index] = b.drafts[:n] + (top[b.start + n],)
    return emitted


def _verify_coupled(
    scores: torch.Tensor,               # [num_rows, vocab] penalised logits
    blocks: list[_Block],
) -> dict[int, tuple[int, ...]]:
    """Each row's token is its seed's race winner at its position; drafts stand while they equal them.
    Races are run row by row and stop at the first mismatch: later rows cannot be emitted."""
    offsets = list(itertools.accumulate((b.end - b.start for b in blocks), initial=0))
    probs = _target_probs(scores, blocks, offsets)                      # [offsets[-1], vocab]
    emitted = {}
    for b, off in zip(blocks, offsets):
        seed, position = b.request.params.seed, b.request.num_tokens
        for j in range(len(b.drafts) + 1):
            token = sampling.race_winner(probs[off + j], seed, position + j)
            if j == len(b.drafts) or b.drafts[j] != token:
                emitted[b.index] = b.drafts[:j] + (token,)
                break
    return emitted


def _verify_rejection(
    scores: torch.Tensor,               # [num_rows, vocab] penalised logits
    blocks: list[_Block],
    generator: torch.Generator | None,
) -> dict[int, tuple[int, ...]]:
    device = scores.device
    offsets = list(itertools.accumulate((b.end - b.start for b in blocks), initial=0))
    probs = _target_probs(scores, blocks, offsets)                      # [offsets[-1], vocab]

    draft_rows, tokens = [], []
    for b, off in zip(blocks, offsets):
        draft_rows += range(off, off + len(b.drafts))
        tokens += b.drafts
    q = _draft_probs(blocks, len(tokens), probs)                        # [num_drafts, vocab]
    tok = torch.tensor(tokens, dtype=torch.long, device=device)
    u = sampling.uniforms(len(tokens), generator).to(device)
    ok = _accept(u, probs[draft_rows, tok], q[torch.arange(len(tokens), device=device), tok]).tolist()

    final_rows, reject_src, reject_dst, num_accepted = [], [], [], []
    d = 0
    for m, (b, off) in enumerate(zip(blocks, offsets)):
        n = 0
        while n < len(b.drafts) and ok[d + n]:
            n += 1
        if n < len(b.drafts):
            reject_src.append(d + n)
            reject_dst.append(m)
        final_rows.append(off + n)
        num_accepted.append(n)
        d += len(b.drafts)
    # The row after the last accepted draft: residual after a rejection, plain p for the bonus.
    final_q = torch.zeros(len(blocks), probs.shape[-1], dtype=probs.dtype, device=device)
    if reject_src:
        final_q[reject_dst] = q[reject_src]
    u = sampling.uniforms(len(blocks), generator).to(device)
    last = sampling.sample(_residual(probs[final_rows], final_q), u).tolist()
    return {b.index: b.drafts[:n] + (t,) for b, n, t in zip(blocks, num_accepted, last)}


def _target_probs(scores: torch.Tensor, blocks: list[_Block], offsets: list[int]) -> torch.Tensor:
    # Requests with the same filters are processed together; usually that is the whole batch.
    groups: dict[tuple, list[int]] = {}
    for m, b in enumerate(blocks):
        p = b.request.params
        groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p), []).append(m)
    probs = torch.empty(offsets[-1], scores.shape[-1], dtype=scores.dtype, device=scores.device)
    for members in groups.values():
        local = [r for m in members for r in range(offsets[m], offsets[m + 1])]
        rows = [r for m in members for r in range(blocks[m].start, blocks[m].end)]
        probs[local] = sampling.process(scores[rows], blocks[members[0]].request.params)
    return probs


def _draft_probs(blocks: list[_Block], num_drafts: int, probs: torch.Tensor) -> torch.Tensor:
    q = torch.zeros(num_drafts, probs.shape[-1], dtype=probs.dtype, device=probs.device)
    given_rows, given, onehot_rows, onehot_tokens = [], [], [], []
    d = 0
    for b in blocks:
        n = len(b.drafts)
        if b.draft_probs is None:
            onehot_rows += range(d, d + n)
            onehot_tokens += b.drafts
        elif n:
            given_rows += range(d, d + n)
            given.append(b.draft_probs[:n])
        d += n
    if given:
        q[given_rows] = torch.cat(given).to(q)
    if onehot_rows:
        q[onehot_rows, onehot_tokens] = 1.0
    return q


def _results(
    logits: torch.Tensor,               # [num_rows, vocab] raw logits
    blocks: list[_Block],
    emitted: dict[int, tuple[int, ...]],
    num_scheduled: int,
) -> tuple[RequestVerifyResult | None, ...]:
    want = [b for b in blocks if _wants_logprobs(b)]
    chosen: list[float] = []
    tops: list[dict[int, float]] = []
    if want:
        rows = [b.start + k for b in want for k in range(len(emitted[b.index]))]
        tokens = torch.tensor([t for b in want for t in emitted[b.index]], device=logits.device)
        num_top = max(b.request.params.top_logprobs for b in want)
        chosen, tops = sampling.logprobs(logits[rows], tokens, num_top)

    results: list[RequestVerifyResult | None] = [None] * num_scheduled
    i = 0
    for b in blocks:
        params, tokens = b.request.params, emitted[b.index]
        lp, top = (), ()
        if _wants_logprobs(b):
            n, k = len(tokens), params.top_logprobs
            lp = tuple(chosen[i:i + n])
            top = tuple(dict(itertools.islice(d.items(), k)) for d in tops[i:i + n]) if k else ()
            i += n
        results[b.index] = RequestVerifyResult(tokens, len(tokens) - 1, lp, top)
    return tuple(results)


def _wants_logprobs(b: _Block) -> bool:
    return b.request.params.logprobs or b.request.params.top_logprobs > 0
