"""The target's cost table: seconds per forward against the step's total rows, measured on this machine,
for DSPARK's budget planner (windows.py), and what attention adds per cached key past the table's context (a
sequence's first row reads its keys from memory; each further row of its window scores and weighs them again).
`specserve profile` measures and saves one per model, numerics (dtype and quantization) and thread count; an
engine whose planner needs one uses the saved table, or measures a small one at start."""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tempfile
import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from specserve.attention.sdpa import AttentionMetadata, SeqSpan
from specserve.config import SpecConfig
from specserve.kv_pages import KVPool
from specserve.models.llama import LlamaModel

if TYPE_CHECKING:
    from specserve.speculative import TargetInfo

log = logging.getLogger(__name__)

DEFAULT_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
STARTUP_ROWS = (1, 2, 4, 8, 16, 32)
# Best of this many rounds: on a shared 2-core host a run of a size can be 20-60% slow, and the best of three put
# SmolLM2's 2-row step 0-18% above its 1-row step, which the best of fifteen found equal. Ten cost SmolLM2 ~1 s.
STARTUP_REPEATS = 10


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


@dataclass(frozen=True)
class CostTable:
    """Seconds per target forward against the step's total rows, measured on one machine with `context` keys
    cached per sequence. Between points time is interpolated linearly, beyond the last two extrapolated
    linearly. A sequence with more keys costs `first_row_key_seconds` per key past `context` for its first row
    and `extra_row_key_seconds` per such key for each further row (0 in tables measured without them)."""
    rows: tuple[int, ...]          # strictly increasing, >= 1
    seconds: tuple[float, ...]     # one per row count, > 0, non-decreasing
    model: str = ""
    dtype: str = ""
    cpu: str = field(default_factory=cpu_name)
    threads: int = field(default_factory=torch.get_num_threads)
    context: int = 0
    first_row_key_seconds: float = 0.0
    extra_row_key_seconds: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", tuple(self.rows))
        object.__setattr__(self, "seconds", tuple(float(s) for s in self.seconds))
        rows, seconds = self.rows, self.seconds
        if len(rows) != len(seconds):
            raise ValueError(f"cost table has {len(rows)} row counts but {len(seconds)} timings")
        if len(rows) < 2:
            raise ValueError(f"cost table needs at least two points to tell how cost grows, got {len(rows)}")
        if any(not isinstance(r, int) or r < 1 for r in rows):
            raise ValueError(f"cost table row counts must be integers >= 1, got {list(rows)}")
        if any(b <= a for a, b in zip(rows, rows[1:])):
            raise ValueError(f"cost table row counts must be strictly increasing, got {list(rows)}")
        if any(not math.isfinite(s) or s <= 0 for s in seconds):
            raise ValueError(f"cost table timings must be finite and > 0 seconds, got {list(seconds)}")
        if any(b < a for a, b in zip(seconds, seconds[1:])):
            raise ValueError(f"cost table timings must not fall as rows grow, got {list(seconds)}; "
                             "build measured tables with CostTable.measured")
        if not (isinstance(self.context, int) and self.context >= 0):
            raise ValueError(f"cost table context must be an integer >= 0 keys, got {self.context!r}")
        for name in ("first_row_key_seconds", "extra_row_key_seconds"):
            value = float(getattr(self, name))
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"cost table {name} must be finite and >= 0, got {value!r}")
            object.__setattr__(self, name, value)

    @staticmethod
    def measured(rows: Sequence[int], seconds: Sequence[float], **info) -> CostTable:
        """A monotone table from raw timings. Noise (other processes, page faults) only ever adds
        time, so the true cost at r rows is at most any timing at more rows: each point becomes the
        smallest timing at or after it."""
        order = sorted(range(len(rows)), key=rows.__getitem__)
        lowest = [seconds[i] for i in order]
        for j in range(len(lowest) - 2, -1, -1):
            lowest[j] = min(lowest[j], lowest[j + 1])
        return CostTable(tuple(rows[i] for i in order), tuple(lowest), **info)

    def time(self, rows: int) -> float:
        xs, ys = self.rows, self.seconds
        if rows <= xs[0]:
            return ys[0]
        j = bisect_left(xs, rows)
        if j < len(xs) and xs[j] == rows:
            return ys[j]
        j = min(j, len(xs) - 1)    # past the end: extend the last segment
        x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)

    def first_row_time(self, keys: int) -> float:
        """What a sequence's first row adds to `time` when it attends `keys` cached keys."""
        return self.first_row_key_seconds * max(0, keys - self.context)

    def extra_row_time(self, keys: int) -> float:
        """What each further row of that sequence adds to `time`."""
        return self.extra_row_key_seconds * max(0, keys - self.context)

    def matches(self, model: str, dtype: str) -> bool:
        """Whether this table was measured for this model and dtype on this machine and thread count."""
        return (self.model, self.dtype, self.cpu, self.threads) == (model, dtype, cpu_name(), torch.get_num_threads())

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f, indent=1)
        os.replace(tmp, path)    # atomic: a concurrent engine start never reads half a file

    @staticmethod
    def load(path: str | Path) -> CostTable:
        text = Path(path).read_text()
        try:
            data = json.loads(text)
            return CostTable(rows=data["rows"], seconds=data["seconds"], model=data.get("model", ""),
                             dtype=data.get("dtype", ""), cpu=data.get("cpu", ""), threads=data.get("threads", 0),
                             context=data.get("context", 0),
                             first_row_key_seconds=data.get("first_row_key_seconds", 0.0),
                             extra_row_key_seconds=data.get("extra_row_key_seconds", 0.0))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path} is not a valid cost table ({exc!r}); delete it or run "
                             "`specserve profile`") from exc


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


