"""Cost tables: measurement on a tiny random model (timings are not asserted: the machine is shared), where they
are saved and found, interpolation, monotone repair, validation and the file format."""
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.config import SpecConfig
from specserve.models import LlamaModel
from specserve.speculative import TargetInfo, cost_table
from specserve.speculative.cost_table import CostTable
from tests.conftest import tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_model() -> LlamaModel:
    ckpt = tiny_checkpoint("llama", dtype=torch.float32)
    return LlamaModel(ckpt.config, ckpt.weights, torch.float32)


def test_measure_returns_a_monotone_table_with_the_requested_rows(tiny_model):
    table = cost_table.measure_cost_table(tiny_model, 16, rows=[8, 1, 2, 4, 16, 4], repeats=2, context=32,
                                          progress=False)
    assert table.rows == (1, 2, 4, 8, 16)
    assert all(0 < a <= b for a, b in zip(table.seconds, table.seconds[1:]))
    assert (table.model, table.dtype) == ("tiny-llama", "float32")
    assert table.matches("tiny-llama", "float32")


def test_context_is_capped_by_the_model_length(tiny_model):
    table = cost_table.measure_cost_table(tiny_model, 16, rows=[1, 3], repeats=1, context=10_000, window=3,
                                          progress=False)
    assert table.rows == (1, 3)


def test_per_key_terms_come_from_a_long_context(tiny_model):
    table = cost_table.measure_cost_table(tiny_model, 16, rows=[1, 4], repeats=1, context=16, window=4,
                                          long_context=256, progress=False)
    assert table.context == 16
    assert table.first_row_key_seconds >= 0 and table.extra_row_key_seconds >= 0
    assert table.first_row_key_seconds + table.extra_row_key_seconds > 0     # 240 more keys cost something
    assert table.first_row_time(16) == table.extra_row_time(10) == 0.0
    flat = cost_table.measure_cost_table(tiny_model, 16, rows=[1, 4], repeats=1, context=64, long_context=64,
                                         progress=False)
    assert flat.first_row_key_seconds == flat.extra_row_key_seconds == 0.0


def test_bad_arguments_are_rejected(tiny_model):
    with pytest.raises(ValueError, match="row counts >= 1"):
        cost_table.measure_cost_table(tiny_model, 16, rows=[0, 4], progress=False)
    with pytest.raises(ValueError, match="repeats >= 1"):
        cost_table.measure_cost_table(tiny_model, 16, rows=[1, 4], repeats=0, progress=False)


@pytest.mark.parametrize("rows, window, sizes", [(1, 4, [1]), (4, 4, [4]), (5, 4, [3, 2]), (12, 4, [4, 4, 4]),
                                                 (7, 1, [1] * 7)])
def test_rows_are_dealt_over_the_fewest_windows(rows, window, sizes):
    assert cost_table.split_rows(rows, window) == sizes


def test_default_path_lives_in_the_cache_and_names_dtype_and_threads(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    path = cost_table.default_cost_table_path("Smol LM/2-abc", torch.float32, threads=2)
    assert path == tmp_path / "profiles" / "Smol_LM_2-abc-float32-t2.json"


def test_model_key_hashes_a_file_by_content(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"one")
    b.write_bytes(b"one")
    assert cost_table.model_key(str(a)).removeprefix("a-") == cost_table.model_key(str(b)).removeprefix("b-")
    b.write_bytes(b"other")    # another size too: hashes are memoised by (path, size, mtime)
    assert cost_table.model_key(str(a)).removeprefix("a-") != cost_table.model_key(str(b)).removeprefix("b-")


def target_info(model: LlamaModel, source: str, page_size: int = 16) -> TargetInfo:
    return TargetInfo(model, model.config, None, model.dtype, source, page_size, model.dtype)


def test_the_planner_finds_the_table_saved_for_its_model(tiny_model, tmp_path, monkeypatch):
    """A target loaded from a file finds the table `specserve profile` saved for it; --speculative-dspark-cost-table
    wins over it; a checkpoint built in memory, or a model without a saved table, measures one at the engine's
    page size."""
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    model_file = tmp_path / "model.gguf"
    model_file.write_bytes(b"weights")
    saved = CostTable((1, 2), (0.5, 0.6), model="tiny-llama", dtype="float32")
    saved.save(cost_table.default_cost_table_path(cost_table.model_key(str(model_file)), torch.float32))
    assert cost_table.resolve_cost_table(SpecConfig(), target_info(tiny_model, str(model_file))) == saved
    explicit = CostTable((1, 4), (0.1, 0.2))
    explicit.save(tmp_path / "mine.json")
    flag = SpecConfig(dspark_cost_table_path=str(tmp_path / "mine.json"))
    assert cost_table.resolve_cost_table(flag, target_info(tiny_model, str(model_file))) == explicit

    page_sizes = []

    def measure(model, page_size, **kw):
        page_sizes.append(page_size)
        return explicit

    monkeypatch.setattr(cost_table, "measure_cost_table", measure)
    assert cost_table.resolve_cost_table(SpecConfig(), target_info(tiny_model, "built in memory", 4)) == explicit
    other = tmp_path / "other.gguf"
    other.write_bytes(b"other weights")
    assert cost_table.resolve_cost_table(SpecConfig(), target_info(tiny_model, str(other), 8)) == explicit
    assert page_sizes == [4, 8]


def test_saved_table_loads_back(tiny_model, tmp_path):
    table = cost_table.measure_cost_table(tiny_model, 8, rows=[1, 2], repeats=1, context=8, progress=False)
    table.save(tmp_path / "t.json")
    assert CostTable.load(tmp_path / "t.json") == table


def test_time_interpolates_and_extrapolates():
    cost = CostTable((2, 4, 8), (1.0, 2.0, 2.0))
    assert cost.time(1) == 1.0                     # never below the first point
    assert cost.time(2) == 1.0
    assert cost.time(3) == pytest.approx(1.5)
    assert cost.time(6) == pytest.approx(2.0)
    assert cost.time(16) == pytest.approx(2.0)     # last segment is flat
    assert CostTable((1, 2), (1.0, 1.25)).time(9) == pytest.approx(3.0)   # t(r) = 1 + (r - 1) / 4


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 100), st.floats(1e-4, 1.0)), min_size=2, max_size=8,
                unique_by=lambda p: p[0]))
