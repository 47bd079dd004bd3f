"""Block drafter losses: row weights, the valid prefix, the acceptance target of the confidence head,
the greedy acceptance estimate, and temperature calibration."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specserve.train.losses import (
    LossWeights,
    TargetTopK,
    acceptance,
    block_loss,
    fit_temperatures,
    row_weights,
    valid_rows,
)


def random_block(n: int = 3, g: int = 5, v: int = 7, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, g, v, generator=gen, dtype=torch.float64, requires_grad=True)
    # target mass on the draft vocabulary sums to 0.9: a tenth lies outside the map
    target = 0.9 * torch.randn(n, g, v, generator=gen, dtype=torch.float64).softmax(-1)
    ids = torch.randint(0, v, (n, g), generator=gen)
    return logits, TargetTopK.dense(target), ids


def test_row_weights_decay_exponentially():
    torch.testing.assert_close(row_weights(4, 4.0), torch.tensor([1, math.exp(-0.25), math.exp(-0.5), math.exp(-0.75)],
                                                                 dtype=torch.float64))


def test_valid_rows_are_the_prefix_inside_the_sequence():
    anchors = torch.tensor([[3, 7, 0]])
    valid = valid_rows(anchors, torch.tensor([[True, True, False]]), torch.tensor([10]), block_size=4)
    # row k targets anchor + k + 1, which must be < 10; the third anchor is padding
    assert valid.tolist() == [[[True] * 4, [True, True, False, False], [False] * 4]]


def test_rows_outside_the_valid_prefix_do_not_count():
    logits, target, ids = random_block()
    valid = torch.tensor([[True] * 5, [True, True, False, False, False], [False] * 5])
    conf = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    terms = block_loss(logits, target, ids, valid, conf)
    terms.total.backward()
    assert (logits.grad[~valid] == 0).all() and (logits.grad[valid] != 0).any()
    assert (conf.grad[~valid] == 0).all()
    changed = logits.detach().clone()
    changed[~valid] = 100 * torch.randn_like(changed[~valid])
    assert block_loss(changed, target, ids, valid, conf).total.item() == pytest.approx(terms.total.item(), abs=1e-12)


def test_loss_is_the_row_weighted_mix_of_cross_entropy_and_l1():
    logits, target, ids = random_block()
    ids[0, 1] = -1                                     # a token outside the map: no cross-entropy for it
    valid = torch.tensor([[True] * 5, [True, True, True, False, False], [True] + [False] * 4])
    terms = block_loss(logits, target, ids, valid, weights=LossWeights(ce=0.3, dist=0.7, decay=2.0))
    want, total_w = 0.0, 0.0
    logits = logits.detach()
    for n in range(3):
        for k in range(5):
            if not valid[n, k]:
                continue
            w = math.exp(-k / 2.0)
            p = logits[n, k].softmax(-1)
            l1 = (p - target.probs[n, k]).abs().sum() + (1 - target.probs[n, k].sum())
            ce = 0.0 if ids[n, k] < 0 else -p[ids[n, k]].log()
            want, total_w = want + w * (0.3 * ce + 0.7 * l1), total_w + w
    assert terms.total.item() == pytest.approx(float(want) / total_w, rel=1e-12)


def test_acceptance_is_one_minus_half_the_l1_distance_over_the_whole_vocabulary():
    draft = torch.tensor([0.5, 0.5, 0.0])
    target_full = torch.tensor([0.25, 0.25, 0.25, 0.25])   # the last token is outside the draft vocabulary
    want = 1 - 0.5 * (torch.cat([draft, torch.zeros(1)]) - target_full).abs().sum()
    assert acceptance(draft.log(), TargetTopK.dense(target_full[:3])).item() == pytest.approx(want.item()) \
        == pytest.approx(0.5)
    # the same target known on its top 2 only (ids 0 and 2, then one outside the draft vocabulary): a lower bound
    top = TargetTopK(torch.tensor([0, -1, 2]), torch.tensor([0.25, 0.25, 0.25]))
    assert acceptance(draft.log(), top).item() == pytest.approx(0.25)


def test_confidence_learns_the_detached_acceptance_probability():
    logits, target, ids = random_block()
    valid = torch.ones(3, 5, dtype=torch.bool)
    a = acceptance(logits.detach().log_softmax(-1), target)
    # at c = a the confidence term is at its minimum, and it never reaches the draft logits
    conf = torch.logit(a).clone().requires_grad_(True)
    no_conf = block_loss(logits, target, ids, valid)
    with_conf = block_loss(logits, target, ids, valid, conf, LossWeights(confidence=2.0))
    with_conf.total.backward()
    assert conf.grad.abs().max() < 1e-12
    logits_grad = logits.grad.clone()
    logits.grad = None
    no_conf.total.backward()
    torch.testing.assert_close(logits.grad, logits_grad, rtol=0, atol=1e-15)
    bce = F.binary_cross_entropy(a, a)
    assert with_conf.confidence == pytest.approx(bce.item())
    assert with_conf.total.item() == pytest.approx(no_conf.total.item() + 2 * bce.item())
    assert with_conf.acceptance == pytest.approx(a.mean().item())


def test_accept_length_counts_leading_argmax_matches():
    logits = torch.full((2, 4, 3), -5.0, dtype=torch.float64)
    logits[..., 0] = 5.0                               # the draft argmax is always token 0
    ids = torch.tensor([[0, 0, 1, 0], [0, 0, 0, 0]])   # block 0 matches twice, block 1 to its valid end (3)
    valid = torch.tensor([[True] * 4, [True, True, True, False]])
    terms = block_loss(logits, TargetTopK.dense(torch.full((2, 4, 3), 1 / 3, dtype=torch.float64)), ids, valid)
    assert terms.accept_length == pytest.approx((3 + 4) / 2)


def test_fit_temperatures_recovers_a_known_temperature():
    gen = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(4000, 3, generator=gen, dtype=torch.float64)
    temperatures = torch.tensor([0.5, 2.0, 3.0], dtype=torch.float64)
    targets = torch.sigmoid(logits / temperatures)
    valid = torch.ones(4000, 3, dtype=torch.bool)
    valid[:, 2] = False                                # no data for the last row: it keeps T = 1
    fitted = fit_temperatures(logits, targets, valid)
    assert fitted[:2] == pytest.approx([0.5, 2.0], rel=1e-4) and fitted[2] == pytest.approx(1.0)
