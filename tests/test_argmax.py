"""native/argmax.cpp: each row's first maximal index, as torch.argmax, for ties, NaN and every row length."""
import pytest
import torch

from specserve import native, sampling


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert native.register(), "the native kernels must build on this machine"


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.specserve.argmax_rows(x)


@pytest.mark.parametrize("n", [1, 3, 8, 9, 16, 31, 8192, 49155])
def test_random_rows_match_torch(n):
    x = torch.randn(9, n, generator=torch.Generator().manual_seed(n))
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("n", [5, 8, 13, 40, 1027])
def test_ties_go_to_the_first_index_wherever_they_fall(n):
    rows = []
    for first in range(n):
        for second in (first + 1, first + 8, n - 1):
            if first < second < n:
                row = torch.zeros(n)
                row[first] = row[second] = 2.0
                rows.append(row)
    x = torch.stack(rows + [torch.full((n,), -torch.inf), torch.full((n,), 3.0), torch.zeros(n)])
    x[-1, 0] = -0.0                                 # -0.0 == 0.0: the later zeros are no greater
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("n", [1, 7, 8, 20, 100])
def test_the_first_nan_counts_as_the_maximum(n):
    x = torch.randn(n, n, generator=torch.Generator().manual_seed(1))
    for r in range(n):
        x[r, r] = torch.nan
        x[r, (r + 3) % n] = torch.nan
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_greedy_tokens_match_torch_in_every_dtype():
    x = torch.randn(4, 100, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(sampling.greedy_tokens(x), x.argmax(dim=-1))
    assert torch.equal(sampling.greedy_tokens(x.float()), x.float().argmax(dim=-1))
    assert sampling.greedy_tokens(x.float()).dtype == torch.long
    assert sampling.greedy_tokens(torch.empty(0, 100)).shape == (0,)


def test_a_strided_view_reads_its_own_rows():
    x = torch.randn(6, 3, 50, generator=torch.Generator().manual_seed(3))
    view = x[:, 1]                                  # rows 150 floats apart
    assert torch.equal(argmax_rows(view), view.argmax(dim=-1))