def test_measured_tables_are_monotone_and_never_above_the_measurements(points):
    rows, seconds = zip(*points)
    cost = CostTable.measured(rows, seconds)
    assert list(cost.rows) == sorted(rows)
    times = [cost.time(r) for r in range(0, 150)]
    assert all(a <= b for a, b in zip(times, times[1:]))
    for r, s in points:
        assert cost.time(r) <= s


def test_measured_lowers_noisy_points_to_later_ones():
    cost = CostTable.measured([8, 1, 4, 2], [0.3, 0.1, 0.5, 0.2])
    assert cost.rows == (1, 2, 4, 8)
    assert cost.seconds == (0.1, 0.2, 0.3, 0.3)


@pytest.mark.parametrize("rows, seconds, message", [
    ((1, 2), (0.1,), "2 row counts but 1 timings"),
    ((1,), (0.1,), "at least two points"),
    ((0, 2), (0.1, 0.2), "integers >= 1"),
    ((2, 2), (0.1, 0.2), "strictly increasing"),
    ((1, 2), (0.1, float("inf")), "finite and > 0"),
    ((1, 2), (0.2, 0.1), "must not fall"),
])
def test_invalid_tables_say_what_is_wrong(rows, seconds, message):
    with pytest.raises(ValueError, match=message):
        CostTable(rows, seconds)


def test_key_terms_price_keys_past_the_context():
    cost = CostTable((1, 2), (1.0, 1.25), context=100, first_row_key_seconds=2e-3, extra_row_key_seconds=5e-4)
    assert cost.first_row_time(100) == cost.extra_row_time(50) == 0.0
    assert cost.first_row_time(1100) == pytest.approx(2.0)
    assert cost.extra_row_time(1100) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="extra_row_key_seconds must be finite and >= 0"):
        CostTable((1, 2), (1.0, 1.25), extra_row_key_seconds=-1.0)
    with pytest.raises(ValueError, match="context must be an integer >= 0"):
        CostTable((1, 2), (1.0, 1.25), context=-5)


def test_tables_saved_before_the_key_terms_still_load(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"rows": [1, 2], "seconds": [0.1, 0.2], "model": "m", "dtype": "float32"}))
    cost = CostTable.load(path)
    assert (cost.context, cost.first_row_key_seconds, cost.extra_row_key_seconds) == (0, 0.0, 0.0)


def test_save_load_round_trip(tmp_path):
    cost = CostTable((1, 8, 32), (0.04, 0.07, 0.16), model="m", dtype="float32", context=128,
                     first_row_key_seconds=1e-6, extra_row_key_seconds=3e-7)
    path = tmp_path / "sub" / "cost.json"
    cost.save(path)
    assert CostTable.load(path) == cost
    data = json.loads(path.read_text())
    assert data["cpu"] and data["threads"] >= 1
    assert cost.matches("m", "float32")
    assert not cost.matches("m", "float64") and not cost.matches("other", "float32")


def test_loading_a_broken_file_names_it(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"rows": [1, 2]}))
    with pytest.raises(ValueError, match="cost.json is not a valid cost table"):
        CostTable.load(path)
    path.write_text(json.dumps({"rows": [1, 2], "seconds": [0.2, 0.1]}))
    with pytest.raises(ValueError, match="must not fall"):
        CostTable.load(path)
