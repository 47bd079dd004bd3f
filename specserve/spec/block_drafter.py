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
planner (default) or a survival threshold (spec/budget.py)."""
from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING

import torch

from specserve import sampling
from specserve.attention.sdpa import AttentionMetadata, SeqSpan
from specserve.config import CacheConfig, SpecConfig
from specserve.kv_pages import KVPool, slots_for
from specserve.models.block_drafter import BlockDrafter, BlockDrafterCheckpoint, load_token_map
from specserve.sampling import Purpose
from specserve.spec.budget import CostTable, plan_budget, plan_threshold
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


class BlockDrafterProposer:
    def __init__(self, drafter: BlockDrafter, gamma: int, cost: CostTable | None = None,
                 threshold: float | None = None) -> None:
        self.drafter = drafter
        self.gamma = gamma
        self.cost = cost                      # DSPARK's budget planner
        self.threshold = threshold            # DSPARK's survival threshold, used instead of the planner
        self.aux_layer_ids = drafter.config.target_layer_ids
        self.kv_geometry = drafter.kv_geometry
        self.pool: KVPool | None = None
        self.num_valid: dict[str, int] = {}   # request id → leading positions whose draft context is written
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
        if threshold is not None:
            if not 0.0 <= threshold <= 1.0:
                raise ValueError(f"--speculative-dspark-confidence-threshold must be in [0, 1], got {threshold}")
            return cls(drafter, gamma, threshold=threshold)
        return cls(drafter, gamma, cost=startup_cost_table(spec, target))

    def attach_pool(self, pool: KVPool) -> None:
        self.pool = pool

    def ready(self, req: Request) -> bool:
        """Whether the draft context holds every token before the anchor, so that a block may run."""
        return self.context_length(req) == req.num_computed_tokens == req.num_tokens - 1

    def context_length(self, req: Request) -> int:
        return self.num_valid.get(req.request_id, req.num_cached_tokens)

    def draft_slots(self, req: Request) -> int:
        return self.gamma if self.ready(req) else 0

    @torch.inference_mode()
    def propose(self, plan: StepPlan) -> Proposal:
        # Never more rows than draft slots: the block's K/V goes to slots the scheduler reserved.
        jobs = [(i, s.request, min(self.gamma, s.max_drafts)) for i, s in enumerate(plan.scheduled)
                if s.samples and s.max_drafts > 0 and self.ready(s.request)]
        if not jobs:
            return Proposal.none(len(plan.scheduled))
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

        windows = [n for *_, n in jobs]
        confidences: list[list[float]] = [[] for _ in jobs]
        if self.drafter.markov:
            prev = [t for (_, req, _), d in zip(jobs, drafts) for t in [req.all_token_ids[-1]] + d[:-1]]
            rows = [k for *_, n in jobs for k in range(n)]
            c = self.drafter.confidence(hidden, torch.tensor(prev), torch.tensor(rows)).tolist()
            confidences = [c[a:b] for a, b in itertools.pairwise(offsets)]
            windows = self._windows(plan, [i for i, *_ in jobs], confidences)

        draft_tokens: list[tuple[int, ...]] = [()] * len(plan.scheduled)
        draft_probs: list[torch.Tensor | None] = [None] * len(plan.scheduled)
        draft_conf: list[tuple[float, ...] | None] = [None] * len(plan.scheduled)
        for (i, _, _), d, q, c, m in zip(jobs, drafts, probs, confidences, windows):
            draft_tokens[i] = tuple(d[:m])
            draft_probs[i] = torch.stack(q[:m]) if q and m else None
            draft_conf[i] = tuple(c[:m]) if self.drafter.markov else None
        return Proposal(tuple(draft_tokens), tuple(draft_probs), tuple(draft_conf))

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
        # Every sampling request of the step emits a token and pays for its fed rows; prefill chunks
        # that do not sample yet only cost time.
        by_index = dict(zip(drafting, confidences))
        sampling_idx = [i for i, s in enumerate(plan.scheduled) if s.samples]
        windows = plan_budget([by_index.get(i, []) for i in sampling_idx], self.cost,
                              [plan.scheduled[i].num_feed for i in sampling_idx],
                              sum(s.num_feed for s in plan.scheduled if not s.samples))
        window_of = dict(zip(sampling_idx, windows))
        return [window_of[i] for i in drafting]

    @torch.inference_mode()
    def commit(self, plan: StepPlan, result: VerifyResult, out: ForwardOutput) -> None:
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
