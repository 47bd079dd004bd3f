"""Shared by the lossless tests of every proposer: drive an engine step by step (optionally poisoning
every free KV page with NaN first), capture the target's K/V of each request's committed tokens
when it finishes, and check that pages, refcounts and proposer state add up."""
from __future__ import annotations

import atexit
import dataclasses
import random
import shutil
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from specserve.attention.sdpa import AttentionMetadata, SeqSpan
from specserve.engine import LLM, Engine
from specserve.kv_pages import KVPool, slots_for
from specserve.loader import LoadedCheckpoint
from specserve.models.eagle import EagleCheckpoint, random_eagle
from specserve.types import Proposal, Request, RequestOutput, SamplingParams, SpecStats, StepPlan

ENGINE_DEFAULTS = {"dtype": "float64", "page_size": 4, "num_pages": 256}


@dataclass
class Run:
    outputs: list[RequestOutput]                           # in prompt order
    kv: dict[str, tuple[torch.Tensor, torch.Tensor]]       # request id → committed_kv at its finish
    engine: Engine


def make_engine(ckpt: LoadedCheckpoint, draft: LoadedCheckpoint | None = None, **engine_kw) -> Engine:
    return LLM(checkpoint=ckpt, draft_checkpoint=draft, **{**ENGINE_DEFAULTS, **engine_kw}).engine


def run(ckpt: LoadedCheckpoint, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
        draft: LoadedCheckpoint | None = None, poison: bool = False, **engine_kw) -> Run:
    """Generate to the end; with `poison`, every free page of every pool is NaN before each step."""
    return drive(make_engine(ckpt, draft, **engine_kw), prompts, params, poison)


def drive(engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
          poison: bool = False) -> Run:
    """Generate to the end on an engine the caller built (and may have hooked), checking page and
    proposer bookkeeping after every step."""
    kv = capture_kv_at_finish(engine)
    param_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    ids = [engine.add_request(list(p), sp) for p, sp in zip(prompts, param_list, strict=True)]
    finals = {}
    while engine.has_unfinished:
        if poison:
            poison_free_pages(engine)
        finals |= {out.request_id: out for out in engine.step() if out.finished}
        assert_consistent(engine)
    return Run([finals[i] for i in ids], kv, engine)


def traffic(min_prompt: int, new_tokens: tuple[int, int]) -> st.SearchStrategy:
    """Random operations for replay_traffic: submits (prompt, max new tokens, greedy?), aborts and steps."""
    return st.lists(st.one_of(
        st.tuples(st.just("submit"), st.lists(st.integers(0, 255), min_size=min_prompt, max_size=20),
                  st.integers(*new_tokens), st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 63)),
        st.tuples(st.just("step")),
    ), max_size=40)


def replay_traffic(engine: Engine, ops, poison: bool = False, max_drain_steps: int = 1000) -> None:
    """Apply random ("submit", prompt, max_new, greedy) / ("abort", i) / ("step",) operations, then finish
    everything; bookkeeping is checked after each operation and every page and proposer state must end free."""
    live: list[str] = []
    for op in ops:
        if op[0] == "submit":
            _, prompt, max_new, greedy = op
            params = SamplingParams(temperature=0.0 if greedy else 1.0, max_new_tokens=max_new, ignore_eos=True)
            live.append(engine.add_request(prompt, params))
        elif op[0] == "abort" and live:
            engine.abort(live.pop(op[1] % len(live)))
        else:
            if poison:
                poison_free_pages(engine)
            engine.step()
        assert_consistent(engine)
    for _ in range(max_drain_steps):
        if not engine.has_unfinished:
            break
        if poison:
            poison_free_pages(engine)
        engine.step()
        assert_consistent(engine)
    assert not engine.has_unfinished
    assert_pages_released(engine)
    assert not getattr(engine.proposer, "num_valid", {})
    assert not getattr(engine.proposer, "unwritten", {})


def assert_same_as_plain(spec: Run, plain: Run) -> None:
    """Same tokens, logprobs and committed target K/V as plain decoding of the same prompts."""
    for i, (got, want) in enumerate(zip(spec.outputs, plain.outputs, strict=True)):
        assert got.token_ids == want.token_ids, f"request {i} differs from plain decoding"
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-9
        for a, b in zip(got.top_logprobs, want.top_logprobs):
            assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) < 1e-9
        for got_kv, want_kv in zip(spec.kv[got.request_id], plain.kv[want.request_id]):
            # Exact up to float64 rounding: a verify window and a decode step multiply different shapes.
            torch.testing.assert_close(got_kv, want_kv, rtol=0, atol=1e-12)


