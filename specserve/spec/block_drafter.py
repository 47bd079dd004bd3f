"""DFLASH and DSPARK: the block drafter (models/block_drafter.py) as a proposer.

The draft context holds committed tokens only: `commit` writes the context K/V of the tokens a step
committed (the fed tokens and the accepted drafts) from the target's hidden states of that forward.
A request drafts when its context reaches its anchor (the last token, whose target KV does not exist
yet): then one batched non-causal forward runs every drafting request's block of gamma rows at
positions anchor .. anchor+gamma-1. The block writes its K/V into those slots of the draft pool; they
are past the context, and each becomes context only when commit overwrites it. The first sampling
step after a prefill (or a recompute after preemption) therefore drafts nothing.

Row k's draft is the target token at anchor + k + 1, so gamma rows give gamma drafts and a verify
window of at most gamma + 1 rows. DFLASH verifies all of them; DSPARK applies its Markov head row by
row with the drafted previous token and sizes each window from its confidences, with the budget
planner (default) or a survival threshold (spec/budget.py). The planner also decides who drafts at all:
a request whose mean confidences so far would buy no verify row at this step's cost skips the block
(at large batch, where extra rows cost as much as they win, the block would only be overhead), and
drafts again to re-measure after PROBE_EVERY steps, then after twice as many each time the block still
does not pay off (back to PROBE_EVERY once it does). Probes fall on multiples of PROBE_EVERY, so the
skipping requests that probe share one block forward. With --speculative-ngram-hybrid, DSPARK
also looks up an n-gram continuation per request and verifies it instead when its expected accepted
length is larger (NgramHybrid); requests whose block may not run yet draft n-grams alone."""
from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING, NamedTuple

import torch

from specserve import sampling
from specserve.attention.sdpa import AttentionMetadata, SeqSpan
from specserve.config import CacheConfig, SpecConfig
from specserve.kv_pages import KVPool, slots_for
from specserve.models.block_drafter import BlockDrafter, BlockDrafterCheckpoint, load_token_map
from specserve.sampling import Purpose
from specserve.spec import CommittedContext
from specserve.spec.budget import CostTable, plan_budget, plan_threshold, survivals
from specserve.spec.ngram import prompt_lookup
from specserve.types import Proposal, Request, StepPlan, VerifyResult

if TYPE_CHECKING:
    from specserve.loader import LoadedCheckpoint
    from specserve.runner import ForwardOutput
    from specserve.spec import TargetInfo

log = logging.getLogger(__name__)


def startup_cost_table(spec: SpecConfig, target: TargetInfo) -> CostTable:
    from specserve.profile import STARTUP_ROWS, measure_cost_table

    dtype = str(target.dtype).removeprefix("torch.")
    if spec.dspark_cost_table_path:
        table = CostTable.load(spec.dspark_cost_table_path)
        if not table.matches(target.config.name, dtype):
            log.warning("cost table %s was measured for %s %s on %s with %d threads, not for this target here",
                        spec.dspark_cost_table_path, table.model, table.dtype, table.cpu, table.threads)
        return table
    start = time.perf_counter()
    table = measure_cost_table(target.model, CacheConfig().page_size, rows=STARTUP_ROWS, progress=False)
    log.info("measured the target's cost table in %.1f s (rows %s: %s ms); save one with `specserve profile`",
             time.perf_counter() - start, list(table.rows), [round(s * 1e3, 2) for s in table.seconds])
    return table


class Candidate(NamedTuple):
    """One request's proposal before its window is sized."""
    drafts: list[int]
    probs: list[torch.Tensor]            # q rows the drafts were sampled from; empty: deterministic
    confidences: list[float] | None      # DSPARK's per-row confidences
    from_ngram: bool = False


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

    def means(self, rows: int, prior: float = PRIOR, strength: float = PRIOR_WEIGHT) -> list[float]:
        """The estimates of rows 0 .. rows - 1; rows never observed are the prior."""
        observed = [(total + strength * prior) / (count + strength)
                    for total, count in zip(self.sums[:rows], self.counts[:rows])]
        return observed + [prior] * (rows - len(observed))


