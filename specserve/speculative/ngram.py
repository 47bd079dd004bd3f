"""NGRAM: prompt lookup. The drafts are the tokens that followed the most recent earlier occurrence
of the request's last n tokens in its own prompt + output; no model, no KV, deterministic drafts.
NgramHybrid is the same lookup as DSPARK's second option (--speculative-ngram-hybrid)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from specserve.config import SpecConfig
from specserve.kv_pages import KVPool
from specserve.speculative.windows import Candidate, RowMeans, expected_accepted, survivals
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


def continuation_rates(sequences: Iterable[tuple[list[int], list[int]]], ngram_min: int, ngram_max: int,
                       rows: int, stride: int = 1) -> dict[int, list[float]]:
    """Match length → for each continuation row k < rows, how often prompt lookup's draft k equalled the answer's
    token where drafts 0 .. k-1 had (None where never reached), over every `stride`-th answer position of the
    (prompt ids, answer ids) pairs with an earlier suffix match: NgramHybrid.PRIORS, from the target's answers."""
    reached: dict[int, list[int]] = {}
    held: dict[int, list[int]] = {}
    for prompt, answer in sequences:
        tokens = prompt + answer
        for a in range(len(prompt), len(tokens) - 1, stride):
            n, end = longest_match(tokens[:a], ngram_min, ngram_max)
            if not n:
                continue
            reach, hold = reached.setdefault(n, [0] * rows), held.setdefault(n, [0] * rows)
            for k, (draft, truth) in enumerate(zip(continuation(tokens[:a], end, rows), tokens[a:a + rows])):
                reach[k] += 1
                if draft != truth:
                    break
                hold[k] += 1
    return {n: [h / r if r else None for h, r in zip(held[n], reached[n])] for n in sorted(reached)}


