"""The row-invariant attention kernel alone (native/rows.cpp) on SmolLM2-135M's shapes (9 query heads, 3 KV heads of
64, 30 layers): microseconds a layer for one decode row and for an 8-row verify window of one sequence at a long
context, float16 against int8 K/V, 1 and 2 threads, side by side in one run. "memory": each call reads the next
layer's pools (30 layers' K/V, more than the caches hold, as in a decode step); "cache": one layer's pools again and
again. Each figure is the best of several rounds, the configurations in turns so that all see the same host.
Writes benchmarks/results/attention.json.

    .venv/bin/python benchmarks/attention.py [--keys 4000] [--rounds 5]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_result  # noqa: E402
from specserve import native  # noqa: E402
from specserve.native import hugepages, ops  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30
DTYPES = {"float16": torch.float16, "int8": torch.int8}


def layer_pools(keys: int, dtype: torch.dtype, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K and V pools in huge pages, as the engine allocates them, `keys` slots each."""
    pools = []
    for _ in range(LAYERS):
        pair = []
        for _ in range(2):
            values = ops.to_pool(torch.randn(keys, KV_HEADS, HEAD_DIM, generator=gen), dtype)
            pool = hugepages.zeros(values.numel(), dtype).view(values.shape)
            pool.copy_(values)
            pair.append(pool)
        pools.append((pair[0], pair[1]))
    return pools


def time_per_layer(pools, q: torch.Tensor, keys: int, in_cache: bool, seconds: float) -> float:
    """Microseconds a call, over `seconds`: the rows of `q` attend the first `keys` slots of one sequence."""
    rows = len(q)
    row_seq = torch.zeros(rows, dtype=torch.long)
    row_len = torch.arange(keys - rows + 1, keys + 1)
    seq_slots = torch.arange(keys)[None]
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for layer in range(LAYERS):
            k_pool, v_pool = pools[0 if in_cache else layer]
            torch.ops.specserve.paged_attention_rows(q, k_pool, v_pool, row_seq, row_len, seq_slots, 0.125)
        calls += LAYERS
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.4, help="per configuration and round")
    args = parser.parse_args()
    if not native.register():
        sys.exit("the native kernels are not built here (no compiler or no AVX2): nothing to measure")
    gen = torch.Generator().manual_seed(0)
    pools = {name: layer_pools(args.keys, dtype, gen) for name, dtype in DTYPES.items()}
    queries = {rows: torch.randn(rows, HEADS, HEAD_DIM, generator=gen) for rows in (1, 8)}
    configs = [(name, threads, rows, where) for name in DTYPES for threads in (1, 2) for rows in (1, 8)
               for where in ("memory", "cache")]
    best = {c: float("inf") for c in configs}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for name, threads, rows, where in configs:
            torch.set_num_threads(threads)
            us = time_per_layer(pools[name], queries[rows], args.keys, where == "cache", args.seconds)
            best[name, threads, rows, where] = min(best[name, threads, rows, where], us)
    table = {f"{name} {threads}t {rows}row {where}": round(us, 1) for (name, threads, rows, where), us in best.items()}
    for key, us in table.items():
        print(f"{key:28s} {us:8.1f} us/layer")
    summary = {"int8_us_per_layer_2t": table["int8 2t 1row memory"],
               "float16_us_per_layer_2t": table["float16 2t 1row memory"],
               "int8_over_float16_2t": round(best["int8", 2, 1, "memory"] / best["float16", 2, 1, "memory"], 3),
               "int8_verify8_over_1_2t": round(best["int8", 2, 8, "memory"] / best["int8", 2, 1, "memory"], 3),
               "int8_memory_over_cache_2t": round(best["int8", 2, 1, "memory"] / best["int8", 2, 1, "cache"], 3)}
    print(summary)
    path = write_result("attention", summary, {"config": vars(args), "us_per_layer": table,
                                               "shape": {"heads": HEADS, "kv_heads": KV_HEADS,
                                                         "head_dim": HEAD_DIM, "layers": LAYERS}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
