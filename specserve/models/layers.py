"""Building blocks shared by the target model and the drafters: norms, rotary embedding, and the linear
layers: fp32 (oneDNN-prepacked weights; see Linear for why) or int8 (quantization.py). Everything the decoder
layers call is TorchScript-compatible: llama.py scripts the layer stack."""
from typing import Optional, Union

import torch
import torch.nn.functional as F

from specserve.quantization import Int8Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., hidden]; the statistic is taken in float32 at least, as the reference models do
    dtype = x.dtype
    if (dtype == torch.float32 or dtype == torch.float64) and weight.dtype == dtype:
        return F.rms_norm(x, weight.shape, weight, eps)     # one fused kernel instead of six ops
    xf = x if dtype == torch.float64 else x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class Rope:
    """Rotary embedding with the rotate-half layout (Hugging Face's), cos/sin tabulated per position."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().to(device, dtype)      # [max_positions, head_dim]
        self.sin = angles.sin().to(device, dtype)
        self.max_positions = max_positions

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [num_tokens] → cos, sin: [num_tokens, 1, head_dim]
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def transposed(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] → contiguous [in, out]."""
    return weight.t().contiguous()


class Linear(torch.nn.Module):
    """y = x W^T (+ b) for a weight stored [out, in]. In fp32 the weight is prepacked for oneDNN:
    MKL's sgemm is slow for the 4–64 rows of verify windows and batches (a SmolLM2 forward over 9
    rows cost 2.2x one row with it, 1.25x prepacked). `plain_single_row` keeps an [in, out] copy too
    for layers where one row is faster through x @ W (the wide vocabulary projection)."""
    packed: Optional[torch.Tensor]     # declared for TorchScript, which would type a None attribute as NoneType
    plain: Optional[torch.Tensor]

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 plain_single_row: bool = False) -> None:
        super().__init__()
        self.bias = bias
        self.num_weights = weight.numel()
        packed: Optional[torch.Tensor] = None
        if weight.dtype == torch.float32 and weight.is_cpu and torch.backends.mkldnn.is_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 16)
        self.packed = packed
        self.plain = transposed(weight) if packed is None or plain_single_row else None   # [in, out]

    def rows(self, index: torch.Tensor) -> "Linear":
        """The same linear restricted to some output rows (a draft vocabulary's slice of an LM head)."""
        if self.plain is None:
            raise ValueError("this linear keeps no plain copy of its weight to take rows from")
        bias = None if self.bias is None else self.bias[index]
        return Linear(self.plain[:, index].t(), bias, plain_single_row=True)

    def forward(self, x: torch.Tensor,                        # [rows, in] → [rows, out]
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:    # [rows, out], added when given
        plain, packed, bias = self.plain, self.packed, self.bias
        if plain is not None and (packed is None or x.shape[0] <= 2):
            y = x @ plain
            if bias is not None:
                y = y + bias
        else:
            assert packed is not None
            no_scalars = torch.jit.annotate(list[Optional[Union[int, float, complex]]], [])   # the op's Scalar?[]
            y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", no_scalars, "")
        return y if residual is None else residual + y

    def normed(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm(x, norm_weight) W^T (Int8Linear fuses the two)."""
        return self.forward(rms_norm(x, norm_weight, eps))

    def glu(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(silu(gate) * up) W^T (+ residual) for x = [gate | up]: [rows, 2 * in] → [rows, out]."""
        gate, up = x.chunk(2, dim=-1)
        return self.forward(F.silu(gate) * up, residual)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, quantization: str = "none",
                plain_single_row: bool = False) -> Linear | Int8Linear:
    """A linear over `weight` ([out, in]) in the given quantization ("none": the weight's own dtype)."""
    if quantization == "int8":
        return Int8Linear.of(weight, bias)
    return Linear(weight, bias, plain_single_row)
