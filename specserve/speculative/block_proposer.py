"""DFLASH and DSPARK: the block drafter (models/block_drafter.py) as a proposer.

The draft context holds committed tokens only: `commit` keeps the target's hidden states of the tokens a step
committed (the fed tokens and the accepted drafts), and their context K/V is written just before the request's
next block runs, in one batch (the budget planner skips most blocks on text the drafter cannot guess, and a
context write per step cost ~1.4 ms of a ~17 ms SmolLM2 step). A prompt's context is written when it is
prefilled, and the prefix cache keeps only pages whose context is written. A request drafts when its context
reaches its anchor (the last token, whose target KV does not exist yet): then one batched non-causal forward
runs every drafting request's block of gamma slots at positions anchor .. anchor+gamma-1 (one more in DFlash's
layout, below; fewer only where the scheduler reserved fewer), and the rows the window policy asks for are
drafted. The block writes its K/V into those slots of the draft pool; they are past the context, and each becomes
context only when commit overwrites it. The first sampling step after a prefill (or a recompute
after preemption) therefore drafts nothing.

Row k's draft is the target token at anchor + k + 1, so gamma rows give gamma drafts and a verify window of at
most gamma + 1 rows (a drafter in DFlash's layout runs gamma + 1 slots, the anchor's first, which drafts
nothing; its last slot is the verify window's last position, reserved like it). DFLASH verifies all of them;
DSPARK applies its Markov head row by row with the drafted previous token and sizes each window from its
confidences (windows.py: the budget planner by default, which also skips blocks that would not pay, or a
survival threshold). With --speculative-ngram-hybrid, DSPARK also looks up an n-gram continuation per request,
and one after each prefix of its block's drafts, and verifies the one with the largest expected accepted length
(ngram.NgramHybrid); requests whose block may not run yet draft n-grams alone, and a request whose n-gram
continuation promises at least what its block's forecast does (the planner's mean of its blocks so far) skips
the block: the n-gram would win anyway."""
from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

import torch

from specserve import sampling
from specserve.attention.sdpa import AttentionMetadata, SeqSpan
from specserve.config import SpecConfig
from specserve.kv_pages import KVPool, slots_for
from specserve.models.block_drafter import BlockDrafter, BlockDrafterCheckpoint, load_token_map
from specserve.quantization import Int8Linear
from specserve.speculative import CommittedContext, DraftJob
from specserve.speculative.cost_table import resolve_cost_table
from specserve.speculative.ngram import NgramHybrid
from specserve.speculative.windows import AllRows, BudgetPlanner, Candidate, Threshold, WindowPolicy, expected_accepted
from specserve.types import Proposal, Request, ScheduledRequest, StepPlan, VerifyResult

if TYPE_CHECKING:
    from specserve.loader import LoadedCheckpoint
    from specserve.runner import ForwardOutput
    from specserve.speculative import TargetInfo


