"""EAGLE (chain, topk=1): the one-layer head of models/eagle.py drafts K tokens autoregressively.

Draft context: the head's K/V of every committed position, written at commit from the target's real
features (the aux hidden states of that forward, fused). Row p takes token p and the feature of p - 1,
so once every token before the anchor (the last token, whose target KV does not exist yet) is
committed, a request drafts: the anchor row takes the real feature of the last committed token, each
later row the previous draft and the head's own output as its feature. Each of the K rows is one
forward batched over all drafting requests, and writes its K/V before attending to it. Draft rows'
K/V lie past the committed positions; commit overwrites the accepted ones with real features, and
the rest are rewritten by the next propose before any row reads them. The first sampling step after
a prefill (or a recompute after preemption) drafts nothing: its features come from that forward.

K (--speculative-num-draft-tokens, the drafts per step) defaults to 3: every draft row pays the
target's full-vocabulary LM head (on SmolLM2 here a row costs about a fifth of a one-token target
step), so short chains pay off best."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specserve.attention.sdpa import AttentionMetadata, SeqSpan
from specserve.config import SpecConfig
from specserve.kv_pages import KVPool, slots_for
from specserve.models.eagle import EagleCheckpoint, EagleDrafter
from specserve.speculative import CommittedContext, DraftJob
from specserve.speculative.draft_model import choose_drafts
from specserve.types import Proposal, Request, StepPlan, VerifyResult

if TYPE_CHECKING:
    from specserve.loader import LoadedCheckpoint
    from specserve.runner import ForwardOutput
    from specserve.speculative import TargetInfo


class EagleProposer(CommittedContext):
    def __init__(self, drafter: EagleDrafter, num_draft_tokens: int) -> None:
        self.drafter = drafter
        self.k = num_draft_tokens
        self.aux_layer_ids = drafter.config.target_layer_ids
        self.kv_geometry = drafter.kv_geometry
        self.pool: KVPool | None = None
        self.num_valid: dict[str, int] = {}            # request id → leading positions whose draft K/V is written
        self.features: dict[str, torch.Tensor] = {}    # request id → real feature of position num_valid - 1, [hidden]
        # page id → real feature of the page's last position, written with its K/V: a request that
        # starts after a cached prefix takes the feature of the prefix's last token from here
        self.page_features: dict[int, torch.Tensor] = {}
        self.no_feature = drafter.model.embed.new_zeros(drafter.config.hidden_size)   # of position -1
        self.generator = torch.Generator().manual_seed(0)   # for unseeded sampled requests

    @classmethod
    def build(cls, spec: SpecConfig, target: TargetInfo, draft: LoadedCheckpoint | None) -> EagleProposer:
        if draft is not None:
            raise ValueError("--speculative-algorithm EAGLE loads its head from --speculative-draft-model-path "
                             "(an EAGLE folder), not from a language model checkpoint")
        if not spec.draft_model_path:
            raise ValueError("--speculative-algorithm EAGLE needs --speculative-draft-model-path (an EAGLE folder)")
        ckpt = EagleCheckpoint.load(spec.draft_model_path)
        ckpt.validate(target.config)
        drafter = EagleDrafter(ckpt, target.model)
        drafter.model.warm_up(drafter.kv_geometry.dtype)    # TorchScript's profiling calls, before any request
        return cls(drafter, spec.num_draft_tokens)

    def attach_pool(self, pool: KVPool) -> None:
        self.pool = pool

    def draft_slots(self, req: Request) -> int:
        return self.k if self.ready(req) else 0

    @torch.inference_mode()
    def propose(self, plan: StepPlan) -> Proposal:
        jobs = [DraftJob(i, s.request, min(self.k, s.max_drafts)) for i, s in enumerate(plan.scheduled)
                if s.samples and s.max_drafts > 0 and self.ready(s.request)]
        if not jobs:
            return Proposal.none(len(plan.scheduled))
        drafts: list[list[int]] = [[] for _ in plan.scheduled]
        probs: list[list[torch.Tensor]] = [[] for _ in plan.scheduled]   # q rows of sampled requests
        active = jobs
        tokens = [job.request.all_token_ids[-1] for job in jobs]
        features = torch.stack([self.feature(job.request) for job in jobs])
        for r in range(max(job.num_drafts for job in jobs)):
            positions = [job.request.num_tokens - 1 + r for job in active]
            spans = [SeqSpan(job.request.pages, pos, 1) for job, pos in zip(active, positions)]
            meta = AttentionMetadata.for_pool(spans, self.pool)
            predicted, logits = self.drafter.forward(torch.tensor(tokens), features, torch.tensor(positions), meta,
                                                     self.pool)
            choose_drafts(active, logits, drafts, probs, self.generator)
            going = [row for row, job in enumerate(active) if job.num_drafts > r + 1]
            active = [active[row] for row in going]
            tokens = [drafts[job.index][-1] for job in active]
            features = predicted[going]
        return Proposal(tuple(map(tuple, drafts)), tuple(torch.stack(p) if p else None for p in probs))

    @torch.inference_mode()
    def commit(self, plan: StepPlan, result: VerifyResult, out: ForwardOutput) -> None:
        committed: list[tuple[Request, int]] = []   # (request, its first row)
        rows, tokens, positions, slots = [], [], [], []
        for s, offset in zip(plan.scheduled, out.token_offsets):
            req = s.request
            # A finished request's pages are gone; a gap in the context (target KV that came without it)
            # would never fill, so such a request stops drafting rather than attend to unwritten KV.
            if req.finished or self.context_length(req) != s.start:
                continue
            end = req.num_computed_tokens
            committed.append((req, len(rows)))
            rows += range(offset, offset + end - s.start)
            tokens += req.all_token_ids[s.start:end]
            positions += range(s.start, end)
            slots += slots_for(req.pages, s.start, end, self.pool.page_size).tolist()
            self.num_valid[req.request_id] = end
        if not rows:
            return
        fused = self.drafter.fuse([h[rows] for h in out.aux_hidden])   # [len(rows), hidden], position start..end-1
        firsts = [first for _, first in committed]
        # Each row takes the feature of the position before it: this step's, or the one kept from the last.
        previous = fused.roll(1, dims=0)
        previous[firsts] = torch.stack([self.feature(req) for req, _ in committed])
        self.drafter.write_context(torch.tensor(tokens), previous, torch.tensor(positions), torch.tensor(slots),
                                   self.pool)
        last = fused[[first - 1 for first in firsts[1:]] + [len(rows) - 1]]
        for (req, _), feature in zip(committed, last):
            self.features[req.request_id] = feature
        page_size = self.pool.page_size
        for row, (position, slot) in enumerate(zip(positions, slots)):
            if (position + 1) % page_size == 0:
                self.page_features[slot // page_size] = fused[row]

    def feature(self, req: Request) -> torch.Tensor:
        """The real feature of position context_length - 1."""
        if req.request_id in self.features:
            return self.features[req.request_id]
        if req.num_cached_tokens:
            return self.page_features[req.pages[req.num_cached_tokens // self.pool.page_size - 1]]
        return self.no_feature

    def release(self, req: Request) -> None:
        self.num_valid.pop(req.request_id, None)
        self.features.pop(req.request_id, None)
