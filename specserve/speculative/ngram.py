"""NGRAM: prompt lookup. The drafts are the tokens that followed the most recent earlier occurrence
of the request's last n tokens in its own prompt + output; no model, no KV, deterministic drafts.
NgramHybrid is the same lookup as DSPARK's second option (--speculative-ngram-hybrid)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from specserve.config import SpecConfig
from specserve.kv_pages import KVPool
from specserve.speculative.windows import Candidate, RowMeans, survivals
from specserve.types import Proposal, Request, StepPlan, VerifyResult

if TYPE_CHECKING:
    from specserve.loader import LoadedCheckpoint
    from specserve.runner import ForwardOutput
    from specserve.speculative import TargetInfo


def longest_match(tokens: list[int], ngram_min: int, ngram_max: int) -> tuple[int, int]:
    """(n, end): the longest suffix n-gram of `tokens` (ngram_max down to ngram_min) that occurred earlier, and
    where its most recent earlier occurrence ends; (0, -1) if none."""
    if len(tokens) < 2:
        return 0, -1
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
    return (longest, end) if longest >= ngram_min else (0, -1)


def continuation(tokens: list[int], end: int, num_drafts: int) -> list[int]:
    """The `num_drafts` tokens after position `end`. The copy may run on into its own drafts, so a loop whose
    period is shorter than `num_drafts` is extended rather than cut."""
    drafts: list[int] = []
    for i in range(end + 1, end + 1 + num_drafts):
        drafts.append(tokens[i] if i < len(tokens) else drafts[i - len(tokens)])
    return drafts


def prompt_lookup(tokens: list[int], ngram_min: int, ngram_max: int, num_drafts: int) -> list[int]:
    """Up to `num_drafts` tokens following the most recent earlier occurrence of the longest suffix
    n-gram (ngram_max down to ngram_min)."""
    n, end = longest_match(tokens, ngram_min, ngram_max) if num_drafts > 0 else (0, -1)
    return continuation(tokens, end, num_drafts) if n else []


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


class NgramHybrid:
    """DSPARK's n-gram option: per request and step, prompt lookup proposes a continuation too, and
    whichever of the two has the larger expected accepted length (the sum of its survivals) is
    verified. N-gram rows are as confident as the request's own n-gram rows of the same match length
    have been (a running per-row estimate from an even prior): a 4-token match continues far more often
    than a 1-token one (on the benchmark's plain answers, 5.8 of 8 drafts against 0.8). Kept per request,
    so a seeded request samples the same tokens whatever runs beside it."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.per_request: dict[str, dict[int, RowMeans]] = {}   # request id → match length → its rows' record
        self.pending: dict[str, tuple[int, int]] = {}     # request id → (match length, n-gram drafts verified)

    def lookup(self, req: Request, n: int) -> Candidate | None:
        """Up to n drafts of prompt lookup with its rows' estimates and match length; None if nothing matches."""
        length, end = longest_match(req.all_token_ids, self.ngram_min, self.ngram_max) if n > 0 else (0, -1)
        if not length:
            return None
        seen = self.per_request.get(req.request_id, {}).get(length) or RowMeans()
        return Candidate(continuation(req.all_token_ids, end, n), [], seen.means(n), ngram_match=length)

    def weigh(self, plan: StepPlan, candidates: dict[int, Candidate], max_rows: int) -> None:
        """Swap in the n-gram continuation wherever it promises more accepted tokens (or no block ran)."""
        for i, s in enumerate(plan.scheduled):
            if not s.samples or s.max_drafts <= 0:
                continue
            ngram = self.lookup(s.request, min(max_rows, s.max_drafts))
            if ngram is None:
                continue
            block = candidates.get(i)
            if block is None or sum(survivals(ngram.confidences)) > sum(survivals(block.confidences)):
                candidates[i] = ngram

    def verifying(self, req: Request, match_length: int, num_drafts: int) -> None:
        """The request verifies `num_drafts` drafts of an n-gram match this step; `record` learns how many held."""
        self.pending[req.request_id] = (match_length, num_drafts)

    def record(self, plan: StepPlan, result: VerifyResult) -> None:
        for s, res in zip(plan.scheduled, result.per_request):
            rid = s.request.request_id
            length, verified = self.pending.pop(rid, (0, 0))
            if verified and res is not None and not s.request.finished:
                rows = self.per_request.setdefault(rid, {}).setdefault(length, RowMeans())
                rows.add_verified(verified, res.num_accepted)

    def release(self, req: Request) -> None:
        self.per_request.pop(req.request_id, None)
        self.pending.pop(req.request_id, None)
