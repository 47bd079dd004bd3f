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
from specserve.train.features import TargetPass
from specserve.train.trainer import (
    DrafterTrainer,
    TrainConfig,
    count_bigram,
    make_batch,
    sample_anchors,
    seeded,
    sequence,
    usable_examples,
    walk_accept_length,
)
from specserve.types import SamplingParams
from tests.spec_harness import record_proposals

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
SMALL = dict(block_size=4, anchors=8, batch_size=4, markov_rank=8, draft_vocab=160, max_len=128, holdout=4,
             lr=3e-3, dtype="float64")


def engine(ckpt, **spec) -> LLM:
    return LLM(checkpoint=ckpt, dtype="float64", page_size=4, num_pages=256, **spec)


def target_pass(target, trainer: DrafterTrainer) -> TargetPass:
    """The tiny target's whole distribution (k = its vocabulary), so the distribution loss is exact."""
    return TargetPass(target, trainer.config.target_layer_ids, target.config.vocab_size, "none", torch.float64)


def live_batch(target, trainer: DrafterTrainer, examples: list[Example]):
    return make_batch(examples, target_pass(target, trainer)([sequence(e) for e in examples]))


def live_features(target, trainer: DrafterTrainer, examples: list[Example]):
    run = target_pass(target, trainer)
    return lambda indices: run([sequence(examples[i]) for i in indices])


