"""Building blocks shared by the target model and the drafters. Weights are stored [in, out] and
applied as `x @ W`: on this CPU F.linear's [out, in] path is several times slower for 4–32 rows."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., hidden]; the statistic is taken in float32 at least, as the reference models do
    dtype = x.dtype
    xf = x if dtype == torch.float64 else x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class Rope:
    """Rotary embedding with the rotate-half layout (Hugging Face's), cos/sin tabulated per position."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, dtype: torch.dtype) -> None:
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().to(dtype)      # [max_positions, head_dim]
        self.sin = angles.sin().to(dtype)
        self.max_positions = max_positions

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [num_tokens] → cos, sin: [num_tokens, 1, head_dim]
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, heads, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def transposed(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] → contiguous [in, out]."""
    return weight.t().contiguous()