class BlockDrafterProposer(CommittedContext):
    def __init__(self, drafter: BlockDrafter, gamma: int, policy: WindowPolicy | None = None,
                 hybrid: NgramHybrid | None = None) -> None:
        self.drafter = drafter
        self.gamma = gamma
        self.policy = policy or AllRows()
        self.hybrid = hybrid                  # DSPARK's n-gram option
        self.aux_layer_ids = drafter.config.target_layer_ids
        self.kv_geometry = drafter.kv_geometry
        self.pool: KVPool | None = None
        self.num_valid: dict[str, int] = {}   # request id → leading positions whose context is written or kept
        # request id → the first position whose context is not written yet, and the target features of it and the
        # committed tokens after it, one [n, features] part per step
        self.unwritten: dict[str, tuple[int, list[torch.Tensor]]] = {}
        self.pending: dict[str, list[float]] = {}   # request id → confidences of the block drafts verified now
        self.last_context: dict[str, torch.Tensor] = {}   # request id → context vector [hidden] of its last token
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
        gamma = spec.block_size
        if not 1 <= gamma <= ckpt.config.block_size:
            raise ValueError(f"--speculative-block-size must be in [1, {ckpt.config.block_size}] "
                             f"(the drafter's block size), got {gamma}")
        drafter = BlockDrafter(ckpt, target.model, token_map)
        # TorchScript profiles the stack on its first calls: here, not in the first blocks, whose measured time
        # the budget planner takes as what a block costs (15 ms instead of 4 kept SmolLM2's block from running).
        drafter.model.warm_up(drafter.kv_geometry.dtype)
        if spec.algorithm == "DFLASH":
            return cls(drafter, gamma)
        hybrid = NgramHybrid(spec.ngram_min, spec.ngram_max) if spec.ngram_hybrid else None
        if spec.dspark_confidence_threshold is not None:
            return cls(drafter, gamma, Threshold(spec.dspark_confidence_threshold), hybrid)
        block_cost, measured = spec.dspark_block_cost, spec.dspark_block_cost is None
        if measured:
            block_cost = drafter.block_row_weights() / target.model.row_weights()
        elif not block_cost >= 0.0:
            raise ValueError(f"--speculative-dspark-block-cost must be >= 0 (a ratio of times), got {block_cost}")
        planner = BudgetPlanner(resolve_cost_table(spec, target), block_cost, measure_overhead=measured)
        return cls(drafter, gamma, planner, hybrid)

    def attach_pool(self, pool: KVPool) -> None:
        self.pool = pool

    def context_length(self, req: Request) -> int:
        """Leading positions whose draft context is written (what the prefix cache may keep)."""
        _, parts = self.unwritten.get(req.request_id, (0, []))
        return self.accounted_length(req) - sum(len(aux) for aux in parts)

    def draft_slots(self, req: Request) -> int:
        # With the n-gram option a request drafts even before its block may run.
        return self.gamma if self.hybrid is not None or self.ready(req) else 0

    @torch.inference_mode()
    def propose(self, plan: StepPlan) -> Proposal:
        # Never more rows than draft slots: the block's K/V goes to slots the scheduler reserved.
        jobs = [DraftJob(i, s.request, self._slots(s)) for i, s in enumerate(plan.scheduled)
                if s.samples and s.max_drafts > 0 and self.ready(s.request)]
        lookups = self.hybrid.lookups(plan, self.gamma) if self.hybrid is not None else {}
        jobs = [job for job in jobs if not self._ngram_beats_block(job, lookups.get(job.index))]
        jobs = self.policy.worth_drafting(plan, jobs)
        candidates: dict[int, Candidate] = {}     # by plan index
        if jobs:
            start = time.perf_counter()
            written = self.flush_context([job.request for job in jobs])
            flushed = time.perf_counter()
            candidates = self._run_block(plan, jobs)
            # The context a block writes first is part of its cost while it drafts every step (a step's tokens);
            # after skipped steps it catches up on theirs, a price of skipping that the next block does not pay.
            catching_up = written > (self.gamma + 1) * len(jobs)
            self.policy.timed(sum(self._slots(plan.scheduled[job.index]) for job in jobs),
                              time.perf_counter() - (flushed if catching_up else start))
        if self.hybrid is not None:
            self.hybrid.weigh(plan, candidates, lookups)
        if not candidates:
            return Proposal.none(len(plan.scheduled))
        windows = self.policy.windows(plan, candidates)
        draft_tokens: list[tuple[int, ...]] = [()] * len(plan.scheduled)
        draft_probs: list[torch.Tensor | None] = [None] * len(plan.scheduled)
        draft_conf: list[tuple[float, ...] | None] = [None] * len(plan.scheduled)
        for i, (d, q, c, ngram_match, ngram_from) in candidates.items():
            m, req = windows[i], plan.scheduled[i].request
            draft_tokens[i] = tuple(d[:m])
            draft_probs[i] = torch.stack(q[:m]) if q and m else None
            draft_conf[i] = tuple(c[:m]) if c is not None else None
            block_rows = min(m, ngram_from) if ngram_match else m
            if ngram_match and m > block_rows:
                self.hybrid.verifying(req, ngram_match, m - block_rows, block_rows)
            if c is not None and block_rows:
                self.pending[req.request_id] = c[:block_rows]
        return Proposal(tuple(draft_tokens), tuple(draft_probs), tuple(draft_conf))

    def _ngram_beats_block(self, job: DraftJob, ngram: Candidate | None) -> bool:
        """Whether the request's n-gram continuation promises at least what its block's forecast does: the block
        would then only be overhead (the n-gram wins when both run)."""
        if ngram is None:
            return False
        gain = self.policy.forecast_gain(job.request, job.num_drafts)
        return gain is not None and expected_accepted(ngram) >= gain

    def _run_block(self, plan: StepPlan, jobs: list[DraftJob]) -> dict[int, Candidate]:
        """One non-causal forward over every job's block → each job's drafts (and their q and confidences).
        A block runs every slot it may (gamma, bar those the scheduler could not reserve) however few rows the
        job drafts: a drafter trained on whole blocks reads its later slots in its first rows (the shipped one's
        held-out row-0 top-1 is 0.518 over 8 slots, 0.48 over 5 or fewer)."""
        lead = int(self.drafter.config.anchor_slot)         # slots before the first draft row
        tokens, positions, spans, draft_rows, slots = [], [], [], [], []
        for job in jobs:
            req, anchor, n = job.request, job.request.num_tokens - 1, self._slots(plan.scheduled[job.index]) + lead
            draft_rows += range(len(tokens) + lead, len(tokens) + lead + job.num_drafts)
            slots.append(n)
            tokens += [req.all_token_ids[-1]] + [self.drafter.config.mask_token_id] * (n - 1)
            positions += range(anchor, anchor + n)
            spans.append(SeqSpan(req.pages, anchor, n, causal=False))
        meta = AttentionMetadata.for_pool(spans, self.pool)
        anchor_context = None
        if self.drafter.anchor_proj is not None:
            # an anchor at position 0 (a one-token prompt) has no context before it: a zero vector
            none = torch.zeros(self.drafter.config.hidden_size, dtype=self.drafter.hidden_norm.dtype)
            anchor_context = torch.stack([self.last_context.get(job.request.request_id, none)
                                          for job, n in zip(jobs, slots) for _ in range(n)])
        hidden = self.drafter.block_hidden(torch.tensor(tokens), torch.tensor(positions), meta, self.pool,
                                           anchor_context)
        if len(draft_rows) < len(tokens):
            hidden = hidden[draft_rows]
        drafts, probs, confidences = self._draft(jobs, hidden)
        for job, conf in zip(jobs, confidences):
            if conf is not None:
                self.policy.observe(job.request, conf)
        return {job.index: Candidate(d, q, c) for job, d, q, c in zip(jobs, drafts, probs, confidences)}

    def _draft(self, jobs: list[DraftJob], hidden: torch.Tensor,   # [rows, hidden] the jobs' draft rows in turn
               ) -> tuple[list[list[int]], list[list[torch.Tensor]], list[list[float] | None]]:
        """Choose each job's drafts row by row (the Markov head needs the previous row's draft): the
        argmax for greedy requests, else a sample from the drafter's distribution under the request's
        filters, kept over the full target vocabulary (zero outside the token map) as q for the verifier;
        and DSPARK's confidences of them."""
        drafter = self.drafter
        prev = drafter.to_draft[torch.tensor([job.request.all_token_ids[-1] for job in jobs])]   # draft ids
        rows = max(job.num_drafts for job in jobs)
        uniform = all(job.num_drafts == rows for job in jobs)     # then row k of every job is a strided view
        if uniform and all(job.request.params.greedy and not job.request.params.has_penalties for job in jobs):
            # Greedy rows stay tensors to the block's end: not a Python pass over the jobs per row.
            picked, conf = self._greedy_drafts(hidden.view(len(jobs), rows, -1), prev)
            confidences = [None] * len(jobs) if conf is None else conf.tolist()
            return drafter.token_map[picked].tolist(), [[] for _ in jobs], confidences
        offsets = list(itertools.accumulate((j.num_drafts for j in jobs), initial=0))
        logits = drafter.logits(hidden)                                                         # [rows, V_d]
        drafts: list[list[int]] = [[] for _ in jobs]
        probs: list[list[torch.Tensor]] = [[] for _ in jobs]
        first = prev.clone()
        for k in range(rows):
            active = [j for j, job in enumerate(jobs) if job.num_drafts > k]
            scores = logits.view(len(jobs), rows, -1)[:, k] if uniform else logits[[offsets[j] + k for j in active]]
            scores = self._with_markov(scores, prev if uniform else prev[active])
            top = drafter.token_map[sampling.greedy_tokens(scores)].tolist()
            for row, j in enumerate(active):
                req = jobs[j].request
                token = top[row]
                if not req.params.greedy or req.params.has_penalties:
                    token, q = self._choose(req, scores[row], drafts[j])
                    if q is not None:
                        probs[j].append(q)
                drafts[j].append(token)
                prev[j] = drafter.to_draft[token]
        if not drafter.markov:
            return drafts, probs, [None] * len(jobs)
        before = torch.cat([torch.cat([first[j:j + 1], drafter.to_draft[torch.tensor(d[:-1], dtype=torch.long)]])
                            for j, d in enumerate(drafts)])
        rows_of = torch.tensor([k for job in jobs for k in range(job.num_drafts)])
        c = drafter.confidence(hidden, before, rows_of).tolist()
        return drafts, probs, [c[a:b] for a, b in itertools.pairwise(offsets)]

    def _greedy_drafts(self, hidden: torch.Tensor,    # [jobs, rows, hidden] final-normed block rows
                       prev: torch.Tensor             # [jobs] draft ids of the tokens before the first rows
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's argmax after the Markov term of the row before's pick (DSPARK; DFLASH's rows are independent)
        → the picks [jobs, rows] (draft ids) and DSPARK's confidences of them [jobs, rows]. With int8 heads over
        float32 rows, one native op computes the same with the same kernels (BlockDrafter.dspark_greedy)."""
        drafter = self.drafter
        if drafter.native_heads:
            return drafter.dspark_greedy(hidden, prev)
        jobs, rows = hidden.shape[:2]
        logits = drafter.logits(hidden.flatten(0, 1)).view(jobs, rows, -1)
        if not drafter.markov:
            return sampling.greedy_tokens(logits.flatten(0, 1)).view(jobs, rows), None
        if isinstance(drafter.w2, Int8Linear) and logits.dtype == torch.float32:
            picked = torch.ops.specserve.markov_greedy(logits, prev, drafter.w1, drafter.w2.weight, drafter.w2.scale)
        else:
            chain = [prev]
            for k in range(rows):
                chain.append(sampling.greedy_tokens(drafter.markov_logits(chain[-1], logits[:, k])))
            picked = torch.stack(chain[1:], dim=1)
        before = torch.cat([prev[:, None], picked[:, :-1]], dim=1)
        return picked, drafter.confidence(hidden.flatten(0, 1), before.flatten(),
                                          torch.arange(rows).repeat(jobs)).view(jobs, rows)

    def _slots(self, sched: ScheduledRequest) -> int:
        """The draft slots of a request's block: gamma, bar those the scheduler could not reserve."""
        return min(self.gamma, sched.max_drafts)

    def _with_markov(self, logits: torch.Tensor,    # [n, V_d] one row of each job's block
                     prev: torch.Tensor) -> torch.Tensor:   # [n] draft ids of the drafts before them
        return self.drafter.markov_logits(prev, logits) if self.drafter.markov else logits

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
        return sampling.draw_draft(q[0], p.seed, req.num_tokens + len(drafts), self.generator), q[0]

    @torch.inference_mode()
    def commit(self, plan: StepPlan, result: VerifyResult, out: ForwardOutput) -> None:
        if self.hybrid is not None:
            self.hybrid.record(plan, result)
        for s, res in zip(plan.scheduled, result.per_request):
            confidences = self.pending.pop(s.request.request_id, None)
            if confidences is not None and res is not None and not s.request.finished:
                self.policy.verified(s.request, confidences, res.num_accepted)
        rows, kept = [], []
        for s, offset in zip(plan.scheduled, out.token_offsets):
            req = s.request
            # A finished request's pages are gone; a gap in the context would never fill, so such a
            # request stops drafting rather than attend to unwritten KV.
            if req.finished or self.accounted_length(req) != s.start:
                continue
            end = req.num_computed_tokens
            kept.append((req.request_id, len(rows), s.start, end))
            rows += range(offset, offset + end - s.start)
            self.num_valid[req.request_id] = end
        if rows:
            # one copy of the kept rows per step (a slice where they are contiguous: batch 1); a step that skips the
            # block writes nothing else
            pick = slice(rows[0], rows[-1] + 1) if rows[-1] - rows[0] == len(rows) - 1 else rows
            aux = torch.cat([h[pick] for h in out.aux_hidden], dim=-1)
            for rid, first, start, end in kept:
                self.unwritten.setdefault(rid, (start, []))[1].append(aux[first:first + end - start])
        # A prompt's context is written at once: the prefix cache shares a prompt only with its draft context.
        self.flush_context([s.request for s in plan.scheduled if s.start < len(s.request.prompt_token_ids)])

    def flush_context(self, requests: list[Request]) -> int:
        """Write the draft context K/V the requests' kept committed tokens still lack, in one batch → how many
        tokens' context it wrote."""
        parts, positions, slots, last_rows, num_rows = [], [], [], {}, 0
        for req in requests:
            if req.request_id not in self.unwritten:
                continue
            start, kept = self.unwritten.pop(req.request_id)
            end = start + sum(len(aux) for aux in kept)
            parts += kept
            positions.append(torch.arange(start, end))
            slots.append(slots_for(req.pages, start, end, self.pool.page_size))
            num_rows += end - start
            last_rows[req.request_id] = num_rows - 1
        if not parts:
            return 0
        context = self.drafter.write_context(torch.cat(parts), torch.cat(positions), torch.cat(slots), self.pool)
        if self.drafter.anchor_proj is not None:
            self.last_context |= {rid: context[row].clone() for rid, row in last_rows.items()}
        return num_rows

    def release(self, req: Request) -> None:
        self.num_valid.pop(req.request_id, None)
        self.unwritten.pop(req.request_id, None)
        self.pending.pop(req.request_id, None)
        self.last_context.pop(req.request_id, None)
        self.policy.release(req)
        if self.hybrid is not None:
            self.hybrid.release(req)
