"""The drafter trainer on the tiny random target: the dense training forward equals the engine's paged
proposer, a few steps reduce the loss, and checkpoint → resume continues bit for bit."""
from __future__ import annotations

import pytest
import torch

from specserve.attention.sdpa import AttentionMetadata, SeqSpan
from specserve.engine import LLM
from specserve.kv_pages import KVPool, slots_for
from specserve.models.block_drafter import BlockDrafter, dense_block_forward, random_block_drafter
from specserve.models.layers import Rope
from specserve.models.llama import LlamaModel
from specserve.train.data import Example, build_token_map
from specserve.train.trainer import DrafterTrainer, TrainConfig, make_batch, sample_anchors, seeded, usable_examples
from specserve.types import SamplingParams
from tests.spec_harness import record_proposals

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
SMALL = dict(block_size=4, anchors=8, batch_size=4, markov_rank=8, draft_vocab=160, max_len=128, holdout=4,
             lr=3e-3, dtype="float64")


def engine(ckpt, **spec) -> LLM:
    return LLM(checkpoint=ckpt, dtype="float64", page_size=4, num_pages=256, **spec)


def randomise_norms(trainer: DrafterTrainer) -> None:
    """Norm weights start at one, where swapping two norms would go unnoticed."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in trainer.params.items():
            if p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) + 0.5)


def test_dense_training_forward_equals_the_engine_proposer(tiny_llama, tmp_path):
    cfg = TrainConfig(**{**SMALL, "block_size": 5}, num_layers=2, target_layer_ids=(0, 1))
    token_map = torch.cat([torch.arange(0, 200, 2), torch.arange(201, 257)])
    trainer = DrafterTrainer(tiny_llama, cfg, token_map)
    randomise_norms(trainer)
    ckpt = trainer.checkpoint((1.0, 2.0, 0.5, 3.0, 1.5))
    ckpt.save(tmp_path)
    spec = engine(tiny_llama, speculative_algorithm="DSPARK", speculative_draft_model_path=str(tmp_path),
                  speculative_block_size=5, speculative_dspark_confidence_threshold=0.0).engine
    drafter = spec.proposer.drafter
    block_logits = []
    base_logits = drafter.logits
    drafter.logits = lambda hidden: block_logits.append(base_logits(hidden)) or block_logits[-1]
    seen = record_proposals(spec)
    for prompt in ([3, 4, 5, 6, 7, 8, 9], [250], [100, 101, 7, 7]):
        spec.add_request(prompt, GREEDY)
        while spec.has_unfinished:
            spec.step()
    drafting = [(tokens[0], proposal) for _, tokens, proposal in seen if proposal.draft_tokens[0]]
    assert len(drafting) == len(block_logits) >= 10
    temperatures = torch.tensor(ckpt.config.confidence_temperatures, dtype=torch.float64)
    checked = 0
    for (tokens, proposal), logits in zip(drafting, block_logits):
        drafts = list(proposal.draft_tokens[0])
        if len(drafts) < 5:
            continue
        anchor = len(tokens) - 1
        batch = make_batch([Example("x", tokens, drafts)])      # row k's previous token is the k-th draft
        out = trainer.forward(batch, torch.tensor([[anchor]]), torch.tensor([[True]]))
        prev = torch.tensor(tokens[-1:] + drafts[:-1])
        want = logits + drafter.markov_logits(prev)
        torch.testing.assert_close(out.draft_logits[0], want, rtol=0, atol=1e-9)
        assert token_map[out.draft_logits[0].argmax(-1)].tolist() == drafts
        confidence = torch.sigmoid(out.confidence_logits[0] / temperatures)
        torch.testing.assert_close(confidence, torch.tensor(proposal.confidences[0], dtype=torch.float64),
                                   rtol=0, atol=1e-9)
        checked += 1
    assert checked >= 10


def test_dense_chain_forward_equals_the_engine_eagle_proposer(tiny_llama, tmp_path):
    """EAGLE's training chain (each row fed the previous row's output feature, attending to the real
    context and its own chain) gives the logits the engine drafts from, row by row."""
    trainer = DrafterTrainer(tiny_llama, TrainConfig(**{**SMALL, "block_size": 5}, algorithm="EAGLE",
                                                     target_layer_ids=(0, 1)), None)
    randomise_norms(trainer)
    trainer.checkpoint().save(tmp_path)
    spec = engine(tiny_llama, speculative_algorithm="EAGLE", speculative_draft_model_path=str(tmp_path),
                  speculative_num_draft_tokens=5).engine
    drafter = spec.proposer.drafter
    row_logits = []
    base_forward = drafter.forward
    drafter.forward = lambda *args: (out := base_forward(*args)) and row_logits.append(out[1]) or out
    seen = record_proposals(spec)
    for prompt in ([3, 4, 5, 6, 7, 8, 9], [250, 12], [100, 101, 7, 7]):
        spec.add_request(prompt, GREEDY)
        while spec.has_unfinished:
            spec.step()
    drafting = [(tokens[0], proposal.draft_tokens[0]) for _, tokens, proposal in seen if proposal.draft_tokens[0]]
    assert len(row_logits) == sum(len(drafts) for _, drafts in drafting) and len(drafting) >= 10
    checked, first_row = 0, 0
    for tokens, drafts in drafting:
        want = torch.cat(row_logits[first_row:first_row + len(drafts)])    # [drafts, vocab]
        first_row += len(drafts)
        if len(drafts) < 5:
            continue
        out = trainer.forward(make_batch([Example("x", tokens, list(drafts))]), torch.tensor([[len(tokens) - 1]]),
                              torch.tensor([[True]]))
        torch.testing.assert_close(out.draft_logits[0], want, rtol=0, atol=1e-9)
        assert out.draft_logits[0].argmax(-1).tolist() == list(drafts) and out.confidence_logits is None
        checked += 1
    assert checked >= 10


def test_dense_block_forward_equals_the_paged_block_with_qk_norm(tiny_llama):
    """The qk-norm path (Qwen3-style drafters), which TrainConfig does not build, against BlockDrafter."""
    target = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float64)
    ckpt = random_block_drafter(tiny_llama.config, "DFLASH", num_layers=2, block_size=3, qk_norm=True, seed=2,
                                dtype=torch.float64)
    for name, weight in ckpt.weights.items():
        if name.endswith("norm.weight"):
            weight.uniform_(0.5, 1.5)
    drafter = BlockDrafter(ckpt, target)
    aux = torch.randn(1, 9, 2 * 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    pool = KVPool(drafter.kv_geometry, 4, 4)
    anchor, pages = 6, [2, 0, 3]
    drafter.write_context(aux[0, :anchor], torch.arange(anchor), torch.tensor(slots_for(pages, 0, anchor, 4)), pool)
    meta = AttentionMetadata.build([SeqSpan(pages, anchor, 3, causal=False)], 4, pool.null_slot)
    mask = ckpt.config.mask_token_id
    paged = drafter.block_hidden(torch.tensor([77, mask, mask]), torch.arange(anchor, anchor + 3), meta, pool)
    rope = Rope(16, ckpt.config.rope_theta, 512, torch.float64)
    dense = dense_block_forward(ckpt.config, ckpt.weights, target.embed, rope, aux, torch.tensor([[anchor]]),
                                torch.tensor([[77]]))
    torch.testing.assert_close(dense[0, 0], paged, rtol=0, atol=1e-10)


def test_batched_blocks_equal_one_block_at_a_time(tiny_llama, tiny_answers):
    """Many anchors over padded sequences of different lengths give each block what it gets alone, and
    the target distribution of each row peaks at the target's own greedy next token."""
    data = usable_examples(tiny_answers, 128)[:4]
    trainer = DrafterTrainer(tiny_llama, TrainConfig(**SMALL), build_token_map(data, 160, 257))
    randomise_norms(trainer)
    batch = make_batch(data)
    anchors, ok = sample_anchors(batch, 6, seeded(1))
    assert len(set(batch.lengths.tolist())) > 1 and ok.sum() > 12
    out = trainer.forward(batch, anchors, ok)
    for b, example in enumerate(data):
        for a in torch.nonzero(ok[b]).flatten().tolist():
            one = trainer.forward(make_batch([example]), anchors[b:b + 1, a:a + 1], ok[b:b + 1, a:a + 1])
            i, rows = b * 6 + a, one.valid[0]
            assert torch.equal(out.valid[i], rows) and torch.equal(out.target_ids[i][rows], one.target_ids[0][rows])
            for got, want in ((out.draft_logits, one.draft_logits), (out.target_probs, one.target_probs),
                              (out.confidence_logits, one.confidence_logits)):
                torch.testing.assert_close(got[i][rows], want[0][rows], rtol=0, atol=1e-10)
    rows = out.valid & (out.target_ids >= 0)
    assert (out.target_probs.argmax(-1)[rows] == out.target_ids[rows]).all()


