"""The block drafter model: paged block forward against a dense reference, the Markov and confidence
heads, the draft vocabulary, and the checkpoint folder (round trip and every mismatch error)."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from specserve import sampling
from specserve.attention.sdpa import AttentionMetadata, SeqSpan
from specserve.kv_pages import KVGeometry, KVPool, slots_for
from specserve.models import LlamaModel
from specserve.models.block_drafter import (
    BlockDrafter,
    BlockDrafterCheckpoint,
    context_vectors,
    random_block_drafter,
    weight_shapes,
)
from specserve.models.layers import Rope, rms_norm
from specserve.native.ops import apply_rope, dequantize_kv
from specserve.quantization import Int8Linear
from specserve.speculative.block_proposer import BlockDrafterProposer
from specserve.types import Proposal, SamplingParams, StepPlan
from tests.spec_harness import make_engine, record_proposals, run


def edit(ckpt: BlockDrafterCheckpoint, **config) -> BlockDrafterCheckpoint:
    return BlockDrafterCheckpoint(dataclasses.replace(ckpt.config, **config), dict(ckpt.weights))


def save(ckpt: BlockDrafterCheckpoint, folder) -> str:
    ckpt.save(folder)
    return str(folder)


def drafted(seen: list[tuple[StepPlan, list[list[int]], Proposal]]) -> list[tuple[int, tuple[int, ...]]]:
    """(anchor, drafts) of every request that drafted, in step order."""
    return [(tokens[-1], d) for _, seqs, p in seen for tokens, d in zip(seqs, p.draft_tokens) if d]


@pytest.fixture(scope="module")
def target(tiny_llama) -> LlamaModel:
    return LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float64)


# ---- the forward ----------------------------------------------------------------------------------

def dense_block(ckpt: BlockDrafterCheckpoint, target: LlamaModel, aux: torch.Tensor,   # [P, K * hidden]
                block_ids: list[int]) -> torch.Tensor:
    """The drafter written out densely from the checkpoint's tensors: context at positions 0..P-1,
    the block at P..P+n-1, every block row attending to all context and block keys."""
    c, w = ckpt.config, ckpt.weights
    eps, d = c.rms_norm_eps, c.head_dim
    P, n = len(aux), len(block_ids)
    rope = Rope(d, c.rope_theta, 256, torch.float64)
    ctx_rope, block_rope = rope.tables(torch.arange(P)), rope.tables(torch.arange(P, P + n))
    ctx = rms_norm(aux @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = target.embed[block_ids]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."

        def proj(t: torch.Tensor, name: str, heads: int, norm: str | None = None) -> torch.Tensor:
            out = (t @ w[p + f"self_attn.{name}_proj.weight"].T).view(len(t), heads, d)
            return rms_norm(out, w[p + f"self_attn.{norm}_norm.weight"], eps) if c.qk_norm and norm else out

        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = apply_rope(proj(h, "q", c.num_attention_heads, "q"), *block_rope)
        k = torch.cat([apply_rope(proj(ctx, "k", c.num_key_value_heads, "k"), *ctx_rope),
                       apply_rope(proj(h, "k", c.num_key_value_heads, "k"), *block_rope)])
        v = torch.cat([proj(ctx, "v", c.num_key_value_heads), proj(h, "v", c.num_key_value_heads)])
        att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), enable_gqa=True)
        x = x + att.transpose(0, 1).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms_norm(x, w["model.norm.weight"], eps)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_paged_block_forward_matches_dense_reference(tiny_llama, target, qk_norm):
    ckpt = random_block_drafter(tiny_llama.config, "DFLASH", num_layers=2, qk_norm=qk_norm, dtype=torch.float64)
    drafter = BlockDrafter(ckpt, target)
    page_size = 4
    pool = KVPool(drafter.kv_geometry, 16, page_size)
    pool.fill_pages(list(range(16)), float("nan"))     # anything unwritten that is read shows up as nan
    g = torch.Generator().manual_seed(1)
    seqs = [(11, [5, 9, 9, 9, 9]), (3, [7, 9, 9])]       # (context length, block ids: anchor then mask rows)
    pages = [[6, 2, 4, 0], [5, 7]]                         # out of order on purpose
    auxes = [torch.randn(P, 2 * 64, generator=g, dtype=torch.float64) * 3 for P, _ in seqs]
    for (P, _), aux, pg in zip(seqs, auxes, pages):
        drafter.write_context(aux, torch.arange(P), slots_for(pg, 0, P, page_size), pool)
    meta = AttentionMetadata.build([SeqSpan(pg, P, len(ids), causal=False) for (P, ids), pg in zip(seqs, pages)],
                                   page_size, pool.null_slot)
    ids = [t for _, block in seqs for t in block]
    positions = [p for P, block in seqs for p in range(P, P + len(block))]
    hidden = drafter.block_hidden(torch.tensor(ids), torch.tensor(positions), meta, pool)
    want = torch.cat([dense_block(ckpt, target, aux, block) for aux, (_, block) in zip(auxes, seqs)])
    torch.testing.assert_close(hidden, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("context_norm", [True, False])
def test_an_int8_target_quantizes_fc_only_over_normalised_target_layers(tiny_llama, context_norm):
    """fc reads the target layers side by side; their scales differ, so it is int8 (a scale per 128 inputs) only
    when context_norm brings each layer to RMS 1 first. The context it computes stays close to float's."""
    int8_target = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32, quantization="int8")
    ckpt = random_block_drafter(tiny_llama.config, "DSPARK", context_norm=context_norm, anchor_feature=True)
    drafter = BlockDrafter(ckpt, int8_target)
    assert isinstance(drafter.fc, Int8Linear) == context_norm and isinstance(drafter.anchor_proj, Int8Linear)
    layers = len(ckpt.config.target_layer_ids)
    scales = torch.logspace(0, 1.3, layers)[:, None]                     # RMS 1 .. 20 across the layers
    aux = torch.randn(6, layers, ckpt.config.target_hidden_size, generator=torch.Generator().manual_seed(0))
    aux = (aux * scales).flatten(1)
    got = drafter.write_context(aux, torch.arange(6), torch.arange(6), KVPool(drafter.kv_geometry, 4, 4))
    want = context_vectors(ckpt.config, aux, lambda t: t @ ckpt.weights["fc.weight"].T,
                           ckpt.weights["hidden_norm.weight"])
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.int8])
def test_the_native_context_write_is_the_python_one(tiny_llama, kv_dtype):
    """With an int8 target and context_norm, the context is written by one native op (native/context.cpp): the
    same context vectors and pool contents as the torch ops it replaces, at the slots asked for and nowhere else."""
    int8_target = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32, quantization="int8")
    ckpt = random_block_drafter(tiny_llama.config, "DSPARK", num_layers=2, context_norm=True, anchor_feature=True)
    drafter = BlockDrafter(ckpt, int8_target)
    assert drafter.native_context
    layers = len(ckpt.config.target_layer_ids)
    scales = torch.logspace(0, 1.3, layers)[:, None]
    aux = torch.randn(5, layers, ckpt.config.target_hidden_size, generator=torch.Generator().manual_seed(3))
    aux = (aux * scales).flatten(1)
    positions, slots = torch.tensor([7, 8, 9, 30, 31]), torch.tensor([2, 3, 4, 13, 9])
    geometry = dataclasses.replace(drafter.kv_geometry, dtype=kv_dtype)
    pools = {}
    for native in (True, False):
        pools[native] = pool = KVPool(geometry, 4, 4)
        pool.fill_pages(list(range(4)), 0.0)
        drafter.native_context = native
        pools[native, "context"] = drafter.write_context(aux, positions, slots, pool)
    torch.testing.assert_close(pools[True, "context"], pools[False, "context"], rtol=1e-5, atol=1e-5)
    for got, want in ((pools[True].k, pools[False].k), (pools[True].v, pools[False].v)):
        if kv_dtype == torch.int8:       # a value on a rounding boundary may land one level apart
            got, want = dequantize_kv(got), dequantize_kv(want)
        torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02)
        untouched = torch.ones(got.shape[1], dtype=torch.bool)
        untouched[slots] = False
        assert not got[:, untouched].any() and got[:, slots].abs().sum() > 0