def poison_free_pages(engine: Engine) -> None:
    free = engine.allocator.free_page_ids()
    for pool in (engine.pool, engine.draft_pool):
        if pool is not None:
            pool.fill_pages(free, float("nan"))


def committed_kv(pool: KVPool, req: Request) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the request's committed tokens, [layers, num_computed_tokens, kv_heads, head_dim] each."""
    slots = slots_for(req.pages, 0, req.num_computed_tokens, pool.page_size)
    return pool.k[:, slots].clone(), pool.v[:, slots].clone()


def capture_kv_at_finish(engine: Engine) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Wrap the scheduler's finish so each request's target K/V is read before its pages are freed."""
    captured = {}
    finish = engine.scheduler.finish

    def capturing(req: Request, reason: str) -> None:
        if req.pages:
            captured[req.request_id] = committed_kv(engine.pool, req)
        finish(req, reason)

    engine.scheduler.finish = capturing
    return captured


def cached_pages(engine: Engine) -> Counter:
    return Counter(engine.prefix_cache.cached_pages() if engine.prefix_cache is not None else ())


def assert_pages_released(engine: Engine) -> None:
    """No request holds a page: each page's only reference is the prefix cache's, and dropping the
    cache frees every page."""
    alloc = engine.allocator
    cached = cached_pages(engine)
    assert alloc.refcounts == [cached[p] for p in range(alloc.num_pages)]
    if engine.prefix_cache is not None:
        assert not engine.prefix_cache.locked_request_ids(), "a finished request still locks the cache"
        engine.prefix_cache.clear()
    assert alloc.num_free == alloc.num_pages and not any(alloc.refcounts)


def assert_consistent(engine: Engine) -> None:
    """Refcounts equal the pages held by running requests plus the prefix cache's, the free list is
    exactly the unheld pages, and a proposer's per-request state (`num_valid`, where it keeps one) and
    the cache's locks name running requests only."""
    sched, alloc = engine.scheduler, engine.allocator
    held = Counter(p for r in sched.running for p in r.pages) + cached_pages(engine)
    assert all(not r.pages for r in sched.waiting), "a waiting request holds pages"
    if engine.prefix_cache is not None:
        assert engine.prefix_cache.locked_request_ids() <= {r.request_id for r in sched.running}
    assert alloc.refcounts == [held[p] for p in range(alloc.num_pages)]
    assert alloc.num_cache_only == sum(alloc.refcounts[p] == 1 for p in cached_pages(engine))
    assert sorted(alloc.free_page_ids()) == [p for p in range(alloc.num_pages) if not held[p]]
    tracked = getattr(engine.proposer, "num_valid", {})
    assert set(tracked) <= {r.request_id for r in sched.running}, "proposer state outlived its request"


def assert_stats_consistent(run_: Run, max_drafts: int) -> None:
    """Per-request stats add up (accept length counts the bonus token) and the engine totals are their sum."""
    total = SpecStats()
    for out in run_.outputs:
        s = out.spec
        hist = s.accepted_histogram
        assert sum(hist) == s.verify_ct
        assert sum(k * n for k, n in enumerate(hist)) == s.num_accepted_drafts
        assert s.num_accepted_drafts <= s.num_proposed_drafts <= max_drafts * s.verify_ct
        assert len(hist) <= max_drafts + 1
        assert s.num_emitted_tokens == len(out.token_ids)
        assert s.accept_length == len(out.token_ids) / s.verify_ct
        total.merge(s)
    assert run_.engine.stats == total


SAMPLED = [SamplingParams(temperature=0.8, top_k=5, seed=100 + i, max_new_tokens=12, ignore_eos=True, logprobs=True,
                          top_logprobs=5) for i in range(4)]


def assert_sampled_batch_valid(ckpt: LoadedCheckpoint, prompts: Sequence[Sequence[int]], batched: Run,
                               max_drafts: int, **engine_kw) -> None:
    """`batched` ran `prompts` with SAMPLED: the third request samples what it samples alone, every output
    has its length and each token is one of its top-5 logprobs (top_k=5 keeps just those), and other seeds
    sample other tokens."""
    alone = run(ckpt, prompts[2:3], SAMPLED[2:3], **engine_kw)
    assert alone.outputs[0].token_ids == batched.outputs[2].token_ids
    for out in batched.outputs:
        assert len(out.token_ids) == 12
        assert all(tok in top for tok, top in zip(out.token_ids, out.top_logprobs))
    assert_stats_consistent(batched, max_drafts)
    reseeded = run(ckpt, prompts, [dataclasses.replace(p, seed=p.seed + 50) for p in SAMPLED], **engine_kw)
    assert [o.token_ids for o in reseeded.outputs] != [o.token_ids for o in batched.outputs]


