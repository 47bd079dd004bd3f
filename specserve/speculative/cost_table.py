"""The target's cost table: seconds per forward against the step's total rows, measured on this machine,
for DSPARK's budget planner (windows.py). `specserve profile` measures and saves one per model, numerics
(dtype and quantization) and thread count; an engine whose planner needs one uses the saved table, or
measures a small one at start."""
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
    """Seconds per target forward against the step's total rows, measured on one machine.
    Between points time is interpolated linearly, beyond the last two extrapolated linearly."""
    rows: tuple[int, ...]          # strictly increasing, >= 1
    seconds: tuple[float, ...]     # one per row count, > 0, non-decreasing
    model: str = ""
    dtype: str = ""
    cpu: str = field(default_factory=cpu_name)
    threads: int = field(default_factory=torch.get_num_threads)

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
                             dtype=data.get("dtype", ""), cpu=data.get("cpu", ""), threads=data.get("threads", 0))
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
                       kv_dtype: torch.dtype | None = None) -> CostTable:
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
    pool = KVPool(model.kv_geometry(kv_dtype or model.dtype), max_seqs * pages_per_seq, pool_page_size)
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
                meta = AttentionMetadata.for_pool(spans, pool)
                hidden, _ = model.forward(tokens, positions, meta, pool)
                model.logits(hidden)
                if round_:
                    best[j] = min(best[j], time.perf_counter() - start)
                bar.update()
    return CostTable.measured(rows, best, model=config.name, dtype=numerics(model))


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
    log.info("measured the target's cost table in %.1f s (rows %s: %s ms); save one with `specserve profile`",
             time.perf_counter() - start, list(table.rows), [round(s * 1e3, 2) for s in table.seconds])
    return table
