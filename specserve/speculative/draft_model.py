"""STANDALONE: a small LM with the target's tokenizer drafts K tokens autoregressively on its own KV
pool, which shares the target's page ids. Each step first feeds the drafter every token it has not
seen yet (the whole prompt on a request's first step, afterwards what the verifier emitted), then
drafts one token per forward; each forward batches all drafting requests of the step."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from specserve import sampling
from specserve.attention.sdpa import AttentionMetadata, SeqSpan
from specserve.config import SpecConfig
from specserve.kv_pages import KVGeometry, KVPool
from specserve.loader import LoadedCheckpoint, load_checkpoint
from specserve.models import ARCHITECTURES
from specserve.models.llama import LlamaModel
from specserve.speculative import DraftJob
from specserve.types import Proposal, Request, StepPlan, VerifyResult

if TYPE_CHECKING:
    from specserve.runner import ForwardOutput
    from specserve.speculative import TargetInfo


def check_same_vocabulary(target: TargetInfo, draft: LoadedCheckpoint) -> None:
    target_name = target.config.name or target.config.architecture
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft model {draft.source} has vocab_size {draft.config.vocab_size} but the target "
                         f"{target_name} has {target.config.vocab_size}: STANDALONE needs a drafter with the "
                         "target's tokenizer")
    if (target.tokenizer is not None and draft.tokenizer is not None
            and target.tokenizer.get_vocab() != draft.tokenizer.get_vocab()):
        raise ValueError(f"draft model {draft.source} has a different tokenizer from the target {target_name}: "
                         "STANDALONE needs a drafter with the target's tokenizer")


def choose_drafts(jobs: list[DraftJob], logits: torch.Tensor,   # [len(jobs), vocab]
                  drafts: list[list[int]], probs: list[list[torch.Tensor]], generator: torch.Generator) -> None:
    """Append one draft per job to drafts[job.index]: the argmax for greedy requests, else a sample from the
    drafter's distribution under the request's own filters, kept as q for the verifier. `generator` serves
    unseeded sampled requests."""
    for row, (i, req, _) in enumerate(jobs):
        p = req.params
        # Penalise as if the drafts so far were accepted, as the verifier will.
        scores = sampling.apply_penalties(logits[row:row + 1], p, req.prompt_token_ids,
                                          req.output_token_ids + drafts[i])
        if p.greedy:
            token = sampling.greedy_tokens(scores).item()
        else:
            q = sampling.process(scores, p)                       # [1, vocab]
            token = sampling.draw_draft(q[0], p.seed, req.num_tokens + len(drafts[i]), generator)
            probs[i].append(q[0])
        drafts[i].append(token)


class DraftModelProposer:
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, model: LlamaModel, num_draft_tokens: int) -> None:
        self.model = model
        self.k = num_draft_tokens
        self.kv_geometry = KVGeometry.of(model.config, model.dtype)
        self.pool: KVPool | None = None
        self.num_valid: dict[str, int] = {}    # request id → leading tokens whose draft KV is valid
        self.generator = torch.Generator().manual_seed(0)   # for unseeded sampled requests

    @classmethod
    def build(cls, spec: SpecConfig, target: TargetInfo, draft: LoadedCheckpoint | None) -> DraftModelProposer:
        if draft is None:
            draft = load_checkpoint(spec.draft_model_path, target.dtype)
        check_same_vocabulary(target, draft)
        # Drafts sit at the target's positions, so the drafter's RoPE table must reach its context.
        config = dataclasses.replace(draft.config, max_position_embeddings=max(
            draft.config.max_position_embeddings, target.config.max_position_embeddings))
        model = ARCHITECTURES[config.architecture](config, draft.weights, target.dtype,
                                                   quantization=target.model.quantization)
        model.warm_up(model.dtype)     # its KV pool's dtype (kv_geometry below)
        return cls(model, spec.num_draft_tokens)

    def attach_pool(self, pool: KVPool) -> None:
        self.pool = pool

    def context_length(self, req: Request) -> int:
        return self.num_valid.get(req.request_id, req.num_cached_tokens)

    def draft_slots(self, req: Request) -> int:
        return self.k

    @torch.inference_mode()
    def propose(self, plan: StepPlan) -> Proposal:
        jobs = [DraftJob(i, s.request, min(self.k, s.max_drafts)) for i, s in enumerate(plan.scheduled)
                if s.samples and s.max_drafts > 0]
        if not jobs:
            return Proposal.none(len(plan.scheduled))
        drafts: list[list[int]] = [[] for _ in plan.scheduled]
        probs: list[list[torch.Tensor]] = [[] for _ in plan.scheduled]   # q rows of sampled requests

        tokens, positions, spans, rows = [], [], [], []
        for job in jobs:
            req = job.request
            start = self.context_length(req)
            tokens += req.all_token_ids[start:]
            positions += range(start, req.num_tokens)
            spans.append(SeqSpan(req.pages, start, req.num_tokens - start))
            rows.append(len(tokens) - 1)
        choose_drafts(jobs, self._forward(tokens, positions, spans, rows), drafts, probs, self.generator)

        for r in range(1, max(job.num_drafts for job in jobs)):
            active = [job for job in jobs if job.num_drafts > r]
            positions = [job.request.num_tokens + r - 1 for job in active]
            spans = [SeqSpan(job.request.pages, pos, 1) for job, pos in zip(active, positions)]
            logits = self._forward([drafts[job.index][-1] for job in active], positions, spans,
                                   list(range(len(active))))
            choose_drafts(active, logits, drafts, probs, self.generator)

        for job in jobs:
            # the last draft is never fed
            self.num_valid[job.request.request_id] = job.request.num_tokens + job.num_drafts - 1
        return Proposal(tuple(map(tuple, drafts)), tuple(torch.stack(p) if p else None for p in probs))

    def _forward(self, tokens: list[int], positions: list[int], spans: list[SeqSpan],
                 rows: list[int]) -> torch.Tensor:
        """Feed `tokens` into the draft pool → logits of the fed tokens at `rows`, [len(rows), vocab]."""
        meta = AttentionMetadata.for_pool(spans, self.pool)
        hidden, _ = self.model.forward(torch.tensor(tokens), torch.tensor(positions), meta, self.pool)
        return self.model.logits(hidden[rows])

    def commit(self, plan: StepPlan, result: VerifyResult, out: ForwardOutput) -> None:
        # KV written for rejected drafts is not valid; the next catch-up overwrites it.
        for s in plan.scheduled:
            rid = s.request.request_id
            if rid in self.num_valid:
                self.num_valid[rid] = min(self.num_valid[rid], s.request.num_computed_tokens)

    def release(self, req: Request) -> None:
        self.num_valid.pop(req.request_id, None)
