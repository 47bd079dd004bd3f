"""Cost-table measurement on a tiny random model (timings are not asserted: the machine is shared)."""
import argparse

import pytest
import torch

from specserve import profile
from specserve.models import LlamaModel
from specserve.spec.budget import CostTable
from tests.conftest import tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_model() -> LlamaModel:
    ckpt = tiny_checkpoint("llama", dtype=torch.float32)
    return LlamaModel(ckpt.config, ckpt.weights, torch.float32)


def test_measure_returns_a_monotone_table_with_the_requested_rows(tiny_model):
    table = profile.measure_cost_table(tiny_model, 16, rows=[8, 1, 2, 4, 16, 4], repeats=2, context=32,
                                       progress=False)
    assert table.rows == (1, 2, 4, 8, 16)
    assert all(0 < a <= b for a, b in zip(table.seconds, table.seconds[1:]))
    assert (table.model, table.dtype) == ("tiny-llama", "float32")
    assert table.matches("tiny-llama", "float32")


def test_context_is_capped_by_the_model_length(tiny_model):
    table = profile.measure_cost_table(tiny_model, 16, rows=[1, 3], repeats=1, context=10_000, window=3,
                                       progress=False)
    assert table.rows == (1, 3)


def test_bad_arguments_are_rejected(tiny_model):
    with pytest.raises(ValueError, match="row counts >= 1"):
        profile.measure_cost_table(tiny_model, 16, rows=[0, 4], progress=False)
    with pytest.raises(ValueError, match="repeats >= 1"):
        profile.measure_cost_table(tiny_model, 16, rows=[1, 4], repeats=0, progress=False)


@pytest.mark.parametrize("rows, window, sizes", [(1, 4, [1]), (4, 4, [4]), (5, 4, [3, 2]), (12, 4, [4, 4, 4]),
                                                 (7, 1, [1] * 7)])
def test_rows_are_dealt_over_the_fewest_windows(rows, window, sizes):
    assert profile.split_rows(rows, window) == sizes


def test_default_path_lives_in_the_cache_and_names_dtype_and_threads(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    path = profile.default_cost_table_path("Smol LM/2-abc", torch.float32, threads=2)
    assert path == tmp_path / "profiles" / "Smol_LM_2-abc-float32-t2.json"


def test_model_key_hashes_a_file_by_content(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"one")
    b.write_bytes(b"one")
    assert profile.model_key(str(a)).removeprefix("a-") == profile.model_key(str(b)).removeprefix("b-")
    b.write_bytes(b"other")    # another size too: hashes are memoised by (path, size, mtime)
    assert profile.model_key(str(a)).removeprefix("a-") != profile.model_key(str(b)).removeprefix("b-")


def test_profile_args_parse():
    parser = argparse.ArgumentParser()
    profile.add_profile_args(parser)
    args = parser.parse_args(["--rows", "1", "8", "--repeats", "2", "--out", "x.json", "--threads", "1"])
    assert (args.rows, args.repeats, args.out, args.num_threads, args.page_size) == ([1, 8], 2, "x.json", 1, 16)
    assert args.model_path is None and args.dtype == "float32"


def test_saved_table_loads_back(tiny_model, tmp_path):
    table = profile.measure_cost_table(tiny_model, 8, rows=[1, 2], repeats=1, context=8, progress=False)
    table.save(tmp_path / "t.json")
    assert CostTable.load(tmp_path / "t.json") == table
