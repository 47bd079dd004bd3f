"""Linear kernels on this machine for SmolLM2-135M's shapes (30 layers of QKV, O, gate/up, down, and the LM head),
side by side in one run: milliseconds per forward's worth of linears at 1..32 rows, and whether a row's result
is bit-identical whatever other rows share the call (what lossless speculation needs). Writes
benchmarks/results/int8_kernels.json; the engine's int8 path (specserve/quantization.py) was picked from this.

    .venv/bin/python benchmarks/int8_kernels.py [--threads 2] [--rows 1 4 8 16 32]
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_result  # noqa: E402
from specserve import native  # noqa: E402
from specserve.native.ops import pack  # noqa: E402
from specserve.quantization import Int8Linear, quantize_rows  # noqa: E402

HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS + [(VOCAB, HIDDEN)]


def kernels(weights: list[torch.Tensor]) -> dict:
    """name → (per-weight state, call(state, x))."""
    warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
    torch.backends.quantized.engine = "fbgemm"
    out = {
        "fp32 oneDNN prepacked": ([torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights],
                                  lambda p, x: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")),
        "fp32 x @ W": ([w.t().contiguous() for w in weights], lambda p, x: x @ p),
        "int8 ours (native kernel, per-token)": ([Int8Linear.of(w) for w in weights], lambda p, x: p(x)),
    }
    quantized = [quantize_rows(w) for w in weights]
    if native.vnni():
        out["int8 ours, AVX2 path (on a VNNI CPU)"] = (
            [(pack(q, vnni=False), s) for q, s in quantized],
            lambda p, x: torch.ops.specserve.int8_linear(x, None, 0.0, False, p[0], p[1], None, None))
    per_channel = [torch._make_per_channel_quantized_tensor(q, s.double(), torch.zeros(len(s), dtype=torch.long), 0)
                   for q, s in quantized]
    padded = [torch._make_per_channel_quantized_tensor(torch.cat([q, q.new_zeros(len(q), 2)], dim=1), s.double(),
                                                       torch.zeros(len(s), dtype=torch.long), 0) for q, s in quantized]

    def fbgemm_per_token(p, x):
        """The previous Int8Linear: each row over its maximum, plus two columns [1, -1] that fix fbgemm's one scale
        per call, so that a row's result does not depend on the batch."""
        peak = x.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-30)
        scaled = torch.cat([x / peak, torch.tensor([[1.0, -1.0]]).expand(len(x), 2)], dim=1)
        return torch.ops.quantized.linear_dynamic(scaled, p, False).mul_(peak)

    out["int8 fbgemm dynamic (per-token, range columns)"] = ([torch.ops.quantized.linear_prepack(w, None)
                                                              for w in padded], fbgemm_per_token)
    out["int8 fbgemm dynamic (per-tensor)"] = ([torch.ops.quantized.linear_prepack(w, None) for w in per_channel],
                                               lambda p, x: torch.ops.quantized.linear_dynamic(x, p, True))
    out["fp16 weights fbgemm"] = ([torch.ops.quantized.linear_prepack_fp16(w, None) for w in weights],
                                  lambda p, x: torch.ops.quantized.linear_dynamic_fp16(x, p))

    def onednn(p, x):
        packed, scale, zeros = p
        peak = x.abs().amax(-1, keepdim=True)
        xq = (torch.round(x * (127 / peak)) + 128).to(torch.uint8)
        y = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 128, packed, scale, zeros, None, 1.0, 0, torch.float32,
                                               "none", [], "")
        return y * (peak / 127)

    out["int8 oneDNN qlinear (per-token)"] = ([(torch.ops.onednn.qlinear_prepack(q, None), s,
                                                torch.zeros(len(s), dtype=torch.int32)) for q, s in quantized], onednn)

    def int_mm(p, x):
        qt, scale = p
        peak = x.abs().amax(-1, keepdim=True)
        return torch._int_mm(torch.round(x * (127 / peak)).to(torch.int8), qt) * scale * (peak / 127)

    out["int8 torch._int_mm (per-token)"] = ([(q.t().contiguous(), s) for q, s in quantized], int_mm)
    return out


def time_forward(state: list, call, rows: int, repeats: int) -> float:
    xs = [torch.randn(rows, w_in) for _, w_in in SHAPES]
    for p, x in zip(state, xs):
        call(p, x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for p, x in zip(state, xs):
            call(p, x)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def row_invariant(state: list, call) -> bool:
    """Whether every row of a 33-row call equals the same row computed alone, on the largest layer shape."""
    p, (_, w_in) = state[2], SHAPES[2]
    x = torch.randn(33, w_in) * torch.rand(33, 1) * 4
    alone = torch.cat([call(p, x[i:i + 1]) for i in range(33)])
    return all(torch.equal(call(p, x[:n]), alone[:n]) for n in (2, 8, 33))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--slow-limit-ms", type=float, default=400.0,
                        help="a kernel slower than this at one row is not timed at more rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [torch.randn(o, i) * i ** -0.5 for o, i in SHAPES]
    results = {}
    for name, (state, call) in tqdm(kernels(weights).items(), desc="kernels"):
        ms = {}
        for rows in args.rows:
            ms[rows] = round(time_forward(state, call, rows, args.repeats), 2)
            if ms[rows] > args.slow_limit_ms:
                break
        results[name] = {"ms": ms, "row_invariant": row_invariant(state, call)}
        print(f"{name:34s} " + " ".join(f"{r}:{t:8.2f}" for r, t in ms.items()) +
              f"  row-invariant {results[name]['row_invariant']}", flush=True)
    ours, fp32 = results["int8 ours (native kernel, per-token)"]["ms"], results["fp32 oneDNN prepacked"]["ms"]
    summary = {"int8_ours_ms_1_row": ours[args.rows[0]], "fp32_ms_1_row": fp32[args.rows[0]],
               "int8_speedup_1_row": round(fp32[args.rows[0]] / ours[args.rows[0]], 2),
               "int8_ours_8_over_1": round(ours.get(8, float("nan")) / ours[args.rows[0]], 3),
               "fbgemm_per_token_over_ours": {r: round(t / ours[r], 2) for r, t in
                                              results["int8 fbgemm dynamic (per-token, range columns)"]["ms"].items()
                                              if r in ours}}
    path = write_result("int8_kernels", summary, {"kernels": results, "config": vars(args)})
    print(summary, f"\nwrote {path}")


if __name__ == "__main__":
    main()
