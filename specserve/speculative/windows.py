"""How many drafts each request verifies (its window): every drafted row (DFLASH), a survival threshold,
or DSPARK's budget planner, which also decides which requests run the block at all.

Survival S_{i,k} = prod_{j<=k} c_{i,j} is the chance that request i's first k drafts are all
accepted. Verifying m extra rows yields τ(m) = N + (sum of the top-m survivals) tokens in expected
value, at the price of one target forward over all rows of the step; `plan_budget` picks the m that
maximises τ(m) / time(rows) from a measured `CostTable`, each row priced by its request's context too.
`plan_threshold` is the simple alternative.

The planner also skips the block for a request whose mean confidences so far would buy no verify row
at this step's cost (at large batch, where extra rows cost as much as they win, the block would only be
overhead), and drafts again to re-measure after PROBE_EVERY steps, then after twice as many each time
the block still does not pay off (back to PROBE_EVERY once it does). Probes fall on multiples of
PROBE_EVERY, so the skipping requests that probe share one block forward."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from specserve.speculative import DraftJob
from specserve.speculative.cost_table import CostTable
from specserve.types import Request, ScheduledRequest, StepPlan


class Candidate(NamedTuple):
    """One request's proposal before its window is sized."""
    drafts: list[int]
    probs: list[torch.Tensor]            # q rows the drafts were sampled from; empty: deterministic
    confidences: list[float] | None      # per-row confidences (DSPARK's, or the n-gram rows' record)
    ngram_match: int = 0                 # the n-gram lookup's match length; 0: the block's drafts
    ngram_from: int = 0                  # with ngram_match: the block's drafts before the n-gram's continuation


class RowMeans:
    """Running mean per draft row (row k: the k+1-th draft of a window), each pulled towards a prior
    as if the prior had been seen `strength` times: how good a proposer has been on one request. The
    default prior is even and weighs two observations."""
    PRIOR, PRIOR_WEIGHT = 0.5, 2.0

    def __init__(self) -> None:
        self.sums: list[float] = []
        self.counts: list[int] = []

    def add(self, values: list[float]) -> None:
        """One observation for each of rows 0 .. len(values) - 1."""
        for k, value in enumerate(values):
            if k == len(self.sums):
                self.sums.append(0.0)
                self.counts.append(0)
            self.sums[k] += value
            self.counts[k] += 1

    def add_verified(self, num_verified: int, num_accepted: int) -> None:
        """A verified window as acceptance observations: each row that was reached (all before it
        accepted) counts 1 if accepted, else 0."""
        accepted = min(num_accepted, num_verified)
        self.add([1.0] * accepted + [0.0] * (accepted < num_verified))

    def means(self, rows: int, prior: float | Sequence[float] = PRIOR, strength: float = PRIOR_WEIGHT) -> list[float]:
        """The estimates of rows 0 .. rows - 1; rows never observed are the prior (row k's, where the prior is a
        list per row: its last value past its end)."""
        priors = [prior] * rows if isinstance(prior, (int, float)) else [prior[min(k, len(prior) - 1)]
                                                                          for k in range(rows)]
        sums, counts = self.sums + [0.0] * rows, self.counts + [0] * rows
        return [(sums[k] + strength * priors[k]) / (counts[k] + strength) for k in range(rows)]


class WindowPolicy(Protocol):
    def worth_drafting(self, plan: StepPlan, jobs: list[DraftJob]) -> list[DraftJob]: ...
    def observe(self, req: Request, confidences: list[float]) -> None: ...   # a block's confidences
    # the accepted drafts a block's first `rows` rows would be expected to give the request, from its blocks so
    # far; None without a forecast
    def forecast_gain(self, req: Request, rows: int) -> float | None: ...
    # the confidences of a block's verified drafts and how many of them were accepted
    def verified(self, req: Request, confidences: list[float], num_accepted: int) -> None: ...
    def windows(self, plan: StepPlan, candidates: dict[int, Candidate]) -> dict[int, int]: ...  # by plan index
    def release(self, req: Request) -> None: ...
    def timed(self, slots: int, seconds: float) -> None: ...   # a block over `slots` slots took `seconds`, wall clock