class NgramHybrid:
    """DSPARK's n-gram option: per request and step, prompt lookup proposes a continuation too, and
    whichever of the two has the larger expected accepted length (the sum of its survivals) is
    verified. N-gram rows are as confident as the request's own n-gram rows have been (a running
    per-row estimate from an even prior): kept per request, so a seeded request samples the same
    tokens whatever runs beside it."""
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.per_request: dict[str, RowMeans] = {}
        self.pending: dict[str, int] = {}     # request id → n-gram drafts verified in this step

    def lookup(self, req: Request, n: int) -> tuple[list[int], list[float]]:
        drafts = prompt_lookup(req.all_token_ids, self.ngram_min, self.ngram_max, n)
        seen = self.per_request.get(req.request_id) or RowMeans()
        return drafts, seen.means(len(drafts))

    def record(self, plan: StepPlan, result: VerifyResult) -> None:
        for s, res in zip(plan.scheduled, result.per_request):
            rid = s.request.request_id
            verified = self.pending.pop(rid, 0)
            if verified and res is not None and not s.request.finished:
                self.per_request.setdefault(rid, RowMeans()).add_verified(verified, res.num_accepted)

    def release(self, req: Request) -> None:
        self.per_request.pop(req.request_id, None)
        self.pending.pop(req.request_id, None)


