"""Verify-window sizing from draft confidences (DSPARK).

Survival S_{i,k} = prod_{j<=k} c_{i,j} is the chance that request i's first k drafts are all
accepted. Verifying m extra rows yields τ(m) = N + (sum of the top-m survivals) tokens in expected
value, at the price of one target forward over all rows of the step; `plan_budget` picks the m that
maximises τ(m) / time(rows) from a measured `CostTable`. `plan_threshold` is the simple alternative.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


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
            raise ValueError(f"{path} is not a valid cost table ({exc!r}); delete it or run `specserve profile`") from exc


def survivals(confidences: list[float]) -> list[float]:
    """S_k = c_1 * ... * c_k: the chance that the first k drafts are all accepted."""
    out, s = [], 1.0
    for k, c in enumerate(confidences, 1):
        if not 0.0 <= c <= 1.0:
            raise ValueError(f"draft confidence {k} is {c!r}, must be a probability in [0, 1]")
        s *= c
        out.append(s)
    return out


def pick_order(confidences: list[list[float]]) -> list[tuple[float, int, int]]:
    """Every draft as (survival, k, request), best first. Ties go to the smaller k, so with
    survivals non-increasing along k the top m of this order is a prefix of each request's drafts."""
    ranked = [(s, k, i) for i, conf in enumerate(confidences) for k, s in enumerate(survivals(conf), 1)]
    ranked.sort(key=lambda t: (-t[0], t[1], t[2]))
    return ranked


def plan_budget(confidences: list[list[float]], cost: CostTable, base_rows: list[int] | None = None,
                other_rows: int = 0) -> list[int]:
    """Drafts to verify per request, maximising expected tokens per second of the step.

    `confidences[i]` holds request i's per-draft confidences; each request always feeds its
    `base_rows[i]` rows (1: the anchor; a prefill chunk that ends in sampling: the chunk) and
    emits at least one token. `other_rows` are rows of the same forward that emit nothing
    (prefill chunks that do not sample yet): they cost time but add no tokens."""
    n = len(confidences)
    base = [1] * n if base_rows is None else list(base_rows)
    if len(base) != n:
        raise ValueError(f"base_rows has {len(base)} entries for {n} requests")
    if any(b < 1 for b in base) or other_rows < 0:
        raise ValueError(f"base rows must be >= 1 per request and other rows >= 0, got {base} and {other_rows}")
    ranked = pick_order(confidences)
    fixed_rows = sum(base) + other_rows
    expected = float(n)
    best_m, best_rate = 0, expected / cost.time(fixed_rows)
    for m, (s, _, _) in enumerate(ranked, 1):
        expected += s
        rate = expected / cost.time(fixed_rows + m)
        if rate > best_rate:     # strict: on a tie the fewer rows win
            best_m, best_rate = m, rate
    windows = [0] * n
    for _, _, i in ranked[:best_m]:
        windows[i] += 1
    return windows


def plan_threshold(confidences: list[list[float]], threshold: float) -> list[int]:
    """Drafts to verify per request: each window ends before the first survival below `threshold`."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"confidence threshold must be in [0, 1], got {threshold!r}")
    return [sum(s >= threshold for s in survivals(conf)) for conf in confidences]