class AllRows:
    """DFLASH: every request that may draft runs the block, and every drafted row is verified."""

    def worth_drafting(self, plan: StepPlan, jobs: list[DraftJob]) -> list[DraftJob]:
        return jobs

    def observe(self, req: Request, confidences: list[float]) -> None:
        pass

    def forecast_gain(self, req: Request, rows: int) -> float | None:
        return None

    def verified(self, req: Request, confidences: list[float], num_accepted: int) -> None:
        pass

    def windows(self, plan: StepPlan, candidates: dict[int, Candidate]) -> dict[int, int]:
        return {i: len(c.drafts) for i, c in candidates.items()}

    def release(self, req: Request) -> None:
        pass

    def timed(self, slots: int, seconds: float) -> None:
        pass


class Threshold(AllRows):
    """Each window ends before the first survival below `threshold`."""

    def __init__(self, threshold: float) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"--speculative-dspark-confidence-threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    def windows(self, plan: StepPlan, candidates: dict[int, Candidate]) -> dict[int, int]:
        drafting = sorted(candidates)
        return dict(zip(drafting, plan_threshold([candidates[i].confidences for i in drafting], self.threshold)))


class BudgetPlanner:
    """DSPARK's default: windows that maximise expected tokens per second of the step (plan_budget), and
    blocks only for requests whose forecast (the mean of their blocks' confidences so far) pays for them.

    Confidences are the drafter's own claims. Per request and block row, the planner compares the claims of
    the drafts it verified with how many were accepted, and scales later claims down by that ratio (never
    up; two pseudo-observations keep the first blocks at face value): a drafter that is overconfident on a
    request, or on a target other than the one it was calibrated for, stops buying rows that do not pay."""
    PROBE_EVERY, MAX_PROBE_EVERY = 8, 128
    PSEUDO_COUNT = 2.0
    SPARE_ROWS = 2                 # rows drafted past the window a block is expected to need
    OVERHEAD_WEIGHT = 0.2          # of the newest block in the running mean of the measured overhead

    def __init__(self, cost: CostTable, relative_block_cost: float = 0.0, measure_overhead: bool = False) -> None:
        self.cost = cost
        # A block over r rows costs about this fraction of a target forward over r rows (by default the
        # weights a row multiplies through, drafter against target: both stream their weights per step).
        self.relative_block_cost = relative_block_cost
        # With `measure_overhead`, a block also costs what its measured times exceed that estimate by (the
        # drafter's small ops, its context writes and Python: at batch 1 they outweigh its weights).
        self.measure_overhead = measure_overhead
        self.block_overhead: float | None = None   # seconds, a running mean
        self.forecast: dict[str, RowMeans] = {}    # request id → the confidences of its blocks so far
        self.claimed: dict[str, RowMeans] = {}     # request id → confidences of its verified block drafts
        self.held: dict[str, RowMeans] = {}        # request id → acceptance of those drafts (1 or 0)
        self.probe_every: dict[str, int] = {}      # request id → steps between its probes while it skips
        self.reach: dict[str, int] = {}            # request id → its longest recent window, less one per block since
        self.num_steps = 0                         # proposals planned

    def worth_drafting(self, plan: StepPlan, jobs: list[DraftJob]) -> list[DraftJob]:
        """The jobs whose block may pay off: those the planner gives a verify row on their forecast
        confidences, if the rows they win pay for the block's own time too, those without a forecast
        yet, and those due to probe. A job drafted on its forecast drafts the rows that the longer of its
        forecast's window and its recent windows may use, plus SPARE_ROWS (a row not drafted skips the draft
        head, the Markov chain and the confidence head); the others draft all theirs, to measure them. Every
        block still runs all its slots (the jobs' num_drafts as given), and is priced by them."""
        forecast = {j.index: self._calibrated(j.request, self.forecast[j.request.request_id].means(j.num_drafts))
                    for j in jobs if j.request.request_id in self.forecast}
        window_of = self._budget(plan, forecast) if forecast else {}
        must, may = [], []
        for job in jobs:
            i, rid = job.index, job.request.request_id
            every = self.probe_every.get(rid, self.PROBE_EVERY)
            if i in forecast and window_of[i] > 0:
                may.append(job)
            elif i not in forecast or self.num_steps % every == 0:
                must.append(job)
                if i in forecast:
                    self.probe_every[rid] = min(2 * every, self.MAX_PROBE_EVERY)
        if may and not self._pays_off(plan, forecast, window_of, must, may):
            may = []
        for job in may:
            self.probe_every.pop(job.request.request_id, None)
        self.num_steps += 1
        rows = {job.index: max(window_of[job.index], self.reach.get(job.request.request_id, 0)) + self.SPARE_ROWS
                for job in may}
        return sorted(must + [job._replace(num_drafts=min(job.num_drafts, rows[job.index])) for job in may])

    def observe(self, req: Request, confidences: list[float]) -> None:
        # The forecast is the mean over the request's blocks, not its last block: one unsure token must
        # not stop the next block.
        self.forecast.setdefault(req.request_id, RowMeans()).add(confidences)

    def forecast_gain(self, req: Request, rows: int) -> float | None:
        forecast = self.forecast.get(req.request_id)
        return None if forecast is None else sum(survivals(self._calibrated(req, forecast.means(rows))))

    def verified(self, req: Request, confidences: list[float], num_accepted: int) -> None:
        self.reach[req.request_id] = max(len(confidences), self.reach.get(req.request_id, 0) - 1)
        reached = min(num_accepted + 1, len(confidences))      # rows after the first rejection were not judged
        self.claimed.setdefault(req.request_id, RowMeans()).add(confidences[:reached])
        self.held.setdefault(req.request_id, RowMeans()).add_verified(reached, num_accepted)

    def windows(self, plan: StepPlan, candidates: dict[int, Candidate]) -> dict[int, int]:
        confidences = {}
        for i, c in candidates.items():
            # only the block's own rows are its claims; the n-gram rows' are already their record
            block_rows = c.ngram_from if c.ngram_match else len(c.confidences)
            confidences[i] = (self._calibrated(plan.scheduled[i].request, c.confidences[:block_rows])
                              + c.confidences[block_rows:])
        window_of = self._budget(plan, confidences)
        return {i: window_of[i] for i in candidates}

    def release(self, req: Request) -> None:
        for state in (self.forecast, self.claimed, self.held, self.probe_every, self.reach):
            state.pop(req.request_id, None)

    def timed(self, slots: int, seconds: float) -> None:
        if not self.measure_overhead:
            return
        extra = max(0.0, seconds - self.relative_block_cost * self.cost.time(slots))
        last = self.block_overhead
        self.block_overhead = extra if last is None else last + self.OVERHEAD_WEIGHT * (extra - last)

    def block_time(self, slots: int) -> float:
        """Expected seconds of a block over `slots` slots (0: no block)."""
        if not slots:
            return 0.0
        return self.relative_block_cost * self.cost.time(slots) + (self.block_overhead or 0.0)

    def _calibrated(self, req: Request, confidences: list[float]) -> list[float]:
        """Each row's confidence times (accepted + k) / (claimed + k) of the request's verified drafts, capped at 1."""
        claimed, held = self.claimed.get(req.request_id), self.held.get(req.request_id)
        if claimed is None:
            return confidences
        out = []
        for k, c in enumerate(confidences):
            said = claimed.sums[k] if k < len(claimed.sums) else 0.0
            kept = held.sums[k] if k < len(held.sums) else 0.0
            out.append(c * min(1.0, (kept + self.PSEUDO_COUNT) / (said + self.PSEUDO_COUNT)))
        return out

    def _pays_off(self, plan: StepPlan, forecast: dict[int, list[float]], window_of: dict[int, int],
                  must: list[DraftJob], may: list[DraftJob]) -> bool:
        """Whether the `may` jobs' expected accepted drafts outweigh their verify rows and block slots."""
        emitting = sum(s.samples for s in plan.scheduled)
        fed = sum(s.num_feed for s in plan.scheduled)
        gain = sum(sum(survivals(forecast[j.index])[:window_of[j.index]]) for j in may)
        must_slots = sum(j.num_drafts for j in must)
        attention = sum(self.cost.first_row_time(cached_keys(s)) + (s.num_feed - 1) * self.cost.extra_row_time(
            cached_keys(s)) for s in plan.scheduled if s.samples)
        may_attention = sum(window_of[j.index] * self.cost.extra_row_time(cached_keys(plan.scheduled[j.index]))
                            for j in may)
        without = emitting / (self.cost.time(fed) + attention + self.block_time(must_slots))
        with_may = (emitting + gain) / (self.cost.time(fed + sum(window_of[j.index] for j in may))
                                        + attention + may_attention
                                        + self.block_time(must_slots + sum(j.num_drafts for j in may)))
        return with_may > without

    def _budget(self, plan: StepPlan, confidences: dict[int, list[float]]) -> dict[int, int]:
        """The planner's drafts to verify per sampling request (by plan index) of this step, given the
        confidences of those that draft. Every sampling request emits a token and pays for its fed rows;
        prefill chunks that do not sample yet only cost time."""
        sampling_idx = [i for i, s in enumerate(plan.scheduled) if s.samples]
        windows = plan_budget([confidences.get(i, []) for i in sampling_idx], self.cost,
                              [plan.scheduled[i].num_feed for i in sampling_idx],
                              sum(s.num_feed for s in plan.scheduled if not s.samples),
                              [cached_keys(plan.scheduled[i]) for i in sampling_idx])
        return dict(zip(sampling_idx, windows))


