"""int8 linears: per-output-channel 7-bit weights and per-token (per-row) 8-bit activations.

Kernel: our own, `torch.ops.specserve.int8_linear` (native/int8_linear.cpp; its reference is native/ops.py's).
One op per linear takes a row through the layer's RMSNorm or SiLU gating, quantizes it with its own scale
(max|h| / 127), multiplies uint8 activations by int8 weights with exact int32 sums and applies the float scales.
Each row is computed alone in a fixed order, so a row's output is bit-identical in any batch, and speculation
reproduces plain decoding. benchmarks/int8_kernels.py measured the candidates on this project's machines: fbgemm's
dynamic int8 linear (used before, with each row divided by its maximum and two constant columns [1, -1] appended so
that its one scale per call stayed per row) ran a one-row product at about half the speed a memory read allows and
needed nine small ops around it; oneDNN's int8 linear, `torch._int_mm` and torchao's int8 configs were 3-15x slower.

Bits: x86 without VNNI multiplies uint8 activations by int8 weights in pairs summed into int16, which
saturates unless one side gives up a bit (all-ones rows came out 4.5 instead of 576). Activations keep 8 bits
and weights take 7 ([-63, 63] per row): on held-out ShareGPT answers SmolLM2's NLL rose 2.1% over float32
that way, against 6.0% for 7-bit activations with 8-bit weights (the activations' per-token outliers cost more
than the weights' last bit).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from specserve import native
from specserve.native.ops import pack, unpack

if TYPE_CHECKING:
    from specserve.loader import LoadedCheckpoint

QUANTIZATIONS = ("none", "int8")
TINY = torch.finfo(torch.float32).tiny
WEIGHT_MAX = 63            # 7-bit weights: see the module docstring


def served_quantization(requested: str | None, ckpt: LoadedCheckpoint) -> str:
    """--quantization: int8 by default for weights stored quantized (a GGUF's Q4_*, Q8_0, K-quants), else none."""
    quantization = requested or ("int8" if ckpt.quantized else "none")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    return quantization


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float → int8 weights in [-WEIGHT_MAX, WEIGHT_MAX] and one float32 scale per output row."""
    w = weight.to(torch.float32)
    scale = (w.abs().amax(dim=1) / WEIGHT_MAX).clamp_min(TINY)
    return torch.round(w / scale[:, None]).clamp(-WEIGHT_MAX, WEIGHT_MAX).to(torch.int8), scale


class Int8Linear(torch.nn.Module):
    """y = x W^T (+ b) with W as int8 rows and a float32 scale each; x and y in the caller's dtype."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor,    # [out, in] int8, [out] float32
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        native.register()               # forward calls its op, which must exist before a stack is scripted
        self.weight = pack(q)
        self.in_features = q.shape[1]
        self.weight_sum = q.sum(dim=1, dtype=torch.int32)             # takes the activations' offset back out
        self.scale = scale.to(torch.float32)
        self.bias = None if bias is None else bias.to(torch.float32)
        self.num_weights = q.numel()

    @staticmethod
    def of(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        return Int8Linear(*quantize_rows(weight), bias)

    def rows(self, index: torch.Tensor) -> Int8Linear:
        """The same linear restricted to some output rows (a draft vocabulary's slice of an LM head)."""
        q = unpack(self.weight, len(self.scale), self.in_features)[index]
        return Int8Linear(q, self.scale[index], None if self.bias is None else self.bias[index])

    def forward(self, x: torch.Tensor,                        # [rows, in] → [rows, out]
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:    # [rows, out], added when given
        return self.project(x, None, 0.0, False, residual)

    def normed(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm(x, norm_weight) W^T: x [rows, in] → [rows, out]."""
        return self.project(x, norm_weight, eps, False)

    def glu(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(silu(gate) * up) W^T (+ residual) for x = [gate | up]: [rows, 2 * in] → [rows, out]."""
        return self.project(x, None, 0.0, True, residual)

    def project(self, x: torch.Tensor, norm_weight: Optional[torch.Tensor], eps: float, glu: bool,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        if norm_weight is not None and norm_weight.dtype != torch.float32:
            norm_weight = norm_weight.to(torch.float32)
        if x.dtype == torch.float32:
            return torch.ops.specserve.int8_linear(x, norm_weight, eps, glu, self.weight, self.weight_sum,
                                                   self.scale, self.bias, residual)
        y = torch.ops.specserve.int8_linear(x.to(torch.float32), norm_weight, eps, glu, self.weight, self.weight_sum,
                                            self.scale, self.bias, None).to(x.dtype)
        return y if residual is None else residual + y
