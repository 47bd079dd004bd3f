"""int8 linears: per-output-channel 8-bit weights and 8-bit activations with one scale per token (row) and group of
128 inputs.

Kernel: our own, `torch.ops.specserve.int8_linear` (native/int8_linear.cpp; its reference is native/ops.py's).
One op per linear takes a row through the layer's RMSNorm or SiLU gating, quantizes it with its own scales
(max|h| / 127 per group), multiplies int8 activations by int8 weights with exact int32 sums per group and applies
the float scales. Each row is computed alone in a fixed order, so a row's output is bit-identical in any batch, and
speculation reproduces plain decoding. benchmarks/int8_kernels.py measured the candidates on this project's
machines: fbgemm's dynamic int8 linear (used before, with each row divided by its maximum and two constant columns
[1, -1] appended so that its one scale per call stayed per row) ran a one-row product at about half the speed a
memory read allows and needed nine small ops around it; oneDNN's int8 linear, `torch._int_mm` and torchao's int8
configs were 3-15x slower.

Bits, measured as mean NLL on held-out ShareGPT answers against float32 (SmolLM2-135M, 10 answers): 7-bit weights
and one activation scale per row, +2.8%; 8-bit weights and one scale per row, +1.7%; 8-bit weights and a scale per
group of 128, +0.6% (groups of 32: +0.5%). x86 without VNNI sums pairs of uint8 x int8 products into int16 with
saturation; the kernel multiplies |q| by the weight carrying q's sign, which stays below 2 * 127 * 127 < 32767.
Where the CPU has AVX-512 VNNI the weights are packed for its path (16 output channels in the lanes of one register,
four products per lane and instruction, ~3x the multi-row throughput); both paths give the same bits.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from specserve import native
from specserve.native.ops import ACTIVATION_GROUP, pack, unpack

if TYPE_CHECKING:
    from specserve.loader import LoadedCheckpoint

QUANTIZATIONS = ("none", "int8")
TINY = torch.finfo(torch.float32).tiny
WEIGHT_MAX = 127
# What int8 means in numerics, for caches of what an int8 model computes (the training feature cache): the first
# scheme (7-bit weights, one activation scale per row) had none, so its caches do not match this one's.
INT8_SCHEME = f"w8-a8-group{ACTIVATION_GROUP}"


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
        self.weight = pack(q, vnni=native.vnni() and q.is_cpu)
        self.in_features = q.shape[1]
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
            return torch.ops.specserve.int8_linear(x, norm_weight, eps, glu, self.weight, self.scale, self.bias,
                                                   residual)
        y = torch.ops.specserve.int8_linear(x.to(torch.float32), norm_weight, eps, glu, self.weight, self.scale,
                                            self.bias, None).to(x.dtype)
        return y if residual is None else residual + y
