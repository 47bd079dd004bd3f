"""EAGLE: the head's forward and context writes, the checkpoint folder (round trip, every mismatch error),
drafts against a from-scratch recomputation through chunked prefill, acceptance and preemption, and a
head programmed as the target's first layer drafting exactly what that layer alone would."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from specserve.attention.sdpa import AttentionMetadata, SeqSpan
from specserve.engine import Engine
from specserve.kv_pages import KVGeometry, KVPool
from specserve.loader import LoadedCheckpoint, ModelLoadError
from specserve.models import LlamaModel
from specserve.models.block_drafter import random_block_drafter
from specserve.models.eagle import EagleCheckpoint, EagleDrafter, random_eagle, weight_shapes
from specserve.speculative import DraftJob
from specserve.speculative.draft_model import choose_drafts
from specserve.types import Request, SamplingParams
from tests.spec_harness import (
    assert_consistent,
    eagle_kwargs,
    first_layers,
    make_engine,
    poison_free_pages,
    programmed_head,
    record_proposals,
)

PAGE = 4


@pytest.fixture(scope="module")
def target(tiny_llama) -> LlamaModel:
    return LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float64)


def fresh(geometry: KVGeometry, num_tokens: int) -> tuple[KVPool, list[int]]:
    pages = list(range(-(-num_tokens // PAGE)))
    return KVPool(geometry, len(pages), PAGE), pages


# ---- the head -------------------------------------------------------------------------------------

def test_head_shapes_and_its_own_one_layer_pool(tiny_llama, target):
    ckpt = random_eagle(tiny_llama.config, dtype=torch.float64)
    assert ckpt.config.target_layer_ids == (0, 1)
    shapes = weight_shapes(ckpt.config)
    assert {k: tuple(v.shape) for k, v in ckpt.weights.items()} == shapes
    assert shapes["fc.weight"] == shapes["input_proj.weight"] == (64, 128)
    drafter = EagleDrafter(ckpt, target)
    assert drafter.kv_geometry == KVGeometry(1, 2, 16, torch.float64)
    assert drafter.model.head is target.head and drafter.model.embed is target.embed
    n = 7
    pool, pages = fresh(drafter.kv_geometry, n)
    meta = AttentionMetadata.build([SeqSpan(pages, 0, n)], PAGE, pool.null_slot)
    tokens, features = torch.randint(0, 257, (n,)), torch.randn(n, 64, dtype=torch.float64)
    residual, logits = drafter.forward(tokens, features, torch.arange(n), meta, pool)
    assert residual.shape == (n, 64) and logits.shape == (n, 257)
    # The K/V-only path of committed rows writes exactly what the full forward wrote.
    other, _ = fresh(drafter.kv_geometry, n)
    drafter.write_context(tokens, features, torch.arange(n), meta.slot_mapping, other)
    torch.testing.assert_close(other.k, pool.k, rtol=0, atol=1e-12)
    torch.testing.assert_close(other.v, pool.v, rtol=0, atol=1e-12)


def test_default_features_are_a_low_a_middle_and_a_high_layer(tiny_llama):
    config = dataclasses.replace(tiny_llama.config, num_layers=30)
    assert random_eagle(config).config.target_layer_ids == (0, 14, 29)


def test_engine_wiring_and_default_draft_count(tiny_llama):
    engine = make_engine(tiny_llama, **eagle_kwargs(random_eagle(tiny_llama.config, target_layer_ids=(1,))))
    assert engine.proposer.k == 3 and engine.runner.aux_layer_ids == (1,)
    assert engine.draft_pool.geometry == KVGeometry(1, 2, 16, torch.float64)
    assert engine.draft_pool.num_pages == engine.pool.num_pages


# ---- the checkpoint -------------------------------------------------------------------------------

def test_save_load_round_trip_gives_identical_proposals(tiny_llama, tmp_path):
    ckpt = random_eagle(tiny_llama.config, seed=4, dtype=torch.float64)
    ckpt.save(tmp_path / "a")
    loaded = EagleCheckpoint.load(tmp_path / "a")
    assert loaded.config == ckpt.config and loaded.source == str(tmp_path / "a")
    assert loaded.weights.keys() == ckpt.weights.keys()
    assert all(torch.equal(loaded.weights[k], v) for k, v in ckpt.weights.items())
    assert json.loads((tmp_path / "a" / "config.json").read_text())["algorithm"] == "EAGLE"
    loaded.save(tmp_path / "b")
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_new_tokens=10, ignore_eos=True)
              for i in range(4)]
    seen = []
    for folder in ("a", "b"):
        engine = make_engine(tiny_llama, speculative_algorithm="EAGLE",
                             speculative_draft_model_path=str(tmp_path / folder))
        recorded = record_proposals(engine)
        for i, p in enumerate(params):
            engine.add_request([3 + i, 40, 41, 42, 7 * i], p)
        while engine.has_unfinished:
            engine.step()
        seen.append([p for *_, p in recorded])
    assert any(any(d) for p in seen[0] for d in p.draft_tokens)
    for a, b in zip(*seen, strict=True):
        assert a.draft_tokens == b.draft_tokens
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a.draft_probs, b.draft_probs))


def _replaced(ckpt: EagleCheckpoint, **config) -> EagleCheckpoint:
    return EagleCheckpoint(dataclasses.replace(ckpt.config, **config), dict(ckpt.weights))


@pytest.mark.parametrize("case, match", [
    ("hidden", r"cannot draft for tiny-llama: it was built for hidden size 32 but the target's is 64"),
    ("vocab", r"built for a vocabulary of 300 but the target has 257"),
    ("layers", r"target_layer_ids \[0, 2\] must be increasing layer ids in \[0, 2\)"),
    ("unordered", r"target_layer_ids \[1, 0\] must be increasing"),
    ("missing", r"tensor input_proj.weight is missing"),
    ("shape", r"tensor fc.weight has shape \[64, 64\], expected \[64, 128\]"),
])
def test_a_head_that_does_not_fit_the_target_is_refused(tiny_llama, case, match):
    ckpt = random_eagle(tiny_llama.config)
    if case == "hidden":
        ckpt = random_eagle(dataclasses.replace(tiny_llama.config, hidden_size=32))
    elif case == "vocab":
        ckpt = _replaced(ckpt, target_vocab_size=300)
    elif case == "layers":
        ckpt = _replaced(ckpt, target_layer_ids=(0, 2))
    elif case == "unordered":
        ckpt = _replaced(ckpt, target_layer_ids=(1, 0))
    elif case == "missing":
        del ckpt.weights["input_proj.weight"]
    else:
        ckpt.weights["fc.weight"] = ckpt.weights["fc.weight"][:, :64]
    with pytest.raises(ModelLoadError, match=match):
        make_engine(tiny_llama, **eagle_kwargs(ckpt))


def test_a_folder_that_is_not_an_eagle_head_is_refused(tiny_llama, tmp_path):
    random_block_drafter(tiny_llama.config, "DFLASH").save(tmp_path / "dflash")
    with pytest.raises(ModelLoadError, match=r"dflash is not an EAGLE checkpoint \(its config.json has algorithm "
                                             r"'DFLASH', expected 'EAGLE'\)"):
        make_engine(tiny_llama, speculative_algorithm="EAGLE", speculative_draft_model_path=str(tmp_path / "dflash"))
    with pytest.raises(ModelLoadError, match="needs a folder with config.json and model.safetensors"):
        make_engine(tiny_llama, speculative_algorithm="EAGLE", speculative_draft_model_path=str(tmp_path / "none"))
    random_eagle(tiny_llama.config).save(tmp_path / "cut")
    (tmp_path / "cut" / "model.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="cut is corrupt"):
        make_engine(tiny_llama, speculative_algorithm="EAGLE", speculative_draft_model_path=str(tmp_path / "cut"))
    config = json.loads((tmp_path / "cut" / "config.json").read_text())
    del config["head_dim"]
    (tmp_path / "cut" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="config.json lacks head_dim"):
        make_engine(tiny_llama, speculative_algorithm="EAGLE", speculative_draft_model_path=str(tmp_path / "cut"))


def test_eagle_needs_a_head_folder(tiny_llama):
    with pytest.raises(ValueError, match="EAGLE needs --speculative-draft-model-path"):
        make_engine(tiny_llama, speculative_algorithm="EAGLE")
    with pytest.raises(ValueError, match="not from a language model checkpoint"):
        make_engine(tiny_llama, first_layers(tiny_llama, 1), speculative_algorithm="EAGLE")


# ---- drafting through the engine ------------------------------------------------------------------

def reference_drafts(engine: Engine, req: Request, tokens: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """The head's n drafts after `tokens` from scratch: one target prefill over all but the anchor gives
    the real features, one head prefill over all tokens, then one row per draft, in fresh pools."""
    drafter, m = engine.proposer.drafter, len(tokens)
    target_pool, pages = fresh(engine.pool.geometry, m + n)
    meta = AttentionMetadata.build([SeqSpan(pages, 0, m - 1)], PAGE, target_pool.null_slot)
    _, aux = engine.model.forward(torch.tensor(tokens[:-1]), torch.arange(m - 1), meta, target_pool,
                                  engine.proposer.aux_layer_ids)
    fused = drafter.fuse(aux)
    features = torch.cat([fused.new_zeros(1, fused.shape[1]), fused])   # row p takes the feature of p - 1
    pool, _ = fresh(drafter.kv_geometry, m + n)
    state = Request(req.request_id, req.prompt_token_ids, req.params,
                    output_token_ids=tokens[len(req.prompt_token_ids):])
    drafts, probs = [[]], [[]]
    rows, start = tokens, 0
    for _ in range(n):
        meta = AttentionMetadata.build([SeqSpan(pages, start, len(rows))], PAGE, pool.null_slot)
        residual, logits = drafter.forward(torch.tensor(rows), features, torch.arange(start, start + len(rows)),
                                           meta, pool)
        choose_drafts([DraftJob(0, state, n)], logits[-1:], drafts, probs, torch.Generator())
        start += len(rows)
        rows, features = [drafts[0][-1]], residual[-1:]
    return drafts[0], probs[0]


def drive(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[int]]:
    """Run to the end with free pages poisoned, checking the proposer keeps state for running requests only."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    finals = {}
    while engine.has_unfinished:
        poison_free_pages(engine)
        finals |= {o.request_id: o for o in engine.step() if o.finished}
        assert_consistent(engine)
        assert engine.proposer.features.keys() == engine.proposer.num_valid.keys()
    assert not engine.proposer.num_valid
    return {i: finals[i] for i in ids}


