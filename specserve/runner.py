"""One model and one KV pool: a step's plan (+ drafts) → flat tensors → logits of the rows to verify."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.attention.sdpa import AttentionMetadata, SeqSpan
from specserve.kv_pages import KVPool
from specserve.models.llama import LlamaModel
from specserve.types import Proposal, StepPlan


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor           # [num_verify_rows, vocab], plan order, anchor row then one per draft
    hidden: torch.Tensor           # [num_tokens, hidden] final-normed, every fed token
    aux_hidden: list[torch.Tensor] # per aux layer: [num_tokens, hidden]
    token_offsets: list[int]       # start of each scheduled request's tokens in the flat batch
    # per scheduled request with prompt_logprobs: (first position p, logits [n, vocab] of positions p..p+n-1,
    # each predicting the prompt token after it) for the prompt tokens still without a logprob
    prompt_logits: tuple[tuple[int, torch.Tensor] | None, ...] = ()


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, aux_layer_ids: tuple[int, ...] = ()) -> None:
        self.model = model
        self.pool = pool
        self.aux_layer_ids = aux_layer_ids

    @torch.inference_mode()
    def forward(self, plan: StepPlan, proposal: Proposal) -> ForwardOutput:
        tokens, positions, spans, logit_rows, offsets = [], [], [], [], []
        for sched, drafts in zip(plan.scheduled, proposal.draft_tokens):
            req = sched.request
            fed = req.all_token_ids[sched.start:sched.start + sched.num_feed] + list(drafts)
            offsets.append(len(tokens))
            if sched.samples:
                last = len(tokens) + sched.num_feed - 1
                logit_rows.extend(range(last, last + 1 + len(drafts)))
            tokens.extend(fed)
            positions.extend(range(sched.start, sched.start + len(fed)))
            spans.append(SeqSpan(req.pages, sched.start, len(fed)))
        meta = AttentionMetadata.for_pool(spans, self.pool)
        hidden, aux = self.model.forward(torch.tensor(tokens), torch.tensor(positions), meta, self.pool,
                                         self.aux_layer_ids)
        if logit_rows:
            logits = self.model.logits(hidden[logit_rows])
        else:
            logits = hidden.new_zeros(0, self.model.config.vocab_size)
        return ForwardOutput(logits, hidden, aux, offsets, self._prompt_logits(plan, hidden, offsets))

    def _prompt_logits(self, plan: StepPlan, hidden: torch.Tensor,
                       offsets: list[int]) -> tuple[tuple[int, torch.Tensor] | None, ...]:
        out = []
        for sched, offset in zip(plan.scheduled, offsets):
            req = sched.request
            if not req.params.prompt_logprobs:
                out.append(None)
                continue
            # position p predicts prompt token p + 1; after a preemption the logprobs already taken stay
            first = max(sched.start, len(req.prompt_logprobs) - 1)
            end = min(sched.start + sched.num_feed, len(req.prompt_token_ids) - 1)
            if first >= end:
                out.append(None)
                continue
            rows = hidden[offset + first - sched.start:offset + end - sched.start]
            out.append((first, self.model.logits(rows)))
        return tuple(out)
