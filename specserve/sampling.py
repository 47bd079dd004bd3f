"""Pure functions on logits: penalties, temperature / top-k / top-p / min-p, seeded uniforms,
inverse-CDF sampling and logprobs. Everything works in the dtype of the logits (float32 or float64).

Logprobs are "raw": log_softmax of the target's unpenalised, untempered logits (vLLM's default).
They describe the model rather than the sampler, so they are the same whether a token came from
plain decoding or from speculation, and whatever the request's temperature or filters.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from specserve.types import SamplingParams

_MASK64 = (1 << 64) - 1


class Purpose(enum.IntEnum):
    """Separate random streams per use: a draft must not share its uniform with the verifier's
    accept or resample draw at the same position, or the two would be correlated."""
    ACCEPT = 1
    SAMPLE = 2
    DRAFT = 3


def apply_penalties(
    logits: torch.Tensor,            # [n, vocab]
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    drafts: Sequence[int] = (),
) -> torch.Tensor:                   # [n, vocab], a new tensor unless there is nothing to do
    """Row k is penalised as if drafts[:k] had already been accepted after output_ids.
    repetition_penalty (vLLM/HF) covers prompt + output; frequency/presence (OpenAI) output only."""
    if not params.has_penalties:
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
    # torch.argmax returns the first maximal index: ties go to the lowest id.
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


def seeded_uniform(seed: int, position: int, purpose: Purpose) -> float:
    """A uniform in [0, 1) that depends only on (seed, absolute token position, purpose), so a
    seeded request replays identically whatever its batch and however its steps were split."""
    h = _mix64(_mix64(_mix64(seed & _MASK64) ^ position) ^ int(purpose))
    return (h >> 11) * 2.0**-53


def draw_uniforms(
    seeds: Sequence[int | None],
    positions: Sequence[int],
    purpose: Purpose,
    generator: torch.Generator | None = None,
) -> torch.Tensor:                   # [n] float64
    """One uniform per entry: seeded entries from seeded_uniform, the rest from `generator`
    (the engine's; None means torch's default generator)."""
    u = [seeded_uniform(s, p, purpose) if s is not None else 0.0 for s, p in zip(seeds, positions)]
    out = torch.tensor(u, dtype=torch.float64)
    unseeded = [i for i, s in enumerate(seeds) if s is None]
    if unseeded:
        out[unseeded] = torch.rand(len(unseeded), generator=generator, dtype=torch.float64)
    return out


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