def test_drafts_equal_a_recomputation_from_scratch(tiny_llama):
    """Through chunked prefills, accepted and rejected drafts and preemption, every proposal (greedy and
    seeded sampled, with penalties) is what the head computes from scratch on the request's tokens."""
    prompts = [[(7 * i + 3 * j) % 250 for j in range(5 + 9 * i)] for i in range(6)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, top_k=0 if i % 3 else 20, seed=i,
                             max_new_tokens=20, ignore_eos=True, repetition_penalty=1.2 if i == 3 else 1.0)
              for i in range(6)]
    engine = make_engine(tiny_llama, num_pages=28, max_num_batched_tokens=24, speculative_num_draft_tokens=4,
                         **eagle_kwargs(programmed_head(tiny_llama, feature_scale=0.3)))
    seen = record_proposals(engine)
    outputs = drive(engine, prompts, params)
    assert sum(o.num_preemptions for o in outputs.values()) > 0, "the pool was meant to be too small"
    checked = 0
    for plan, seqs, proposal in seen:
        for s, tokens, drafts, q in zip(plan.scheduled, seqs, proposal.draft_tokens, proposal.draft_probs):
            if not drafts:
                continue
            want, want_q = reference_drafts(engine, s.request, tokens, len(drafts))
            assert list(drafts) == want
            if s.request.params.greedy:
                assert q is None
            else:
                torch.testing.assert_close(q, torch.stack(want_q), rtol=0, atol=1e-9)
            checked += 1
    assert checked > 30
    assert sum(o.spec.num_accepted_drafts for o in outputs.values()) > 10


