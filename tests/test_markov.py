"""native/markov.cpp: DSPARK's greedy Markov chain in one op gives the picks of the row-by-row loop of dispatched ops,
bit for bit, and its Python reference agrees."""
import pytest
import torch

from specserve import native
from specserve.native import ops
from specserve.quantization import Int8Linear


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert native.register(), "the native kernels must build on this machine"


def loop(base, prev, w1, w2):
    picked = []
    for k in range(base.shape[1]):
        prev = torch.ops.specserve.argmax_rows(w2(w1[prev], base[:, k]))
        picked.append(prev)
    return torch.stack(picked, dim=1)


@pytest.mark.parametrize("jobs,rows,vocab,rank", [(1, 8, 8192, 64), (3, 5, 300, 8), (2, 1, 33, 4)])
def test_the_op_picks_what_the_loop_picks(jobs, rows, vocab, rank):
    g = torch.Generator().manual_seed(jobs * 100 + rows)
    # a Markov term as large as the base, so that each row's pick depends on the previous one
    w1 = torch.cat([torch.randn(vocab, rank, generator=g), torch.zeros(1, rank)])
    w2 = Int8Linear.of(torch.randn(vocab, rank, generator=g))
    base = torch.randn(jobs, rows, vocab, generator=g) * 3
    prev = torch.randint(vocab + 1, (jobs,), generator=g)
    prev[0] = vocab                             # a token outside the draft vocabulary: no Markov term
    want = loop(base, prev, w1, w2)
    got = torch.ops.specserve.markov_greedy(base, prev, w1, w2.weight, w2.scale)
    assert torch.equal(got, want)
    assert torch.equal(ops.markov_greedy(base, prev, w1, w2.weight, w2.scale), want)
    if rows > 1:   # the chain matters: without each pick's term the picks differ
        assert not torch.equal(got, torch.ops.specserve.argmax_rows(base.flatten(0, 1)).view(jobs, rows))


def test_a_strided_block_reads_its_own_rows():
    g = torch.Generator().manual_seed(7)
    w1 = torch.cat([torch.randn(40, 4, generator=g), torch.zeros(1, 4)])
    w2 = Int8Linear.of(torch.randn(40, 4, generator=g))
    wide = torch.randn(2, 6, 40, generator=g)
    base = wide[:, ::2]                          # rows 0, 2, 4 of each job: not contiguous
    prev = torch.tensor([3, 17])
    assert torch.equal(torch.ops.specserve.markov_greedy(base, prev, w1, w2.weight, w2.scale),
                       loop(base.contiguous(), prev, w1, w2))


def test_bad_shapes_are_named():
    w2 = Int8Linear.of(torch.randn(10, 4))
    with pytest.raises(RuntimeError, match="w1 must be float32"):
        torch.ops.specserve.markov_greedy(torch.randn(1, 2, 10), torch.tensor([0]), torch.randn(10, 4), w2.weight,
                                          w2.scale)