@pytest.mark.parametrize("algorithm", ["DSPARK", "EAGLE"])
def test_a_few_steps_reduce_the_loss(tiny_llama, tiny_answers, tmp_path, algorithm):
    trainer = DrafterTrainer(tiny_llama, TrainConfig(**SMALL, algorithm=algorithm, max_steps=40, save_every=100), None)
    batch = make_batch(usable_examples(tiny_answers, 128)[:8])

    def held_loss():
        with torch.no_grad():
            return trainer.losses(batch, seeded(9))

    before = held_loss()
    trainer.train(usable_examples(tiny_answers, 128), tmp_path / "state.pt")
    after = held_loss()
    assert after.total.item() < 0.8 * before.total.item()
    assert after.accept_length > before.accept_length and after.acceptance > before.acceptance


def test_checkpoint_then_resume_continues_identically(tiny_llama, tiny_answers, tmp_path, monkeypatch):
    cfg = TrainConfig(**SMALL, max_steps=5, save_every=2)
    data = usable_examples(tiny_answers, 128)
    straight = DrafterTrainer(tiny_llama, cfg, None)
    saves = []
    save = DrafterTrainer.save
    monkeypatch.setattr(DrafterTrainer, "save", lambda self, path: saves.append(self.step) or save(self, path))
    straight.train(data, tmp_path / "straight.pt")
    assert saves == [2, 4, 5]

    interrupted = DrafterTrainer(tiny_llama, cfg, None)
    interrupted.train(data, tmp_path / "resumed.pt", until=2)
    resumed = DrafterTrainer(tiny_llama, cfg, None)
    resumed.load(tmp_path / "resumed.pt")
    assert resumed.step == 2
    resumed.train(data, tmp_path / "resumed.pt")
    assert resumed.step == 5
    for name, p in straight.params.items():
        assert torch.equal(p, resumed.params[name]), name
    with pytest.raises(ValueError, match="other drafter settings"):
        DrafterTrainer(tiny_llama, TrainConfig(**{**SMALL, "markov_rank": 4}), None).load(tmp_path / "resumed.pt")