def cached_keys(sched: ScheduledRequest) -> int:
    """About how many keys each row of a request's step attends: its context up to the fed tokens."""
    return sched.start + sched.num_feed


def expected_accepted(candidate: Candidate) -> float:
    """The drafts a candidate's whole window is expected to have accepted: the sum of its survivals."""
    return sum(survivals(candidate.confidences))


def survivals(confidences: list[float]) -> list[float]:
    """S_k = c_1 * ... * c_k: the chance that the first k drafts are all accepted."""
    out, s = [], 1.0
    for k, c in enumerate(confidences, 1):
        if not 0.0 <= c <= 1.0:
            raise ValueError(f"draft confidence {k} is {c!r}, must be a probability in [0, 1]")
        s *= c
        out.append(s)
    return out


def pick_order(confidences: list[list[float]], row_seconds: list[float] | None = None) -> list[tuple[float, int, int]]:
    """Every draft as (survival, k, request), best first: by survival per second of its row when
    `row_seconds[i]` prices request i's rows, else by survival. Ties go to the smaller k, so with
    survivals non-increasing along k the top m of this order is a prefix of each request's drafts."""
    price = [1.0] * len(confidences) if row_seconds is None else [max(t, 1e-12) for t in row_seconds]
    ranked = [(s, k, i) for i, conf in enumerate(confidences) for k, s in enumerate(survivals(conf), 1)]
    ranked.sort(key=lambda t: (-t[0] / price[t[2]], t[1], t[2]))
    return ranked