@pytest.mark.parametrize("anchor_slot", [False, True])
def test_engine_drafts_are_the_dense_drafters_argmax(tiny_llama, target, tmp_path, anchor_slot):
    """End to end: each greedy DFLASH proposal equals the argmax of the dense reference over the
    request's tokens at that step (context = all but the anchor), so the proposer's block is
    non-causal, at the right positions, over a complete and correct context. In DFlash's layout the
    block has one more slot, the anchor's, and the drafts come from the mask slots after it."""
    token_map = torch.arange(1, 257, 2)
    ckpt = random_block_drafter(tiny_llama.config, "DFLASH", num_layers=2, token_map=token_map, seed=4,
                                anchor_slot=anchor_slot, dtype=torch.float64)
    engine = make_engine(tiny_llama, speculative_algorithm="DFLASH", speculative_draft_model_path=save(ckpt, tmp_path),
                         speculative_block_size=6, max_num_batched_tokens=16)
    seen = record_proposals(engine)
    for prompt in ([3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [250], [100, 101, 7]):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    checked = 0
    ids = engine.proposer.aux_layer_ids
    pool = KVPool(KVGeometry.of(target.config, torch.float64), 16, 4)
    for _, seqs, proposal in seen:
        for tokens, drafts in zip(seqs, proposal.draft_tokens):
            if not drafts:
                continue
            context = len(tokens) - 1
            aux = torch.zeros(0, 2 * 64, dtype=torch.float64)
            if context:
                meta = AttentionMetadata.build([SeqSpan(list(range(16)), 0, context)], 4, pool.null_slot)
                _, layers = target.forward(torch.tensor(tokens[:-1]), torch.arange(context), meta, pool, ids)
                aux = torch.cat(layers, dim=-1)
            block = [tokens[-1]] + [ckpt.config.mask_token_id] * (len(drafts) - 1 + anchor_slot)
            logits = target.logits(dense_block(ckpt, target, aux, block)[anchor_slot:])[:, token_map]
            assert list(drafts) == token_map[logits.argmax(-1)].tolist()
            checked += 1
    assert checked >= 15


def test_lm_head_is_the_targets_restricted_to_the_token_map(tiny_llama, target):
    token_map = torch.tensor([200, 3, 17, 256, 40])
    mapped = BlockDrafter(random_block_drafter(tiny_llama.config, token_map=token_map, dtype=torch.float64), target)
    full = BlockDrafter(random_block_drafter(tiny_llama.config, dtype=torch.float64), target)
    hidden = torch.randn(3, 64, dtype=torch.float64)
    torch.testing.assert_close(mapped.logits(hidden), target.logits(hidden)[:, token_map], rtol=0, atol=1e-12)
    assert full.model.head is target.head and full.model.embed is target.embed, "shared, not copied"
    assert mapped.to_draft[token_map].tolist() == list(range(5)) and mapped.to_draft[0] == 5


def test_confidence_head_is_sigmoid_of_linear_over_hidden_and_markov_embedding(tiny_llama, target):
    token_map = torch.arange(0, 257, 2)
    ckpt = random_block_drafter(tiny_llama.config, token_map=token_map, markov_rank=6, block_size=4,
                                dtype=torch.float64)
    ckpt = edit(ckpt, confidence_temperatures=(1.0, 2.0, 0.5, 3.0))
    drafter = BlockDrafter(ckpt, target)
    w = ckpt.weights
    hidden = torch.randn(5, 64, dtype=torch.float64)
    prev = torch.tensor([4, 5, 10, 0, 256])               # 5 is outside the map: its Markov embedding is zero
    rows = torch.tensor([0, 1, 2, 3, 1])
    emb = torch.stack([w["markov.w1.weight"][t // 2] if t % 2 == 0 else torch.zeros(6, dtype=torch.float64)
                       for t in prev.tolist()])
    logit = torch.cat([hidden, emb], -1) @ w["confidence.weight"][0] + w["confidence.bias"]
    want = torch.sigmoid(logit / torch.tensor([1.0, 2.0, 0.5, 3.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(drafter.confidence(hidden, drafter.to_draft[prev], rows), want, rtol=0, atol=1e-14)
    markov = emb @ w["markov.w2.weight"].T
    torch.testing.assert_close(drafter.markov_logits(drafter.to_draft[prev]), markov, rtol=0, atol=1e-12)
    base = torch.randn(5, len(token_map), dtype=torch.float64)
    torch.testing.assert_close(drafter.markov_logits(drafter.to_draft[prev], base), base + markov, rtol=0, atol=1e-12)


@pytest.mark.parametrize("jobs,rows", [(1, 8), (3, 2)])
def test_the_native_greedy_heads_are_the_python_ones(tiny_llama, jobs, rows):
    """With int8 heads, a greedy block's draft head, Markov chain and confidences are one native op
    (native/markov.cpp's dspark_greedy): the same picks and confidences as the ops it replaces, and the chain
    matters (each pick's Markov term changes the next)."""
    int8_target = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float32, quantization="int8")
    ckpt = random_block_drafter(tiny_llama.config, "DSPARK", token_map=torch.arange(0, 257, 2), markov_rank=8,
                                block_size=8, seed=5)
    ckpt.weights["markov.w1.weight"] *= 8                  # a Markov term as large as the head's logits
    drafter = BlockDrafter(ckpt, int8_target)
    assert drafter.native_heads
    g = torch.Generator().manual_seed(jobs)
    hidden = torch.randn(jobs, rows, 64, generator=g)
    prev = torch.tensor([5, 128, 40][:jobs])              # 128: outside the draft vocabulary, no Markov term
    proposer = BlockDrafterProposer(drafter, gamma=8)
    got = proposer._greedy_drafts(hidden, prev)
    drafter.native_heads = False
    want = proposer._greedy_drafts(hidden, prev)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    independent = sampling.greedy_tokens(drafter.logits(hidden.flatten(0, 1))).view(jobs, rows)
    assert rows == 2 or not torch.equal(got[0], independent)


# ---- the Markov head in the engine -----------------------------------------------------------------

def successor_markov(ckpt: BlockDrafterCheckpoint, scale: float = 1e6) -> BlockDrafterCheckpoint:
    """Program a rank-2 Markov head so that draft id d strongly predicts draft id d + 1 (mod V_d):
    W1[d] and W2[e] are unit vectors at angles 2πd/V_d and 2π(e-1)/V_d, so the term peaks at e = d + 1."""
    vd = ckpt.config.draft_vocab_size
    angle = 2 * math.pi * torch.arange(vd, dtype=torch.float64) / vd
    unit = torch.stack([angle.cos(), angle.sin()], dim=-1)
    ckpt.weights["markov.w1.weight"] = unit
    ckpt.weights["markov.w2.weight"] = scale * unit.roll(1, dims=0)
    return ckpt


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_markov_head_is_applied_row_by_row_with_the_drafted_previous_token(tiny_llama, tmp_path, temperature):
    ckpt = successor_markov(random_block_drafter(tiny_llama.config, markov_rank=2, block_size=8, dtype=torch.float64))
    engine = make_engine(tiny_llama, speculative_algorithm="DSPARK", speculative_draft_model_path=save(ckpt, tmp_path),
                         speculative_block_size=6, speculative_dspark_confidence_threshold=0.0)
    seen = record_proposals(engine)
    vocab = tiny_llama.config.vocab_size
    for prompt in ([3, 4, 5], [250], [100, 101]):
        engine.add_request(prompt, SamplingParams(temperature=temperature, max_new_tokens=10, seed=1, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    chains = drafted(seen)
    assert len(chains) >= 6
    for anchor, drafts in chains:
        assert list(drafts) == [(anchor + k) % vocab for k in range(1, len(drafts) + 1)]


def test_without_the_markov_term_the_same_weights_draft_otherwise(tiny_llama, tmp_path):
    """Control for the test above: the chain comes from the Markov head, not from the base drafter."""
    ckpt = random_block_drafter(tiny_llama.config, markov_rank=2, block_size=8, dtype=torch.float64)
    engine = make_engine(tiny_llama, speculative_algorithm="DSPARK", speculative_draft_model_path=save(ckpt, tmp_path),
                         speculative_block_size=6, speculative_dspark_confidence_threshold=0.0)
    seen = record_proposals(engine)
    engine.add_request([3, 4, 5], SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    vocab = tiny_llama.config.vocab_size
    assert not any(list(d) == [(a + k) % vocab for k in range(1, len(d) + 1)] for a, d in drafted(seen))


# ---- checkpoint --------------------------------------------------------------------------------------

def test_checkpoint_round_trip_gives_identical_proposals(tiny_llama, tmp_path):
    token_map = torch.randperm(257, generator=torch.Generator().manual_seed(0))[:96]
    ckpt = random_block_drafter(tiny_llama.config, token_map=token_map,
                                num_layers=2, qk_norm=True, dtype=torch.float64, seed=3)
    first = save(ckpt, tmp_path / "a")
    loaded = BlockDrafterCheckpoint.load(first)
    assert loaded.config == ckpt.config and loaded.weights.keys() == ckpt.weights.keys()
    assert all(torch.equal(loaded.weights[k], v) for k, v in ckpt.weights.items())
    assert "model.embed_tokens.weight" not in loaded.weights and "lm_head.weight" not in loaded.weights
    second = save(loaded, tmp_path / "b")
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["architectures"] == ["BlockDrafter"] and config["target_hidden_size"] == 64
    prompts = [[1, 2, 3, 4], [9] * 7]
    params = [SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=4, max_new_tokens=12, ignore_eos=True)]
    proposals = []
    for folder in (first, second):
        engine = make_engine(tiny_llama, speculative_algorithm="DSPARK", speculative_draft_model_path=folder,
                             speculative_dspark_confidence_threshold=0.3)
        seen = record_proposals(engine)
        for p, sp in zip(prompts, params):
            engine.add_request(p, sp)
        while engine.has_unfinished:
            engine.step()
        proposals.append([p for *_, p in seen])
    assert len(proposals[0]) == len(proposals[1]) > 5
    for a, b in zip(*proposals):
        assert a.draft_tokens == b.draft_tokens and a.confidences == b.confidences
        for qa, qb in zip(a.draft_probs, b.draft_probs):
            assert (qa is None) == (qb is None) and (qa is None or torch.equal(qa, qb))


def test_token_map_flag_overrides_the_checkpoint_and_confines_the_drafts(tiny_llama, tmp_path):
    ckpt = random_block_drafter(tiny_llama.config, token_map=torch.arange(40), dtype=torch.float64)
    token_map = torch.arange(100, 140)
    torch.save(token_map, tmp_path / "map.pt")
    engine = make_engine(tiny_llama, speculative_algorithm="DSPARK",
                         speculative_draft_model_path=save(ckpt, tmp_path / "d"),
                         speculative_token_map_path=str(tmp_path / "map.pt"),
                         speculative_dspark_confidence_threshold=0.0)
    seen = record_proposals(engine)
    engine.add_request([5, 6, 7], SamplingParams(temperature=1.0, seed=0, max_new_tokens=8, ignore_eos=True))
    engine.add_request([8, 9], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    drafts = [t for _, d in drafted(seen) for t in d]
    assert drafts and all(100 <= t < 140 for t in drafts)
    for *_, p in seen:
        for q in p.draft_probs:
            if q is not None:      # q is over the full vocabulary, zero outside the map
                assert q.shape[-1] == 257 and q[:, :100].sum() == 0 and q[:, 140:].sum() == 0
                torch.testing.assert_close(q.sum(-1), torch.ones(len(q), dtype=q.dtype))


def without(ckpt: BlockDrafterCheckpoint, name: str) -> BlockDrafterCheckpoint:
    return BlockDrafterCheckpoint(ckpt.config, {k: v for k, v in ckpt.weights.items() if k != name})


MISMATCHES = {
    "hidden size": (lambda c: edit(c, target_hidden_size=32), {}, "hidden size 32"),
    "vocab": (lambda c: edit(c, target_vocab_size=300), {}, "vocabulary of 300"),
    "layer ids out of range": (lambda c: edit(c, target_layer_ids=(0, 2)), {}, r"target_layer_ids \[0, 2\]"),
    "layer ids not increasing": (lambda c: edit(c, target_layer_ids=(1, 0)), {}, r"target_layer_ids \[1, 0\]"),
    "wrong algorithm": (lambda c: c, {"speculative_algorithm": "DFLASH"}, "it is a DSPARK drafter"),
    "mask token": (lambda c: edit(c, mask_token_id=257), {}, "mask_token_id 257"),
    "missing tensor": (lambda c: without(c, "markov.w2.weight"), {}, "markov.w2.weight is missing"),
    "wrong shape": (lambda c: edit(c, markov_rank=4), {}, r"markov.w1.weight has shape \[257, 8\]"),
    "temperatures": (lambda c: edit(c, confidence_temperatures=(1.0,) * 3), {}, "confidence temperature"),
    "no token map": (lambda c: edit(c, algorithm="DFLASH", markov_rank=0, draft_vocab_size=100),
                     {"speculative_algorithm": "DFLASH"}, "no token map"),
    "token map size": (lambda c: BlockDrafterCheckpoint(c.config, {**c.weights, "token_map": torch.arange(5)}), {},
                       "token map must hold 257"),
    "block size": (lambda c: c, {"speculative_block_size": 17}, r"block-size must be in \[1, 16\]"),
    "threshold": (lambda c: c, {"speculative_dspark_confidence_threshold": 1.5}, "threshold must be in"),
}


@pytest.mark.parametrize("case", MISMATCHES)
def test_every_mismatch_is_a_clear_startup_error(tiny_llama, tmp_path, case):
    change, engine_kw, message = MISMATCHES[case]
    ckpt = change(random_block_drafter(tiny_llama.config, dtype=torch.float64))
    kw = {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": save(ckpt, tmp_path), **engine_kw}
    with pytest.raises(ValueError, match=message):
        make_engine(tiny_llama, **kw)


def test_a_folder_that_is_no_block_drafter_and_a_missing_path_are_refused(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        make_engine(tiny_llama, speculative_algorithm="DFLASH")
    with pytest.raises(ValueError, match="needs a folder with config.json and model.safetensors"):
        make_engine(tiny_llama, speculative_algorithm="DFLASH", speculative_draft_model_path=str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="not a block drafter checkpoint"):
        make_engine(tiny_llama, speculative_algorithm="DFLASH", speculative_draft_model_path=str(tmp_path))
    with pytest.raises(ValueError, match="not from a language model checkpoint"):
        make_engine(tiny_llama, tiny_llama, speculative_algorithm="DFLASH")


def test_random_drafter_has_exactly_the_checkpoint_tensors(tiny_llama):
    for algorithm in ("DFLASH", "DSPARK"):
        ckpt = random_block_drafter(tiny_llama.config, algorithm, num_layers=2)
        assert {k: tuple(v.shape) for k, v in ckpt.weights.items()} == weight_shapes(ckpt.config)
        assert ("markov.w1.weight" in ckpt.weights) == (algorithm == "DSPARK")


def test_dflash_verifies_the_whole_block(tiny_llama, tmp_path):
    ckpt = random_block_drafter(tiny_llama.config, "DFLASH", block_size=8, dtype=torch.float64)
    folder = save(ckpt, tmp_path)
    out = run(tiny_llama, [[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True),
              speculative_algorithm="DFLASH", speculative_draft_model_path=folder, speculative_block_size=5)
    s = out.outputs[0].spec
    # Nothing accepted, so step j (j - 1 tokens out) verifies min(5, tokens still allowed after its bonus)
    # drafts, except step 1, which has no draft context yet.
    assert s.verify_ct == 30
    assert s.num_proposed_drafts == sum(min(5, 30 - j) for j in range(2, 31))