def first_layer_continuation(target: LoadedCheckpoint, tokens: list[int], n: int) -> list[int]:
    """Greedy tokens after `tokens` from the target's first layer alone, recomputed from scratch for each."""
    model = LlamaModel(first_layers(target, 1).config, target.weights, torch.float64)
    out = list(tokens)
    for _ in range(n):
        pool, pages = fresh(KVGeometry.of(model.config, torch.float64), len(out))
        meta = AttentionMetadata.build([SeqSpan(pages, 0, len(out))], PAGE, pool.null_slot)
        hidden, _ = model.forward(torch.tensor(out), torch.arange(len(out)), meta, pool)
        out.append(int(model.logits(hidden[-1:]).argmax()))
    return out[len(tokens):]


def test_a_head_programmed_as_the_first_layer_drafts_like_it_with_long_accepted_runs(tiny_llama):
    engine = make_engine(tiny_llama, speculative_num_draft_tokens=16, **eagle_kwargs(programmed_head(tiny_llama)))
    seen = record_proposals(engine)
    prompts = [[(5 * i + j * j) % 256 for j in range(3 + 4 * i)] for i in range(6)]
    drive(engine, prompts, [SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)] * 6)
    drafted = [(tokens, d) for _, seqs, p in seen for tokens, d in zip(seqs, p.draft_tokens) if d]
    for tokens, drafts in drafted:
        assert list(drafts) == first_layer_continuation(tiny_llama, tokens, len(drafts))
    histogram = engine.stats.accepted_histogram
    assert sum(histogram[8:]) >= 5, f"expected runs of 8+ accepted drafts, got {histogram}"
    assert engine.stats.accept_length > 2.0
