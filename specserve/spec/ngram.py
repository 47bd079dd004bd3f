"""NGRAM: prompt lookup. The drafts are the tokens that followed the most recent earlier occurrence
of the request's last n tokens in its own prompt + output; no model, no KV, deterministic drafts."""
from __future__ import annotations

from typing import TYPE_CHECKING

from specserve.config import SpecConfig
from specserve.kv_pages import KVPool
from specserve.types import Proposal, Request, StepPlan, VerifyResult

if TYPE_CHECKING:
    from specserve.loader import LoadedCheckpoint
    from specserve.runner import ForwardOutput
    from specserve.spec import TargetInfo


def prompt_lookup(tokens: list[int], ngram_min: int, ngram_max: int, num_drafts: int) -> list[int]:
    """Up to `num_drafts` tokens following the most recent earlier occurrence of the longest suffix
    n-gram (ngram_max down to ngram_min). The copy may run on into its own drafts, so a loop whose
    period is shorter than `num_drafts` is extended rather than cut."""
    if num_drafts <= 0 or len(tokens) < 2:
        return []
    # Plain list scans: DSPARK's n-gram option looks up every request every step, and per-op tensor
    # overhead made that ~3x slower. Candidates are the earlier positions holding the last token.
    last = len(tokens) - 1
    longest, end = 0, -1                  # the longest match and the latest position it ends at
    e = -1
    while True:
        try:
            e = tokens.index(tokens[last], e + 1, last)
        except ValueError:
            break
        n = 1
        while n < ngram_max and n <= e and tokens[e - n] == tokens[last - n]:
            n += 1
        if n >= longest:
            longest, end = n, e
    if longest < ngram_min:
        return []
    drafts: list[int] = []
    for i in range(end + 1, end + 1 + num_drafts):
        drafts.append(tokens[i] if i < len(tokens) else drafts[i - len(tokens)])
    return drafts


class NgramProposer:
    kv_geometry = None
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, num_draft_tokens: int, ngram_min: int, ngram_max: int) -> None:
        self.k = num_draft_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    @classmethod
    def build(cls, spec: SpecConfig, target: TargetInfo, draft: LoadedCheckpoint | None) -> NgramProposer:
        return cls(spec.num_draft_tokens, spec.ngram_min, spec.ngram_max)

    def attach_pool(self, pool: KVPool) -> None:
        raise TypeError("NGRAM keeps no draft KV")

    def draft_slots(self, req: Request) -> int:
        return self.k

    def context_length(self, req: Request) -> int:
        return req.num_computed_tokens             # n-gram lookup keeps no draft state

    def propose(self, plan: StepPlan) -> Proposal:
        drafts = tuple(
            tuple(prompt_lookup(s.request.all_token_ids, self.ngram_min, self.ngram_max, min(self.k, s.max_drafts)))
            if s.samples else ()
            for s in plan.scheduled)
        return Proposal(drafts, (None,) * len(drafts))

    def commit(self, plan: StepPlan, result: VerifyResult, out: ForwardOutput) -> None:
        pass

    def release(self, req: Request) -> None:
        pass