def plan_budget(confidences: list[list[float]], cost: CostTable, base_rows: list[int] | None = None,
                other_rows: int = 0, keys: list[int] | None = None) -> list[int]:
    """Drafts to verify per request, maximising expected tokens per second of the step.

    `confidences[i]` holds request i's per-draft confidences; each request always feeds its
    `base_rows[i]` rows (1: the anchor; a prefill chunk that ends in sampling: the chunk) and
    emits at least one token. `other_rows` are rows of the same forward that emit nothing
    (prefill chunks that do not sample yet): they cost time but add no tokens. Request i's rows
    attend `keys[i]` cached keys (default: the table's context), which the table prices per row."""
    n = len(confidences)
    base = [1] * n if base_rows is None else list(base_rows)
    keys = [0] * n if keys is None else list(keys)
    if len(base) != n or len(keys) != n:
        raise ValueError(f"base_rows has {len(base)} and keys {len(keys)} entries for {n} requests")
    if any(b < 1 for b in base) or other_rows < 0:
        raise ValueError(f"base rows must be >= 1 per request and other rows >= 0, got {base} and {other_rows}")
    fixed_rows = sum(base) + other_rows
    row_attention = [cost.extra_row_time(k) for k in keys]     # seconds each further row of request i adds
    drafts = sum(len(c) for c in confidences)
    table_row = (cost.time(fixed_rows + drafts) - cost.time(fixed_rows)) / max(drafts, 1)   # a row's mean share
    ranked = pick_order(confidences, [table_row + a for a in row_attention])
    attention = sum(cost.first_row_time(k) + (b - 1) * row_attention[i] for i, (k, b) in enumerate(zip(keys, base)))
    expected = float(n)
    best_m, best_rate = 0, expected / (cost.time(fixed_rows) + attention)
    for m, (s, _, i) in enumerate(ranked, 1):
        expected += s
        attention += row_attention[i]
        rate = expected / (cost.time(fixed_rows + m) + attention)
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
