"""Measure the cost table of a target model on this machine: seconds per forward against total rows,
for the verify-window planner (spec/budget.py). `specserve profile` saves one; an engine that needs
one and finds none measures a small one at startup."""
from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.attention.sdpa import AttentionMetadata, SeqSpan
from specserve.kv_pages import KVGeometry, KVPool
from specserve.models.llama import LlamaModel
from specserve.spec.budget import CostTable

DEFAULT_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
STARTUP_ROWS = (1, 2, 4, 8, 16, 32)


def profiles_root() -> Path:
    return Path(os.environ.get("SPECSERVE_CACHE") or Path.home() / ".cache" / "specserve") / "profiles"


def model_key(model_path: str | None) -> str:
    """A stable name for a model's profile: a GGUF file by content, a folder by its resolved path."""
    from specserve.loader import resolve_model_path
    from specserve.loader.cache import file_sha256

    path = Path(resolve_model_path(model_path))
    digest = file_sha256(path) if path.is_file() else hashlib.sha256(str(path).encode()).hexdigest()
    return f"{path.stem}-{digest[:16]}"


def default_cost_table_path(model: str, dtype: str | torch.dtype, threads: int | None = None) -> Path:
    """Where the table of `model` (a `model_key` or a name) lives; timings depend on the thread count."""
    dtype = str(dtype).removeprefix("torch.")
    threads = threads or torch.get_num_threads()
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model)
    return profiles_root() / f"{safe}-{dtype}-t{threads}.json"


def split_rows(rows: int, window: int) -> list[int]:
    """`rows` dealt as evenly as possible over the fewest sequences with at most `window` rows each."""
    n = math.ceil(rows / window)
    return [rows // n + (j < rows % n) for j in range(n)]


@torch.inference_mode()
def measure_cost_table(model: LlamaModel, pool_page_size: int, rows: Sequence[int] = DEFAULT_ROWS,
                       repeats: int = 3, context: int = 128, window: int = 4,
                       progress: bool = True) -> CostTable:
    """Best-of-`repeats` seconds of one target step (attention metadata, forward, logits of every row)
    per total row count. The rows are verify windows of up to `window` tokens over sequences that
    have `context` tokens cached each, in a scratch KV pool."""
    rows = sorted(set(rows))
    if not rows or rows[0] < 1 or repeats < 1 or window < 1 or context < 0:
        raise ValueError(f"profile needs row counts >= 1, repeats >= 1, window >= 1 and context >= 0; got "
                         f"rows={rows}, repeats={repeats}, window={window}, context={context}")
    config = model.config
    context = min(context, config.max_position_embeddings - window)
    pages_per_seq = math.ceil((context + window) / pool_page_size)
    max_seqs = math.ceil(rows[-1] / window)
    pool = KVPool(KVGeometry.of(config, model.dtype), max_seqs * pages_per_seq, pool_page_size)
    generator = torch.Generator().manual_seed(0)
    steps = []
    for total in rows:
        sizes = split_rows(total, window)
        spans = [SeqSpan(list(range(s * pages_per_seq, (s + 1) * pages_per_seq)), context, n)
                 for s, n in enumerate(sizes)]
        positions = torch.cat([torch.arange(context, context + n) for n in sizes])
        steps.append((spans, torch.randint(config.vocab_size, (total,), generator=generator), positions))
    # Rounds over all sizes, not repeats of one size in a row: a burst of load from other processes
    # then spoils one run of several sizes instead of every run of one. Round 0 only warms up.
    best = [math.inf] * len(rows)
    with tqdm(total=(repeats + 1) * len(rows), desc="profile", unit="fwd", disable=not progress) as bar:
        for round_ in range(repeats + 1):
            for j, (spans, tokens, positions) in enumerate(steps):
                start = time.perf_counter()
                meta = AttentionMetadata.build(spans, pool_page_size, pool.null_slot)
                hidden, _ = model.forward(tokens, positions, meta, pool)
                model.logits(hidden)
                if round_:
                    best[j] = min(best[j], time.perf_counter() - start)
                bar.update()
    return CostTable.measured(rows, best, model=config.name, dtype=str(model.dtype).removeprefix("torch."))


def add_profile_args(parser: argparse.ArgumentParser) -> None:
    from specserve.cli import ENGINE_FLAGS

    for flag in ("--model-path", "--dtype", "--threads", "--page-size"):
        dest, typ, default, help_text = ENGINE_FLAGS[flag]
        parser.add_argument(flag, dest=dest, type=typ, default=default, help=help_text)
    parser.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS),
                        help="total rows per forward to time")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row count (the best is kept)")
    parser.add_argument("--context", type=int, default=128, help="tokens cached per sequence")
    parser.add_argument("--window", type=int, default=4, help="verify rows per sequence")
    parser.add_argument("--out", default=None,
                        help="output JSON (default: profiles/ in $SPECSERVE_CACHE or ~/.cache/specserve)")


def cmd_profile(args: argparse.Namespace) -> int:
    from specserve.engine import LLM

    # One page suffices: the engine's own pool is unused, measurement builds a scratch pool.
    engine = LLM(args.model_path, dtype=args.dtype, num_threads=args.num_threads, page_size=args.page_size,
                 num_pages=1).engine
    table = measure_cost_table(engine.model, args.page_size, rows=args.rows, repeats=args.repeats,
                               context=args.context, window=args.window)
    out = Path(args.out) if args.out else default_cost_table_path(model_key(args.model_path), args.dtype)
    table.save(out)
    print(f"{table.model} {table.dtype}, {table.threads} threads, {table.cpu}")
    for rows, seconds in zip(table.rows, table.seconds):
        print(f"{rows:5d} rows {seconds * 1e3:9.2f} ms {seconds / table.seconds[0]:6.2f}x")
    print(f"saved {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve profile", description=__doc__)
    add_profile_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    return cmd_profile(args)


if __name__ == "__main__":
    sys.exit(main())