def randomise_norms(trainer: DrafterTrainer) -> None:
    """Norm weights start at one, where swapping two norms would go unnoticed."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in trainer.params.items():
            if p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) + 0.5)


@pytest.mark.parametrize("anchor_slot", [False, True])
def test_dense_training_forward_equals_the_engine_proposer(tiny_llama, tmp_path, anchor_slot):
    """DSPARK with the context norm and anchor feature (the defaults), in either slot layout."""
    cfg = TrainConfig(**{**SMALL, "block_size": 5}, num_layers=2, target_layer_ids=(0, 1), anchor_slot=anchor_slot)
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
        batch = live_batch(tiny_llama, trainer, [Example("x", tokens, drafts)])   # row k's previous token: draft k
        out = trainer.forward(batch, torch.tensor([[anchor]]), torch.tensor([[True]]))
        prev = torch.tensor(tokens[-1:] + drafts[:-1])
        want = logits + drafter.markov_logits(drafter.to_draft[prev])
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
        out = trainer.forward(live_batch(tiny_llama, trainer, [Example("x", tokens, list(drafts))]),
                              torch.tensor([[len(tokens) - 1]]),
                              torch.tensor([[True]]))
        torch.testing.assert_close(out.draft_logits[0], want, rtol=0, atol=1e-9)
        assert out.draft_logits[0].argmax(-1).tolist() == list(drafts) and out.confidence_logits is None
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("anchor_slot", [False, True])
def test_dense_block_forward_equals_the_paged_block_with_qk_norm(tiny_llama, anchor_slot):
    """The qk-norm path (Qwen3-style drafters), which TrainConfig does not build, against BlockDrafter; in
    DFlash's layout too, where the anchor's slot runs and its row is left out."""
    target = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float64)
    ckpt = random_block_drafter(tiny_llama.config, "DFLASH", num_layers=2, block_size=3, qk_norm=True, seed=2,
                                anchor_slot=anchor_slot, dtype=torch.float64)
    for name, weight in ckpt.weights.items():
        if name.endswith("norm.weight"):
            weight.uniform_(0.5, 1.5)
    drafter = BlockDrafter(ckpt, target)
    aux = torch.randn(1, 9, 2 * 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    pool = KVPool(drafter.kv_geometry, 4, 4)
    anchor, pages = 6, [2, 0, 3]
    drafter.write_context(aux[0, :anchor], torch.arange(anchor), slots_for(pages, 0, anchor, 4), pool)
    slots = 3 + anchor_slot
    meta = AttentionMetadata.build([SeqSpan(pages, anchor, slots, causal=False)], 4, pool.null_slot)
    mask = ckpt.config.mask_token_id
    paged = drafter.block_hidden(torch.tensor([77] + [mask] * (slots - 1)), torch.arange(anchor, anchor + slots),
                                 meta, pool)[anchor_slot:]
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
    batch = live_batch(tiny_llama, trainer, data)
    anchors, ok = sample_anchors(batch, 6, seeded(1))
    assert len(set(batch.lengths.tolist())) > 1 and ok.sum() > 12
    out = trainer.forward(batch, anchors, ok)
    assert len(out.valid) == ok.sum()                       # the valid anchors' blocks only, in batch order
    i = -1
    for b, example in enumerate(data):
        for a in torch.nonzero(ok[b]).flatten().tolist():
            one = trainer.forward(live_batch(tiny_llama, trainer, [example]), anchors[b:b + 1, a:a + 1],
                                  ok[b:b + 1, a:a + 1])
            i, rows = i + 1, one.valid[0]
            assert torch.equal(out.valid[i], rows) and torch.equal(out.target_ids[i][rows], one.target_ids[0][rows])
            for got, want in ((out.draft_logits, one.draft_logits), (out.target.probs, one.target.probs),
                              (out.target.ids, one.target.ids), (out.confidence_logits, one.confidence_logits)):
                torch.testing.assert_close(got[i][rows], want[0][rows], rtol=0, atol=1e-10)
            # the answers are the target's own greedy tokens: row k learns the token at anchor + k + 1
            following = sequence(example)[anchors[b, a] + 1:][:SMALL["block_size"]]
            want_ids = trainer.to_draft[torch.tensor(following)]
            assert torch.equal(out.target_ids[i][rows], want_ids[:int(rows.sum())])


def test_train_rows_run_the_first_rows_of_each_block_as_the_engine_runs_a_short_block(tiny_llama, tiny_answers):
    """--train-rows 2 of a 4-row drafter: a step runs and scores 2 rows per anchor, each the paged proposer's
    2-row block (the engine runs short blocks too); evaluation still runs whole blocks."""
    data = usable_examples(tiny_answers, 128)[:2]
    trainer = DrafterTrainer(tiny_llama, TrainConfig(**SMALL, train_rows=2), build_token_map(data, 160, 257))
    randomise_norms(trainer)
    batch = live_batch(tiny_llama, trainer, data)
    anchors, ok = sample_anchors(batch, 3, seeded(1))
    short, whole = trainer.forward(batch, anchors, ok, 2), trainer.forward(batch, anchors, ok)
    assert short.draft_logits.shape[1] == 2 and whole.draft_logits.shape[1] == 4
    assert torch.equal(short.target_ids, whole.target_ids[:, :2]) and torch.equal(short.valid, whole.valid[:, :2])
    step_anchors = sample_anchors(batch, SMALL["anchors"], seeded(1))
    assert trainer.losses(batch, seeded(1)).rows == int(trainer.forward(batch, *step_anchors, 2).valid.sum()) \
        < int(trainer.forward(batch, *step_anchors).valid.sum())
    assert not torch.allclose(short.draft_logits, whole.draft_logits[:, :2]), "two fewer mask rows to attend to"
    target = LlamaModel(tiny_llama.config, tiny_llama.weights, torch.float64)
    drafter = BlockDrafter(trainer.checkpoint((1.0,) * 4), target)
    b, a = 0, int(anchors[0, 1])
    aux = batch.target.aux[b, :a]
    pool = KVPool(drafter.kv_geometry, 64, 4)
    pages = list(range(64))
    drafter.write_context(aux, torch.arange(a), slots_for(pages, 0, a, 4), pool)
    meta = AttentionMetadata.build([SeqSpan(pages, a, 2, causal=False)], 4, pool.null_slot)
    mask = trainer.config.mask_token_id
    hidden = drafter.block_hidden(torch.tensor([int(batch.tokens[b, a]), mask]), torch.arange(a, a + 2), meta, pool,
                                  drafter.write_context(aux[a - 1:a], torch.tensor([a - 1]),
                                                        slots_for(pages, a - 1, a, 4), pool).expand(2, -1))
    prev = drafter.to_draft[batch.tokens[b, a:a + 2]]
    torch.testing.assert_close(drafter.logits(hidden) + drafter.markov_logits(prev), short.draft_logits[1], rtol=0,
                               atol=1e-9)
    report = trainer.evaluate(data, lambda indices: live_batch(tiny_llama, trainer, [data[i] for i in indices]).target,
                              torch.arange(257))
    assert len(report["row_top1"]) == 4, "evaluation runs whole blocks"
    with pytest.raises(ValueError, match="--train-rows"):
        DrafterTrainer(tiny_llama, TrainConfig(**SMALL, train_rows=5), None)


@pytest.mark.parametrize("algorithm", ["DSPARK", "EAGLE"])
def test_a_few_steps_reduce_the_loss(tiny_llama, tiny_answers, tmp_path, algorithm):
    trainer = DrafterTrainer(tiny_llama, TrainConfig(**SMALL, algorithm=algorithm, max_steps=40, save_every=100), None)
    data = usable_examples(tiny_answers, 128)
    batch = live_batch(tiny_llama, trainer, data[:8])

    def held_loss():
        with torch.no_grad():
            return trainer.losses(batch, seeded(9))

    before = held_loss()
    trainer.train(data, live_features(tiny_llama, trainer, data), tmp_path / "state.pt")
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
    straight.train(data, live_features(tiny_llama, straight, data), tmp_path / "straight.pt")
    assert saves == [2, 4, 5]

    interrupted = DrafterTrainer(tiny_llama, cfg, None)
    interrupted.train(data, live_features(tiny_llama, interrupted, data), tmp_path / "resumed.pt", until=2)
    resumed = DrafterTrainer(tiny_llama, cfg, None)
    resumed.load(tmp_path / "resumed.pt")
    assert resumed.step == 2
    resumed.train(data, live_features(tiny_llama, resumed, data), tmp_path / "resumed.pt")
    assert resumed.step == 5
    for name, p in straight.params.items():
        assert torch.equal(p, resumed.params[name]), name
    with pytest.raises(ValueError, match="other drafter settings"):
        DrafterTrainer(tiny_llama, TrainConfig(**{**SMALL, "markov_rank": 4}), None).load(tmp_path / "resumed.pt")


def test_anchors_zero_takes_every_answer_position(tiny_llama, tiny_answers):
    data = usable_examples(tiny_answers, 128)[:3]
    trainer = DrafterTrainer(tiny_llama, TrainConfig(**SMALL), None)
    batch = live_batch(tiny_llama, trainer, data)
    anchors, ok = sample_anchors(batch, 0, seeded(1))
    for b, e in enumerate(data):
        want = list(range(max(len(e.prompt_ids), 1), len(e.prompt_ids) + len(e.output_ids) - 1))
        assert anchors[b][ok[b]].tolist() == want


def test_count_bigram_takes_the_most_frequent_next_token():
    examples = [Example("a", [9], [1, 2, 1, 3, 1, 2]), Example("b", [9], [4, 5, 4, 6, 4, 6, 7])]
    table = count_bigram(examples, 10)
    assert table[1] == 2 and table[4] == 6 and table[6] == 4 and table[3] == 1
    assert table[5] == 4 and table[8] == 8       # ties: the lower id; unseen: itself
    assert count_bigram([Example("c", [0], [2, 7, 2, 5])], 10)[2] == 5


def test_held_out_report_scores_the_drafter_and_the_bigram_on_every_anchor(tiny_llama, tiny_answers):
    data = usable_examples(tiny_answers, 128)
    trainer = DrafterTrainer(tiny_llama, TrainConfig(**SMALL), None)
    bigram = count_bigram(data, 257)
    report = trainer.evaluate(data[:5], live_features(tiny_llama, trainer, data[:5]), bigram)
    anchors = sum(len(sequence(e)) - 1 - max(len(e.prompt_ids), 1) for e in data[:5])
    assert report["blocks"] == anchors and len(report["row_top1"]) == SMALL["block_size"]
    # the bigram's row 0, counted by hand: the most frequent follower of the anchor token is the target's next
    hits = total = 0
    for e in data[:5]:
        seq = sequence(e)
        for a in range(max(len(e.prompt_ids), 1), len(seq) - 1):
            hits += int(bigram[seq[a]]) == seq[a + 1]
            total += 1
    assert report["bigram_row_top1"][0] == round(hits / total, 4)
    assert 1.0 <= report["accept_length"] <= 1 + SMALL["block_size"]
    assert 1.0 <= report["walk_accept_length"] <= 1 + SMALL["block_size"]


def test_the_walk_takes_each_block_where_the_one_before_ended():
    # example 1: blocks of 3 then 2 then 1, 1 (anchors 0, 3, 5, 6); example 2: one block of 2 at anchor 0, then 1
    lengths = torch.tensor([3, 1, 1, 2, 4, 1, 1] + [2, 5, 1])
    assert walk_accept_length(lengths, [7, 3]) == round((3 + 2 + 1 + 1 + 2 + 1) / 6, 4)
    assert walk_accept_length(torch.tensor([1, 1, 1]), [3]) == 1.0


def test_markov_head_starts_from_the_count_bigram(tiny_llama, tiny_answers):
    """At full rank the Markov term alone drafts the count bigram's next token for every previous token
    seen in the answers (on the draft vocabulary)."""
    data = usable_examples(tiny_answers, 128)
    token_map = build_token_map(data, 160, 257)
    trainer = DrafterTrainer(tiny_llama, TrainConfig(**{**SMALL, "markov_rank": 160}), token_map)
    trainer.init_markov_from_bigram(data)
    w1, w2 = trainer.params["markov.w1.weight"], trainer.params["markov.w2.weight"]
    pairs = {}
    for e in data:
        for a, b in zip(e.output_ids, e.output_ids[1:]):
            if trainer.to_draft[a] >= 0 and trainer.to_draft[b] >= 0:
                pairs.setdefault(a, []).append(int(trainer.to_draft[b]))
    assert len(pairs) > 20
    for prev, nexts in pairs.items():
        markov = w2 @ w1[trainer.to_draft[prev]]                             # [V_d]
        counts = torch.bincount(torch.tensor(nexts), minlength=160)
        assert counts[markov.argmax()] == counts.max(), prev


def test_init_from_an_export_continues_from_its_weights(tiny_llama, tiny_answers, tmp_path):
    data = usable_examples(tiny_answers, 128)
    token_map = build_token_map(data, 160, 257)
    trained = DrafterTrainer(tiny_llama, TrainConfig(**SMALL, max_steps=3), token_map)
    trained.train(data, live_features(tiny_llama, trained, data), tmp_path / "state.pt")
    ckpt = trained.checkpoint((1.5,) * SMALL["block_size"])
    fresh = DrafterTrainer(tiny_llama, TrainConfig(**SMALL), token_map)
    fresh.init_from(ckpt)
    assert all(torch.equal(p, trained.params[name]) for name, p in fresh.params.items())
    with pytest.raises(ValueError, match="other drafter settings"):
        DrafterTrainer(tiny_llama, TrainConfig(**{**SMALL, "markov_rank": 4}), token_map).init_from(ckpt)


@pytest.mark.parametrize("algorithm", ["DSPARK", "DFLASH", "EAGLE"])
def test_a_training_step_stays_on_the_trainers_device(tiny_llama, tiny_answers, algorithm):
    """On a GPU every tensor a step touches must live there. The meta device stands in for one here: an op mixing a
    CPU tensor with a meta one fails as it would with a CUDA one. Meta tensors hold no values (boolean masks are
    taken as all true, and the logged floats cannot be read), so the check runs the step's parts by hand."""
    import torch.fx.experimental._config as fx_config

    trainer = DrafterTrainer(tiny_llama, TrainConfig(**SMALL, algorithm=algorithm), None, device="meta")
    batch = live_batch(tiny_llama, trainer, usable_examples(tiny_answers, 128)[:4])
    with fx_config.patch(meta_nonzero_assume_all_nonzero=True):
        out = trainer.forward(batch, *sample_anchors(batch, 8, seeded(1)))
        assert out.draft_logits.device.type == "meta" and out.target.probs.device.type == "meta"
        assert out.per_sequence.is_cpu and out.per_sequence.tolist() == [8, 8, 8, 8]
        out.draft_logits.logsumexp(-1).sum().backward()
    grads = [p.grad for p in trainer.params.values() if p.grad is not None]
    assert grads and all(g.device.type == "meta" for g in grads)
    torch.nn.utils.clip_grad_norm_(trainer.params.values(), 1.0)
    trainer.optimizer.step()