# Seeded sampling configurations: temperature 0.5 / 1.0, without filters and with top-k + top-p.
SEEDED_CONFIGS = [SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=14, ignore_eos=True)
                  for t in (0.5, 1.0) for k, p in ((0, 1.0), (20, 0.9))]


def assert_seeded_like_plain(ckpt: LoadedCheckpoint, config: SamplingParams, batch: int, **engine_kw) -> None:
    """`batch` requests, every other one seeded (`config`), the rest other traffic (greedy, and sampled without
    a seed), run with speculation: every seeded request emits the tokens plain decoding with its seed emits
    when it runs alone."""
    prompts = make_prompts(batch, seed=batch)
    traffic = [SamplingParams(temperature=0.0, max_new_tokens=9, ignore_eos=True),
               SamplingParams(temperature=0.9, max_new_tokens=11, ignore_eos=True)]
    params = [dataclasses.replace(config, seed=1000 + i) if i % 2 == 0 else traffic[i // 2 % 2]
              for i in range(batch)]
    spec = run(ckpt, prompts, params, **engine_kw)
    for i in range(0, batch, 2):
        alone = run(ckpt, [prompts[i]], [params[i]])
        assert spec.outputs[i].token_ids == alone.outputs[0].token_ids, f"seeded request {i} differs from plain"
    assert_pages_released(spec.engine)


def mean_accept_length(run_: Run) -> float:
    return sum(len(o.token_ids) for o in run_.outputs) / sum(o.spec.verify_ct for o in run_.outputs)


# ---- drafters built from a target checkpoint ------------------------------------------------------

def first_layers(target: LoadedCheckpoint, num_layers: int) -> LoadedCheckpoint:
    """The target's first layers with its embedding, norm and head: a drafter that often agrees."""
    def kept(name: str) -> bool:
        return not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers

    config = dataclasses.replace(target.config, num_layers=num_layers, name=f"{target.config.name}-first{num_layers}")
    return LoadedCheckpoint(config, {k: v for k, v in target.weights.items() if kept(k)}, target.tokenizer,
                            f"{target.source}-first{num_layers}")


def shifted_head(target: LoadedCheckpoint) -> LoadedCheckpoint:
    """The target with its LM head rolled by one token: draft logit v is the target's logit v - 1, so
    a greedy draft is never the target's argmax and every first draft is rejected."""
    c = target.config
    head = target.weights["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"]
    config = dataclasses.replace(c, tie_word_embeddings=False, name=f"{c.name}-shifted")
    return LoadedCheckpoint(config, {**target.weights, "lm_head.weight": head.roll(1, dims=0)}, target.tokenizer,
                            f"{target.source}-shifted")


# ---- recording proposals ---------------------------------------------------------------------------

def record_proposals(engine: Engine) -> list[tuple[StepPlan, list[list[int]], Proposal]]:
    """The plan, the tokens of each scheduled request and the proposal of every step from now on."""
    seen = []
    propose = engine.proposer.propose

    def recording(plan: StepPlan) -> Proposal:
        proposal = propose(plan)
        seen.append((plan, [s.request.all_token_ids for s in plan.scheduled], proposal))
        return proposal

    engine.proposer.propose = recording
    return seen


# ---- EAGLE heads ------------------------------------------------------------------------------------

def programmed_head(target: LoadedCheckpoint, feature_scale: float = 0.0) -> EagleCheckpoint:
    """A head that is the target's first layer and final norm: `input_proj` passes the token embedding
    through, plus `feature_scale` times a random map of the feature. At scale 0 it drafts what
    first_layers(target, 1) would; a small scale keeps it agreeing while the features still count."""
    ckpt = random_eagle(target.config, seed=3, dtype=torch.float64)
    w, h = ckpt.weights, target.config.hidden_size
    for name in w:
        if name.startswith("model.layers.0.") or name == "model.norm.weight":
            w[name] = target.weights[name].clone()
    w["input_proj.weight"][:, :h] = torch.eye(h, dtype=torch.float64)
    w["input_proj.weight"][:, h:] *= feature_scale
    return ckpt


def eagle_kwargs(ckpt: EagleCheckpoint) -> dict:
    """Engine arguments for `ckpt`, saved to a temporary folder removed at exit (for CASES)."""
    folder = tempfile.mkdtemp(prefix="eagle-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    ckpt.save(folder)
    return {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": folder}


# ---- the lossless matrix ---------------------------------------------------------------------------

# The proposers of the lossless matrix (test_spec_lossless.py): name → (engine kwargs for a target checkpoint, the
# mean accept length it must reach at K=8, batch 4). A new proposer joins every test by adding itself here.
LOSSLESS_CASES = {
    "ngram": (lambda target: {"speculative_algorithm": "NGRAM"}, 1.5),
    "standalone-agree": (lambda target: {"speculative_algorithm": "STANDALONE",
                                         "draft": first_layers(target, 1)}, 2.0),
    "standalone-disagree": (lambda target: {"speculative_algorithm": "STANDALONE",
                                            "draft": shifted_head(target)}, None),
    "eagle": (lambda target: eagle_kwargs(programmed_head(target, feature_scale=0.03)), 2.0),
}
KS = [1, 2, 4, 5, 8, 16]
BATCHES = [1, 4, 16]
MATRIX_ENGINE = {"max_num_batched_tokens": 64}   # batch 16 prefills in chunks and is budget-bound


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Random prompts, every other one a repeated phrase so n-gram lookup finds matches."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        if i % 2:
            phrase = [rng.randrange(256) for _ in range(rng.randrange(2, 6))]
            prompts.append(phrase * rng.randrange(2, 6) + [rng.randrange(256)])
        else:
            prompts.append([rng.randrange(256) for _ in range(rng.randrange(1, 40))])
    return prompts


PROMPTS = make_prompts(16)
GREEDY = [SamplingParams(temperature=0.0, max_new_tokens=8 + 7 * i % 25, ignore_eos=True, logprobs=True,
                         top_logprobs=2) for i in range(16)]


# Block drafters by configuration: name → engine kwargs given the drafter folders of a test module.
BLOCK_CASES = {
    "dflash": lambda d: {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": d["dflash"]},
    "dflash-next": lambda d: {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": d["dflash_next"]},
    # By weights a tiny drafter's row costs a large part of a tiny target row (the agreeing drafter has a
    # Markov rank per memorised transition). These cases are about windows, so their blocks are free;
    # the block's cost has its own tests.
    "dspark-budget": lambda d: {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": d["agree"],
                                "speculative_dspark_cost_table_path": d["cost.json"],
                                "speculative_dspark_block_cost": 0.0},
    "dspark-threshold": lambda d: {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": d["agree"],
                                   "speculative_dspark_confidence_threshold": 0.5},
    "dspark-random": lambda d: {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": d["dspark"],
                                "speculative_dspark_cost_table_path": d["cost.json"],
                                "speculative_dspark_block_cost": 0.0},
    "dspark-hybrid": lambda d: {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": d["dspark"],
                                "speculative_dspark_cost_table_path": d["cost.json"],
                                "speculative_dspark_block_cost": 0.0,
                                "speculative_ngram_hybrid": True},
}


# ---- block drafter context -------------------------------------------------------------------------

def capture_draft_context(engine: Engine) -> dict[str, tuple[list[int], torch.Tensor, torch.Tensor]]:
    """At each request's finish: the tokens its draft context covers and that context's K and V."""
    captured = {}
    finish = engine.scheduler.finish

    def capturing(req: Request, reason: str) -> None:
        engine.proposer.flush_context([req])       # the context of the tokens committed since the last block
        n = engine.proposer.context_length(req)
        if req.pages and n:
            slots = slots_for(req.pages, 0, n, engine.draft_pool.page_size)
            captured[req.request_id] = (req.all_token_ids[:n], engine.draft_pool.k[:, slots].clone(),
                                        engine.draft_pool.v[:, slots].clone())
        finish(req, reason)

    engine.scheduler.finish = capturing
    return captured


def reference_context(engine: Engine, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft context of `tokens` from one target prefill over all of them, in scratch pools."""
    n, page_size = len(tokens), 4
    pages = list(range(-(-n // page_size)))
    target_pool = KVPool(engine.pool.geometry, len(pages), page_size)
    meta = AttentionMetadata.build([SeqSpan(pages, 0, n)], page_size, target_pool.null_slot)
    _, aux = engine.model.forward(torch.tensor(tokens), torch.arange(n), meta, target_pool,
                                  engine.proposer.aux_layer_ids)
    pool = KVPool(engine.draft_pool.geometry, len(pages), page_size)
    slots = slots_for(pages, 0, n, page_size)
    engine.proposer.drafter.write_context(torch.cat(aux, dim=-1), torch.arange(n), slots, pool)
    return pool.k[:, slots], pool.v[:, slots]


def assert_draft_context_exact(engine: Engine, captured) -> None:
    assert captured, "no request finished with a draft context"
    for tokens, k, v in captured.values():
        want_k, want_v = reference_context(engine, tokens)
        torch.testing.assert_close(k, want_k, rtol=0, atol=1e-9)
        torch.testing.assert_close(v, want_v, rtol=0, atol=1e-9)
