"""Pure functions on logits: penalties, temperature / top-k / top-p / min-p, sampling and logprobs.
Everything works in the dtype of the logits (float32 or float64).

Two ways to draw a token from probabilities p:
- seeded (coupled): the token is argmax_v p(v) / E(v), E(v) i.i.d. Exp(1) "arrival times" that are a pure
  function of (seed, absolute position) — the Gumbel-max trick written as an exponential race (-log E is a
  Gumbel). It is an exact sample of p, and a drafter that draws argmax q(v) / E(v) with the same times agrees
  with the target as often as the race lets it, so verification can keep exactly the tokens plain decoding
  with that seed would have drawn, whatever the batch, drafter or window.
- unseeded: inverse CDF with one uniform from the engine's generator.

Logprobs are "raw": log_softmax of the target's unpenalised, untempered logits (vLLM's default).
They describe the model rather than the sampler, so they are the same whether a token came from
plain decoding or from speculation, and whatever the request's temperature or filters.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve import native
from specserve.types import SamplingParams

_MASK64 = (1 << 64) - 1


def apply_penalties(
    logits: torch.Tensor,            # [n, vocab]
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    drafts: Sequence[int] = (),
) -> torch.Tensor:                   # [n, vocab], a new tensor unless there is nothing to do
    """Row k is penalised as if drafts[:k] had already been accepted after output_ids.
    The logit bias is added first (as vLLM does); repetition_penalty (vLLM/HF) covers prompt + output,
    frequency/presence (OpenAI) output only."""
    if not params.has_penalties:
        return logits
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        logits = logits.clone()
        logits[:, list(ids)] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)
    if params.repetition_penalty == 1.0 and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0:
        return logits
    n, vocab = logits.shape
    device = logits.device
    counts = torch.zeros(n, vocab, dtype=logits.dtype, device=device)
    counts[0] = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long, device=device),
                               minlength=vocab).to(logits.dtype)
    counts[torch.arange(1, n, device=device),
           torch.tensor(list(drafts[: n - 1]), dtype=torch.long, device=device)] = 1
    counts = counts.cumsum(0)
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        seen[:, torch.tensor(list(prompt_ids), dtype=torch.long, device=device)] = True
        rp = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:   # [n, vocab] -> [n]
    # The first maximal index (ties go to the lowest id, a NaN counts as maximal), as torch.argmax; float32 rows take
    # the native op, ~10x faster than torch's argmax, which does not vectorise.
    if logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1] and native.register():
        return torch.ops.specserve.argmax_rows(logits)
    return logits.argmax(dim=-1)


def process(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The exact distribution a token is drawn from: [n, vocab] logits -> [n, vocab] probs, zero
    outside the kept set. Order as vLLM: temperature, top-k, top-p, min-p. Greedy is one-hot."""
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, greedy_tokens(logits)[:, None], 1.0)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = _top_p(logits, params.top_p)
    probs = logits.softmax(dim=-1)
    if params.min_p > 0.0:
        floor = params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    # Drop the longest run of least likely tokens whose mass is <= 1 - top_p; the top one stays.
    sorted_logits, order = logits.sort(dim=-1)
    drop = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - top_p
    drop[:, -1] = False
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def _mix64(x: int) -> int:
    # splitmix64 finaliser: a cheap, well-spread 64-bit hash.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def arrival_times(seed: int, position: int, vocab: int) -> torch.Tensor:   # [vocab] float32
    """i.i.d. Exp(1) times, one per token, that depend only on (seed, absolute token position)."""
    generator = torch.Generator().manual_seed(_mix64(_mix64(seed & _MASK64) ^ position))
    return torch.rand(vocab, generator=generator).log_().neg_()


def race_winner(probs: torch.Tensor, seed: int, position: int) -> int:   # probs: [vocab]
    """The token whose probability over its arrival time is largest: an exact sample of `probs` (which
    need not be normalised), fixed by (seed, position)."""
    return int((probs / arrival_times(seed, position, probs.shape[-1]).to(probs.dtype)).argmax())


def draw_draft(q: torch.Tensor, seed: int | None, position: int,   # q: [vocab]
               generator: torch.Generator | None = None) -> int:
    """A drafter's token from its distribution q: a seeded request's race winner with the times the verifier
    will use at this position (so the draft is the target's token whenever the race lets them agree), else
    an inverse-CDF sample with a uniform from `generator`."""
    if seed is not None:
        return race_winner(q, seed, position)
    return int(sample(q[None], uniforms(1, generator))[0])


def uniforms(n: int, generator: torch.Generator | None = None) -> torch.Tensor:   # [n] float64
    """Uniforms for unseeded requests, from the engine's generator (None: torch's default one)."""
    return torch.rand(n, generator=generator, dtype=torch.float64)


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:   # [n, vocab], [n] -> [n]
    """Inverse CDF with one uniform per row; rows need not be normalised."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = (u.to(torch.float64) * cdf[:, -1])[:, None]
    ids = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # Rounding can push the target past the last positive entry; clamp to it.
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.uint8).argmax(dim=-1)
    return torch.minimum(ids, last)


def logprobs(
    logits: torch.Tensor,            # [n, vocab] raw target logits
    token_ids: torch.Tensor,         # [n]
    num_top: int = 0,
) -> tuple[list[float], list[dict[int, float]]]:
    """Raw logprob of each token and the `num_top` most likely tokens of its row, best first."""
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp.gather(-1, token_ids[:, None]).squeeze(-1).tolist()
    if num_top <= 0:
        return chosen, [{} for _ in chosen]
    values, ids = lp.topk(num_top, dim=-1)
    return chosen, [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