def test_bfloat16_autocast_on_the_cpu_trains_float32_weights(tiny_llama, tiny_answers, tmp_path):
    """`--dtype bfloat16` on the CPU (fast where it has bf16 units): the drafter's matmuls run in bfloat16, the
    master weights and the optimizer's moments stay float32, and the steps still learn."""
    trainer = DrafterTrainer(tiny_llama, TrainConfig(**{**SMALL, "dtype": "bfloat16"}, max_steps=40, save_every=100),
                             None)
    data = usable_examples(tiny_answers, 128)
    batch = live_batch(tiny_llama, trainer, data[:8])
    with torch.no_grad():
        out = trainer.forward(batch, *sample_anchors(batch, 8, seeded(1)))
        before = trainer.losses(batch, seeded(9))
    assert out.draft_logits.dtype == torch.bfloat16
    trainer.train(data, live_features(tiny_llama, trainer, data), tmp_path / "state.pt")
    with torch.no_grad():
        after = trainer.losses(batch, seeded(9))
    assert all(p.dtype == torch.float32 for p in trainer.params.values())
    moments = [t for state in trainer.optimizer.state.values() for t in state.values() if t.dim()]
    assert moments and all(t.dtype == torch.float32 for t in moments)
    assert after.total.item() < 0.8 * before.total.item()
