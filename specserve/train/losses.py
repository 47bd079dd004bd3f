"""Block drafter losses (DFLASH, DSPARK) and the confidence calibration.

Each block row k predicts the token at anchor + k + 1. A row is valid while that token lies inside
the sequence, so the valid rows of a block are a prefix. Per valid row the loss mixes cross-entropy
to the target's token with the L1 distance between the draft's and the target's distributions, and
weighs row k by exp(-k / decay): later rows only count when every earlier draft was accepted.
DSPARK's confidence head learns the row's acceptance probability a_k = 1 - ½‖p_draft - p_target‖₁
(what the verifier accepts with when it samples) by binary cross-entropy.

The target's distribution is known on its k likeliest tokens (the feature cache keeps no more), so the
overlap Σ min(p_draft, p_target) that a equals is summed over those: a lower bound, exact when the k
tokens hold all of the target's mass, and k gathered values per row instead of the whole vocabulary."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    dist: float = 0.9
    confidence: float = 1.0
    decay: float = 4.0            # row k weighs exp(-k / decay)


@dataclass(frozen=True)
class TargetTopK:
    ids: torch.Tensor             # [..., k] draft ids of the target's likeliest tokens, -1 outside the draft vocabulary
    probs: torch.Tensor           # [..., k] their target probabilities

    @staticmethod
    def dense(probs: torch.Tensor) -> TargetTopK:
        """A distribution given on the whole draft vocabulary ([..., V_d]) as its own top V_d."""
        return TargetTopK(torch.arange(probs.shape[-1]).expand(probs.shape), probs)


@dataclass(frozen=True)
class LossTerms:
    total: torch.Tensor           # scalar, differentiable
    ce: float
    dist: float                   # mean L1 distance between draft and target distributions
    confidence: float             # BCE of the confidence head (0 without one)
    acceptance: float             # mean a_k over valid rows
    accept_length: float          # expected greedy acceptance length per block: 1 + leading argmax matches
    rows: int                     # valid rows (training throughput counts these)


def row_weights(block_size: int, decay: float) -> torch.Tensor:
    return torch.exp(-torch.arange(block_size, dtype=torch.float64) / decay)          # [G]


def valid_rows(anchors: torch.Tensor, anchor_valid: torch.Tensor,   # [B, A] positions, [B, A] bool
               lengths: torch.Tensor, block_size: int) -> torch.Tensor:   # [B] → [B, A, G] bool
    """Rows whose target token (at anchor + k + 1) lies inside the sequence: a prefix of each block."""
    next_pos = anchors[..., None] + torch.arange(block_size) + 1
    return anchor_valid[..., None] & (next_pos < lengths[:, None, None])


def acceptance(draft_log_probs: torch.Tensor, target: TargetTopK) -> torch.Tensor:
    """a = 1 - ½‖p_d - p_t‖₁ = Σ min(p_d, p_t) over the target's top k tokens, the draft given as log
    probabilities on the draft vocabulary ([..., V_d]; it puts no mass outside it) → [...]"""
    inside = target.ids >= 0
    draft = draft_log_probs.gather(-1, target.ids.clamp_min(0)).exp()             # [..., k]
    return (torch.minimum(draft, target.probs) * inside).sum(-1)


def block_loss(draft_logits: torch.Tensor,     # [N, G, V_d] (Markov term included)
               target: TargetTopK,             # [N, G, k] the target's likeliest tokens
               target_ids: torch.Tensor,       # [N, G] draft id of the true next token, -1 outside the map
               valid: torch.Tensor,            # [N, G] bool, a prefix per block
               confidence_logits: torch.Tensor | None = None,   # [N, G] before the temperature
               weights: LossWeights = LossWeights()) -> LossTerms:
    # bfloat16 logits from autocast are promoted; float64 stays float64 (tests)
    draft_logits = draft_logits.to(torch.promote_types(draft_logits.dtype, torch.float32))
    target = TargetTopK(target.ids, target.probs.to(draft_logits.dtype))
    w = row_weights(valid.shape[1], weights.decay).to(draft_logits) * valid
    total_w = w.sum().clamp_min(1e-12)
    log_probs = draft_logits.log_softmax(-1)
    ce = -log_probs.gather(-1, target_ids.clamp_min(0)[..., None]).squeeze(-1) * (target_ids >= 0)
    a = acceptance(log_probs, target)
    dist = 2 * (1 - a)                                  # = ‖p_d - p_t‖₁
    total = ((weights.ce * ce + weights.dist * dist) * w).sum() / total_w
    bce = torch.zeros(())
    if confidence_logits is not None:
        rows = F.binary_cross_entropy_with_logits(confidence_logits.to(a.dtype), a.detach(), reduction="none")
        bce = (rows * valid).sum() / valid.sum().clamp_min(1)
        total = total + weights.confidence * bce
    with torch.no_grad():
        match = (draft_logits.argmax(-1) == target_ids) & valid
        blocks = valid[:, 0]
        accept_length = 1 + match.long().cumprod(-1).sum(-1)[blocks].double().mean()
        n = valid.sum().clamp_min(1)
        return LossTerms(total, float((ce * w).sum() / total_w), float((dist * w).sum() / total_w), float(bce),
                         float((a * valid).sum() / n), float(accept_length) if blocks.any() else 0.0, int(valid.sum()))


def fit_temperatures(logits: torch.Tensor, targets: torch.Tensor,   # [N, G] confidence logits, soft labels
                     valid: torch.Tensor) -> tuple[float, ...]:     # [N, G] bool → T_k per row
    """Per-row temperatures T_k minimising the held-out BCE of sigmoid(logit / T_k) against the targets
    (temperature scaling). A row without held-out data keeps T = 1."""
    logits, targets, mask = logits.double(), targets.double(), valid.double()
    log_t = torch.zeros(logits.shape[1], dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([log_t], lr=1.0, max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        bce = F.binary_cross_entropy_with_logits(logits / log_t.exp(), targets, reduction="none")
        loss = ((bce * mask).sum(0) / mask.sum(0).clamp_min(1)).sum()     # each row's own mean
        loss.backward()
        return loss

    optimizer.step(closure)
    return tuple(log_t.detach().clamp(-4, 4).exp().tolist())