def one_hot_like(row: torch.Tensor, token: int) -> torch.Tensor:   # [vocab]
    out = torch.zeros_like(row)
    out[token] = 1.0
    return out


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
    """DSPARK's n-gram option: per request and step, prompt lookup proposes a continuation too, and so does each
    splice (the block's first j drafts, then prompt lookup's continuation of the context with them, where that
    matches SPLICE_MIN_MATCH tokens or more: a copy from the prompt often starts with tokens the drafter guesses
    and the lookup cannot); whichever of them has the largest expected accepted length (the sum of its survivals)
    is verified. N-gram rows are as confident as the request's own n-gram rows of the same match length have been:
    a running per-row estimate, kept per request (so a seeded request samples the same tokens whatever runs beside
    it), that starts from PRIORS, how often each row held on the target's own answers."""
    # Match length → the chance each continuation row k = 0..7 matched, given the rows before it did, where the
    # longest earlier suffix match of the prompt + answer so far had that length: continuation_rates over
    # SmolLM2-135M's greedy answers to the first 1,000 ShareGPT prompts of
    # data/smollm2-135m-sharegpt-regenerated.jsonl.gz, every second position (benchmarks/ngram_priors.py). A
    # 4-token match continues for 5.9 of 8 rows on average, a 1-token one for 0.6. The even prior of 0.5 used
    # before underpriced long matches so much that at batch 16 the planner hardly ever verified an n-gram row (so
    # never learned better): acceptance length 1.02 there against 1.17 with these, on 17 chat/code/math prompts.
    PRIORS = {1: (0.21, 0.58, 0.70, 0.77, 0.79, 0.80, 0.81, 0.86),
              2: (0.56, 0.65, 0.75, 0.79, 0.81, 0.86, 0.86, 0.86),
              3: (0.67, 0.77, 0.79, 0.82, 0.83, 0.87, 0.87, 0.86),
              4: (0.91, 0.93, 0.94, 0.95, 0.95, 0.96, 0.96, 0.97)}

    # A splice copies only after a suffix match of at least this many tokens. After drafted tokens a short match
    # holds less often than its prior says: on acceptance.py's 50 prompts (stage-12 drafter, full windows) the
    # hybrid went 2.948 without splices → 2.950 / 2.965 / 2.969 / 2.959 with splices from 1 / 2 / 3 / 4 tokens.
    SPLICE_MIN_MATCH = 3

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.per_request: dict[str, dict[int, RowMeans]] = {}   # request id → match length → its rows' record
        # request id → (match length, n-gram drafts verified, block drafts before them)
        self.pending: dict[str, tuple[int, int, int]] = {}

    def lookup(self, req: Request, n: int) -> Candidate | None:
        """Up to n drafts of prompt lookup with its rows' estimates and match length; None if nothing matches."""
        length, end = longest_match(req.all_token_ids, self.ngram_min, self.ngram_max) if n > 0 else (0, -1)
        if not length:
            return None
        return Candidate(continuation(req.all_token_ids, end, n), [], self._record(req, length, n), ngram_match=length)

    def splice(self, req: Request, block: Candidate) -> Candidate | None:
        """The best splice of the request's block drafts with prompt lookup, if it promises more than the block."""
        drafts, confidences = block.drafts, block.confidences
        if confidences is None:
            return None
        history, held = req.all_token_ids, survivals(confidences)
        best, best_gain = None, sum(held)
        for j in range(1, len(drafts)):
            # Even n-gram rows that all held would not beat it, nor would they after more block rows.
            if sum(held[:j]) + held[j - 1] * (len(drafts) - j) <= best_gain:
                break
            context = history + drafts[:j]
            length, end = longest_match(context, max(self.ngram_min, self.SPLICE_MIN_MATCH), self.ngram_max)
            if not length:
                continue
            copied = continuation(context, end, len(drafts) - j)
            if copied == drafts[j:]:
                continue                   # the same drafts: nothing to choose between
            # Sampled block drafts carry their q rows; a copied draft is deterministic: a one-hot q row.
            probs = (block.probs[:j] + [one_hot_like(block.probs[0], t) for t in copied]) if block.probs else []
            spliced = Candidate(drafts[:j] + copied, probs,
                                confidences[:j] + self._record(req, length, len(copied)), length, ngram_from=j)
            if (gain := expected_accepted(spliced)) > best_gain:
                best, best_gain = spliced, gain
        return best

    def _record(self, req: Request, match_length: int, rows: int) -> list[float]:
        """The request's estimates of n-gram rows 0 .. rows - 1 of a match of that length."""
        seen = self.per_request.get(req.request_id, {}).get(match_length) or RowMeans()
        return seen.means(rows, self.PRIORS[min(match_length, max(self.PRIORS))])

    def lookups(self, plan: StepPlan, max_rows: int) -> dict[int, Candidate]:
        """Each drafting request's n-gram continuation (by plan index), where its suffix matched before."""
        out = {}
        for i, s in enumerate(plan.scheduled):
            if s.samples and s.max_drafts > 0 and (ngram := self.lookup(s.request, min(max_rows, s.max_drafts))):
                out[i] = ngram
        return out

    def weigh(self, plan: StepPlan, candidates: dict[int, Candidate], lookups: dict[int, Candidate]) -> None:
        """Swap in a splice or the n-gram continuation wherever it promises more accepted tokens than the block
        (the n-gram continuation wherever no block ran)."""
        for i, block in candidates.items():
            if (spliced := self.splice(plan.scheduled[i].request, block)) is not None:
                candidates[i] = spliced
        for i, ngram in lookups.items():
            best = candidates.get(i)
            if best is None or expected_accepted(ngram) > expected_accepted(best):
                candidates[i] = ngram

    def verifying(self, req: Request, match_length: int, num_drafts: int, after: int = 0) -> None:
        """The request verifies `num_drafts` drafts of an n-gram match this step, after `after` block drafts;
        `record` learns how many held."""
        self.pending[req.request_id] = (match_length, num_drafts, after)

    def record(self, plan: StepPlan, result: VerifyResult) -> None:
        for s, res in zip(plan.scheduled, result.per_request):
            rid = s.request.request_id
            length, verified, after = self.pending.pop(rid, (0, 0, 0))
            # n-gram rows after a rejected block draft were never judged
            if verified and res is not None and not s.request.finished and res.num_accepted >= after:
                rows = self.per_request.setdefault(rid, {}).setdefault(length, RowMeans())
                rows.add_verified(verified, res.num_accepted - after)

    def release(self, req: Request) -> None:
        self.per_request.pop(req.request_id, None)
        self.pending.pop(req.request_id, None)