class BlockDrafterProposer(CommittedContext):
    PROBE_EVERY, MAX_PROBE_EVERY = 8, 128

    def __init__(self, drafter: BlockDrafter, gamma: int, cost: CostTable | None = None,
                 threshold: float | None = None, hybrid: NgramHybrid | None = None,
                 relative_block_cost: float = 0.0) -> None:
        self.drafter = drafter
        self.gamma = gamma
        self.cost = cost                      # DSPARK's budget planner
        # A block over r rows costs about this fraction of a target forward over r rows (by default the
        # weights a row multiplies through, drafter against target: both stream their weights per step).
        self.relative_block_cost = relative_block_cost
        self.threshold = threshold            # DSPARK's survival threshold, used instead of the planner
        self.hybrid = hybrid                  # DSPARK's n-gram option
        self.aux_layer_ids = drafter.config.target_layer_ids
        self.kv_geometry = drafter.kv_geometry
        self.pool: KVPool | None = None
        self.num_valid: dict[str, int] = {}   # request id → leading positions whose draft context is written
        self.forecast: dict[str, RowMeans] = {}   # request id → the confidences of its blocks so far
        self.num_steps = 0                    # proposals made
        self.probe_every: dict[str, int] = {}  # request id → steps between its probes while it skips the block
        self.generator = torch.Generator().manual_seed(0)   # for unseeded sampled requests

    @classmethod
    def build(cls, spec: SpecConfig, target: TargetInfo, draft: LoadedCheckpoint | None) -> BlockDrafterProposer:
        flag = f"--speculative-algorithm {spec.algorithm}"
        if draft is not None:
            raise ValueError(f"{flag} loads its drafter from --speculative-draft-model-path (a block drafter "
                             "folder), not from a language model checkpoint")
        if not spec.draft_model_path:
            raise ValueError(f"{flag} needs --speculative-draft-model-path (a block drafter folder)")
        ckpt = BlockDrafterCheckpoint.load(spec.draft_model_path)
        token_map = load_token_map(spec.token_map_path) if spec.token_map_path else None
        ckpt.validate(spec.algorithm, target.config, token_map)
        gamma = spec.dspark_block_size
        if not 1 <= gamma <= ckpt.config.block_size:
            raise ValueError(f"--speculative-dspark-block-size must be in [1, {ckpt.config.block_size}] "
                             f"(the drafter's block size), got {gamma}")
        drafter = BlockDrafter(ckpt, target.model, token_map)
        threshold = spec.dspark_confidence_threshold
        if spec.algorithm == "DFLASH":
            return cls(drafter, gamma)
        hybrid = NgramHybrid(spec.ngram_min, spec.ngram_max) if spec.ngram_hybrid else None
        if threshold is not None:
            if not 0.0 <= threshold <= 1.0:
                raise ValueError(f"--speculative-dspark-confidence-threshold must be in [0, 1], got {threshold}")
            return cls(drafter, gamma, threshold=threshold, hybrid=hybrid)
        block_cost = spec.dspark_block_cost
        if block_cost is None:
            block_cost = drafter.block_row_weights() / target.model.row_weights()
        elif not block_cost >= 0.0:
            raise ValueError(f"--speculative-dspark-block-cost must be >= 0 (a ratio of times), got {block_cost}")
        return cls(drafter, gamma, cost=startup_cost_table(spec, target), hybrid=hybrid,
                   relative_block_cost=block_cost)

    def attach_pool(self, pool: KVPool) -> None:
        self.pool = pool

    def draft_slots(self, req: Request) -> int:
        # With the n-gram option a request drafts even before its block may run.
        return self.gamma if self.hybrid is not None or self.ready(req) else 0

    @torch.inference_mode()
    def propose(self, plan: StepPlan) -> Proposal:
        # Never more rows than draft slots: the block's K/V goes to slots the scheduler reserved.
        jobs = [(i, s.request, min(self.gamma, s.max_drafts)) for i, s in enumerate(plan.scheduled)
                if s.samples and s.max_drafts > 0 and self.ready(s.request)]
        if self.cost is not None:
            jobs = self._worth_drafting(plan, jobs)
        self.num_steps += 1
        candidates: dict[int, Candidate] = {}     # by plan index
        if jobs:
            tokens, positions, spans = [], [], []
            for _, req, n in jobs:
                anchor = req.num_tokens - 1
                tokens += [req.all_token_ids[-1]] + [self.drafter.config.mask_token_id] * (n - 1)
                positions += range(anchor, anchor + n)
                spans.append(SeqSpan(req.pages, anchor, n, causal=False))
            meta = AttentionMetadata.build(spans, self.pool.page_size, self.pool.null_slot)
            hidden = self.drafter.block_hidden(torch.tensor(tokens), torch.tensor(positions), meta, self.pool)
            offsets = list(itertools.accumulate((n for *_, n in jobs), initial=0))
            drafts, probs = self._draft(jobs, self.drafter.logits(hidden), offsets)
            confidences: list[list[float] | None] = [None] * len(jobs)
            if self.drafter.markov:
                prev = [t for (_, req, _), d in zip(jobs, drafts) for t in [req.all_token_ids[-1]] + d[:-1]]
                rows = [k for *_, n in jobs for k in range(n)]
                c = self.drafter.confidence(hidden, torch.tensor(prev), torch.tensor(rows)).tolist()
                confidences = [c[a:b] for a, b in itertools.pairwise(offsets)]
                # The forecast is the mean over the request's blocks, not its last block: one unsure
                # token must not stop the next block.
                for (_, req, _), conf in zip(jobs, confidences):
                    self.forecast.setdefault(req.request_id, RowMeans()).add(conf)
            candidates = {i: Candidate(d, q, c) for (i, _, _), d, q, c in zip(jobs, drafts, probs, confidences)}
        if self.hybrid is not None:
            self._weigh_ngrams(plan, candidates)
        if not candidates:
            return Proposal.none(len(plan.scheduled))

        drafting = sorted(candidates)
        windows = [len(candidates[i].drafts) for i in drafting]
        if self.drafter.markov:
            windows = self._windows(plan, drafting, [candidates[i].confidences for i in drafting])
        draft_tokens: list[tuple[int, ...]] = [()] * len(plan.scheduled)
        draft_probs: list[torch.Tensor | None] = [None] * len(plan.scheduled)
        draft_conf: list[tuple[float, ...] | None] = [None] * len(plan.scheduled)
        for i, m in zip(drafting, windows):
            d, q, c, from_ngram = candidates[i]
            draft_tokens[i] = tuple(d[:m])
            draft_probs[i] = torch.stack(q[:m]) if q and m else None
            draft_conf[i] = tuple(c[:m]) if c is not None else None
            if from_ngram and m:
                self.hybrid.pending[plan.scheduled[i].request.request_id] = m
        return Proposal(tuple(draft_tokens), tuple(draft_probs), tuple(draft_conf))

    def _worth_drafting(self, plan: StepPlan, jobs: list[tuple[int, Request, int]]) -> list[tuple[int, Request, int]]:
        """The jobs whose block may pay off: those the planner gives a verify row on their forecast
        confidences, if the rows they win pay for the block's own time too, those without a forecast
        yet, and those due to probe."""
        forecast = {i: self.forecast[req.request_id].means(n) for i, req, n in jobs if req.request_id in self.forecast}
        window_of = self._budget(plan, forecast) if forecast else {}
        must, may = [], []
        for job in jobs:
            i, rid = job[0], job[1].request_id
            every = self.probe_every.get(rid, self.PROBE_EVERY)
            if i in forecast and window_of[i] > 0:
                may.append(job)
            elif i not in forecast or self.num_steps % every == 0:
                must.append(job)
                if i in forecast:
                    self.probe_every[rid] = min(2 * every, self.MAX_PROBE_EVERY)
        if may and not self._pays_off(plan, forecast, window_of, must, may):
            may = []
        for _, req, _ in may:
            self.probe_every.pop(req.request_id, None)
        return sorted(must + may)

    def _pays_off(self, plan: StepPlan, forecast: dict[int, list[float]], window_of: dict[int, int],
                  must: list[tuple[int, Request, int]], may: list[tuple[int, Request, int]]) -> bool:
        """Whether the `may` jobs' expected accepted drafts outweigh their verify rows and block rows."""
        def block_time(rows: int) -> float:
            return self.relative_block_cost * self.cost.time(rows) if rows else 0.0

        emitting = sum(s.samples for s in plan.scheduled)
        fed = sum(s.num_feed for s in plan.scheduled)
        gain = sum(sum(survivals(forecast[i])[:window_of[i]]) for i, _, _ in may)
        must_rows = sum(n for *_, n in must)
        without = emitting / (self.cost.time(fed) + block_time(must_rows))
        with_may = (emitting + gain) / (self.cost.time(fed + sum(window_of[i] for i, _, _ in may))
                                        + block_time(must_rows + sum(n for *_, n in may)))
        return with_may > without

    def _weigh_ngrams(self, plan: StepPlan, candidates: dict[int, Candidate]) -> None:
        """Swap in the n-gram continuation wherever it promises more accepted tokens (or no block ran)."""
        for i, s in enumerate(plan.scheduled):
            if not s.samples or s.max_drafts <= 0:
                continue
            drafts, rates = self.hybrid.lookup(s.request, min(self.gamma, s.max_drafts))
            if not drafts:
                continue
            block = candidates.get(i)
            if block is None or sum(survivals(rates)) > sum(survivals(block.confidences)):
                candidates[i] = Candidate(drafts, [], rates, from_ngram=True)

    def _draft(self, jobs: list[tuple[int, Request, int]], logits: torch.Tensor,   # [rows, V_d]
               offsets: list[int]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        """Choose each job's drafts row by row (the Markov head needs the previous row's draft): the
        argmax for greedy requests, else a sample from the drafter's distribution under the request's
        filters, kept over the full target vocabulary (zero outside the token map) as q for the verifier."""
        drafts: list[list[int]] = [[] for _ in jobs]
        probs: list[list[torch.Tensor]] = [[] for _ in jobs]
        prev = torch.tensor([req.all_token_ids[-1] for _, req, _ in jobs])
        for k in range(max(n for *_, n in jobs)):
            active = [j for j, (*_, n) in enumerate(jobs) if n > k]
            scores = logits[[offsets[j] + k for j in active]]
            if self.drafter.markov:
                scores = scores + self.drafter.markov_logits(prev[active])
            top = self.drafter.token_map[scores.argmax(dim=-1)].tolist()
            for row, j in enumerate(active):
                req = jobs[j][1]
                token = top[row]
                if not req.params.greedy or req.params.has_penalties:
                    token, q = self._choose(req, scores[row], drafts[j])
                    if q is not None:
                        probs[j].append(q)
                drafts[j].append(token)
                prev[j] = token
        return drafts, probs

    def _choose(self, req: Request, scores: torch.Tensor,   # [V_d]
                drafts: list[int]) -> tuple[int, torch.Tensor | None]:
        p = req.params
        full = scores.new_full((len(self.drafter.to_draft),), float("-inf"))
        full[self.drafter.token_map] = scores
        # Penalise as if the drafts so far were accepted, as the verifier will.
        full = sampling.apply_penalties(full[None], p, req.prompt_token_ids, req.output_token_ids + drafts)
        if p.greedy:
            return sampling.greedy_tokens(full).item(), None
        q = sampling.process(full, p)                                   # [1, vocab]
        u = sampling.draw_uniforms([p.seed], [req.num_tokens + len(drafts)], Purpose.DRAFT, self.generator)
        return sampling.sample(q, u).item(), q[0]

    def _windows(self, plan: StepPlan, drafting: list[int], confidences: list[list[float]]) -> list[int]:
        """Drafts to verify per drafting request, from its confidences."""
        if self.threshold is not None:
            return plan_threshold(confidences, self.threshold)
        window_of = self._budget(plan, dict(zip(drafting, confidences)))
        return [window_of[i] for i in drafting]

    def _budget(self, plan: StepPlan, confidences: dict[int, list[float]]) -> dict[int, int]:
        """The planner's drafts to verify per sampling request (by plan index) of this step, given the
        confidences of those that draft. Every sampling request emits a token and pays for its fed rows;
        prefill chunks that do not sample yet only cost time."""
        sampling_idx = [i for i, s in enumerate(plan.scheduled) if s.samples]
        windows = plan_budget([confidences.get(i, []) for i in sampling_idx], self.cost,
                              [plan.scheduled[i].num_feed for i in sampling_idx],
                              sum(s.num_feed for s in plan.scheduled if not s.samples))
        return dict(zip(sampling_idx, windows))

    @torch.inference_mode()
    def commit(self, plan: StepPlan, result: VerifyResult, out: ForwardOutput) -> None:
        if self.hybrid is not None:
            self.hybrid.record(plan, result)
        rows, positions, slots = [], [], []
        for s, offset in zip(plan.scheduled, out.token_offsets):
            req = s.request
            # A finished request's pages are gone; a gap in the context would never fill, so such a
            # request stops drafting rather than attend to unwritten KV.
            if req.finished or self.context_length(req) != s.start:
                continue
            end = req.num_computed_tokens
            rows += range(offset, offset + end - s.start)
            positions += range(s.start, end)
            slots += slots_for(req.pages, s.start, end, self.pool.page_size)
            self.num_valid[req.request_id] = end
        if rows:
            aux = torch.cat([h[rows] for h in out.aux_hidden], dim=-1)
            self.drafter.write_context(aux, torch.tensor(positions), torch.tensor(slots), self.pool)

    def release(self, req: Request) -> None:
        self.num_valid.pop(req.request_id, None)
        self.forecast.pop(req.request_id, None)
        self.probe_every.pop(req.request_id, None)
        if self.hybrid is not None:
            self.hybrid.release(req)
