"""int8 linears: per-output-channel 7-bit weights and per-token (per-row) 8-bit activations.

Kernel: fbgemm's dynamic int8 linear (`quantized::linear_dynamic`), picked by measurement on this
project's machines (benchmarks/int8_kernels.py: ~3x faster than fp32 at one row and nearly flat up to a
verify window; oneDNN's int8 linear, `torch._int_mm` and torchao's int8 configs were 3-15x slower here).
That op quantizes its whole input with one scale, which would make a row's result depend on the other
rows of the batch (and speculation differ from plain decoding). So each row is first divided by its own
absolute maximum, and two constant columns [1, -1] are appended to every row (their weights are zero): every
call then sees the range [-1, 1] and quantizes with the same fixed parameters, whatever the batch holds, and
each output row is multiplied back by its own maximum. The integer products accumulate exactly in int32, so a
row's output is bit-identical in any batch. (Columns rather than one constant row [1, -1, 0, ...]: the same
bits, and 5-10% faster, since fbgemm's cost grows with the rows: a decode step is then one row, not two.)

Bits: x86 without VNNI multiplies uint8 activations by int8 weights in pairs summed into int16, which
saturates unless one side gives up a bit (all-ones rows came out 4.5 instead of 576). Activations keep 8 bits
and weights take 7 ([-63, 63] per row): on held-out ShareGPT answers SmolLM2's NLL rose 2.1% over float32
that way, against 6.0% for 7-bit activations with 8-bit weights (the activations' per-token outliers cost more
than the weights' last bit).
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

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
        torch.backends.quantized.engine = "fbgemm"
        self.q, self.scale = q, scale
        self.bias = None if bias is None else bias.to(torch.float32)
        self.num_weights = q.numel()
        zero_points = torch.zeros(len(scale), dtype=torch.long)
        with warnings.catch_warnings():
            # quantized tensors are deprecated in torch; the pinned 2.13 has them, and fbgemm's packing needs one
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
            padded = torch.cat([q, q.new_zeros(len(q), 2)], dim=1)     # the range columns' zero weights
            weight = torch._make_per_channel_quantized_tensor(padded, scale.double(), zero_points, 0)
        self.packed = torch.ops.quantized.linear_prepack(weight, None)
        self.tiny = TINY                # an attribute: TorchScript reads no module globals
        self.range_columns = torch.tensor([[1.0, -1.0]])

    @staticmethod
    def of(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        return Int8Linear(*quantize_rows(weight), bias)

    def rows(self, index: torch.Tensor) -> Int8Linear:
        """The same linear restricted to some output rows (a draft vocabulary's slice of an LM head)."""
        return Int8Linear(self.q[index], self.scale[index], None if self.bias is None else self.bias[index])

    def forward(self, x: torch.Tensor) -> torch.Tensor:    # [rows, in] → [rows, out]
        # As few ops as possible: at one row each costs about as much as a tenth of the matmul.
        rows = x if x.dtype == torch.float32 else x.to(torch.float32)
        # abs().amax(): vector_norm(inf) gives the same bits but took 43 us on 8 rows here, against 3
        peak = rows.abs().amax(dim=-1, keepdim=True).clamp_min_(self.tiny)
        # reduce_range=False: full 8-bit activations (the 7-bit weights leave no saturation)
        scaled = torch.cat([rows / peak, self.range_columns.expand(rows.shape[0], 2)], dim=1)
        y = torch.ops.quantized.linear_dynamic(scaled, self.packed, False)
        y.mul_(peak)
        bias = self.bias
        if bias is not None:
            y.add_(bias)
        return y if x.dtype == torch.float32 else y.to(x.dtype)