def numerics(model: LlamaModel) -> str:
    """What a model's timings depend on besides the machine: its dtype, quantization and tensor-parallel ranks
    ("float32-int8", "float32-tp2")."""
    name = str(model.dtype).removeprefix("torch.")
    if model.quantization != "none":
        name += f"-{model.quantization}"
    return name if model.tp_size == 1 else f"{name}-tp{model.tp_size}"


def split_rows(rows: int, window: int) -> list[int]:
    """`rows` dealt as evenly as possible over the fewest sequences with at most `window` rows each."""
    n = math.ceil(rows / window)
    return [rows // n + (j < rows % n) for j in range(n)]


@torch.inference_mode()
def measure_cost_table(model: LlamaModel, pool_page_size: int, rows: Sequence[int] = DEFAULT_ROWS,
                       repeats: int = 3, context: int = 128, window: int = 4, progress: bool = True,
                       kv_dtype: torch.dtype | None = None, long_context: int = 2048) -> CostTable:
    """Best-of-`repeats` seconds of one target step (attention metadata, forward, logits of every row)
    per total row count. The rows are verify windows of up to `window` tokens over sequences that
    have `context` tokens cached each, in a scratch KV pool. One sequence's 1-row and `window`-row steps,
    at `context` and at `long_context` keys, give the per-key terms (none when long_context <= context)."""
    rows = sorted(set(rows))
    if not rows or rows[0] < 1 or repeats < 1 or window < 1 or context < 0:
        raise ValueError(f"profile needs row counts >= 1, repeats >= 1, window >= 1 and context >= 0; got "
                         f"rows={rows}, repeats={repeats}, window={window}, context={context}")
    config = model.config
    context = min(context, config.max_position_embeddings - window)
    long_context = min(long_context, config.max_position_embeddings - window)
    with_keys = long_context > context and window > 1
    pages_per_seq = math.ceil((context + window) / pool_page_size)
    long_pages = math.ceil((long_context + window) / pool_page_size) if with_keys else 0
    max_seqs = math.ceil(rows[-1] / window)
    pool = KVPool(model.kv_geometry(kv_dtype or model.dtype), max_seqs * pages_per_seq + long_pages, pool_page_size)
    generator = torch.Generator().manual_seed(0)

    def step(sizes: list[int], keys: int, first_page: int = 0) -> tuple[list[SeqSpan], torch.Tensor, torch.Tensor]:
        per_seq = math.ceil((keys + window) / pool_page_size)
        spans = [SeqSpan(list(range(first_page + s * per_seq, first_page + (s + 1) * per_seq)), keys, n)
                 for s, n in enumerate(sizes)]
        positions = torch.cat([torch.arange(keys, keys + n) for n in sizes])
        return spans, torch.randint(config.vocab_size, (sum(sizes),), generator=generator), positions

    steps = [step(split_rows(total, window), context) for total in rows]
    if with_keys:    # one sequence: 1 and `window` rows at `context` keys, then at `long_context` keys
        long_at = max_seqs * pages_per_seq
        steps += [step([1], context), step([window], context),
                  step([1], long_context, long_at), step([window], long_context, long_at)]
    # Rounds over all sizes, not repeats of one size in a row: a burst of load from other processes
    # then spoils one run of several sizes instead of every run of one. Round 0 only warms up.
    best = [math.inf] * len(steps)
    with tqdm(total=(repeats + 1) * len(steps), desc="profile", unit="fwd", disable=not progress) as bar:
        for round_ in range(repeats + 1):
            for j, (spans, tokens, positions) in enumerate(steps):
                start = time.perf_counter()
                meta = AttentionMetadata.for_pool(spans, pool)
                hidden, _ = model.forward(tokens, positions, meta, pool)
                model.logits(hidden)
                if round_:
                    best[j] = min(best[j], time.perf_counter() - start)
                bar.update()
    first_key = extra_key = 0.0
    if with_keys:
        one, full, one_long, full_long = best[len(rows):]
        first_key = max(0.0, one_long - one) / (long_context - context)
        extra_key = max(0.0, (full_long - full) - (one_long - one)) / ((window - 1) * (long_context - context))
    return CostTable.measured(rows, best[:len(rows)], model=config.name, dtype=numerics(model), context=context,
                              first_row_key_seconds=first_key, extra_row_key_seconds=extra_key)


def saved_cost_table_path(target: TargetInfo) -> Path | None:
    """Where `specserve profile` saves the table of a target loaded from a file or folder; None for a
    checkpoint built in memory."""
    if not Path(target.source).exists():
        return None
    return default_cost_table_path(model_key(target.source), numerics(target.model))


def resolve_cost_table(spec: SpecConfig, target: TargetInfo) -> CostTable:
    """The table DSPARK's planner uses: --speculative-dspark-cost-table, else the one saved for this
    model here, else a small one measured now."""
    path = spec.dspark_cost_table_path
    if path is None and (saved := saved_cost_table_path(target)) is not None and saved.is_file():
        path = saved
    dtype = numerics(target.model)
    if path is not None:
        table = CostTable.load(path)
        if not table.matches(target.config.name, dtype):
            log.warning("cost table %s was measured for %s %s on %s with %d threads, not for this target here",
                        path, table.model, table.dtype, table.cpu, table.threads)
        return table
    start = time.perf_counter()
    table = measure_cost_table(target.model, target.page_size, rows=STARTUP_ROWS, repeats=STARTUP_REPEATS,
                               progress=False, kv_dtype=target.kv_dtype)
    log.info("measured the target's cost table in %.1f s (rows %s: %s ms; per 1,000 keys past %d: first row "
             "+%.2f ms, each further row +%.2f ms); save one with `specserve profile`",
             time.perf_counter() - start, list(table.rows), [round(s * 1e3, 2) for s in table.seconds],
             table.context, table.first_row_time(table.context + 1000) * 1e3,
             table.extra_row_time(table.context + 1000) * 1e3)
    return table
