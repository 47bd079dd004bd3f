"""`specserve bench`: second turns after the model's own answers, prompt selection, per-position acceptance,
the JSON record and table, the plot, and a 2-prompt run of the command on a tiny model."""
import json

import pytest
import torch

from specserve.bench.run import (
    Cell,
    acceptance_by_position,
    build_record,
    drafter_paths,
    format_table,
    messages,
    plot,
    run_batch,
    select_prompts,
)
from specserve.cli import main
from specserve.engine import LLM
from specserve.types import SamplingParams, SpecStats
from tests.conftest import save_hf_folder, tiny_checkpoint


def test_messages_put_the_models_own_answer_before_the_next_turn():
    assert messages(("q1", "q2"), []) == [{"role": "user", "content": "q1"}]
    assert messages(("q1", "q2"), ["a1"]) == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                                             {"role": "user", "content": "q2"}]


class RecordingLLM:
    def __init__(self, llm):
        self.llm, self.tokenizer, self.prompts = llm, llm.tokenizer, []

    def generate(self, prompts, params):
        self.prompts.append(prompts)
        return self.llm.generate(prompts, params)


def test_second_turn_follows_the_first_answer_and_both_count(tiny_llama):
    llm = RecordingLLM(LLM(checkpoint=tiny_llama, num_pages=64))
    cell = Cell()
    run_batch(llm, [("hello", "and again"), ("one turn",)], SamplingParams(max_new_tokens=6, temperature=0.0), cell)
    assert [len(p) for p in llm.prompts] == [2, 1]                  # turn 1 batched, then the conversation left
    (first, _), = cell.answers[:1]
    assert llm.tokenizer.decode(llm.prompts[1][0]) == (f"<|user|>hello\n<|assistant|>{first}\n"
                                                       "<|user|>and again\n<|assistant|>")
    assert len(cell.answers) == 2 and len(cell.answers[1]) == 1
    assert cell.stats.verify_ct == cell.stats.num_emitted_tokens > 0 and cell.seconds > 0


def test_prompts_are_the_first_that_fit(tiny_llama):
    tok = tiny_llama.tokenizer
    loaded = {"a": [("x" * 50,), ("short",), ("tiny",), ("more",)], "b": [("y" * 50,)]}
    assert select_prompts(tok, loaded, 2, 30) == {"a": [("short",), ("tiny",)]}
    with pytest.raises(ValueError, match="max-prompt-tokens"):
        select_prompts(tok, loaded, 2, 5)


def test_acceptance_by_position_is_conditional_on_the_previous_rows():
    assert acceptance_by_position([2, 1, 3]) == [round(4 / 6, 4), 0.75]
    assert acceptance_by_position([5]) == []


def test_shared_drafter_path_only_when_unambiguous():
    assert drafter_paths(["none", "dspark"], {}, "d") == {"dspark": "d"}
    assert drafter_paths(["eagle", "dspark"], {"eagle": "e"}, "d") == {"eagle": "e", "dspark": "d"}
    assert drafter_paths(["ngram", "eagle"], {}, None) == {"eagle": None}
    with pytest.raises(ValueError, match="ambiguous"):
        drafter_paths(["eagle", "dspark"], {}, "d")


def cell(verify_ct: int, tokens: int, histogram: list[int], seconds: float, answers: list[tuple[str, ...]]) -> Cell:
    accepted = sum(k * n for k, n in enumerate(histogram))
    return Cell(SpecStats(verify_ct, 4 * verify_ct, accepted, tokens, histogram), seconds, answers)


@pytest.fixture
def record():
    cells = {"none": {"code": cell(40, 40, [40], 2.0, [("a",), ("b",)]),
                      "chat": cell(20, 20, [20], 1.0, [("c", "d")])},
             "ngram": {"code": cell(10, 40, [2, 0, 2, 6], 1.0, [("a",), ("B",)]),
                       "chat": cell(10, 20, [3, 4, 3], 1.0, [("c", "d")])}}
    return build_record(cells, greedy=True, config={"num_prompts": 2}, skipped={"eagle": "no drafter"})


def test_record_summarises_acceptance_speed_and_text_check(record):
    ngram = record["summary"]["ngram"]
    assert ngram["accept_length"] == 3.0                           # macro mean of 4.0 and 2.0
    assert ngram["tokens_per_s"] == 30.0 and ngram["speedup_vs_none"] == 1.5
    assert ngram["text_differs"] == 1 and ngram["text_differs_rate"] == round(1 / 3, 4)
    assert ngram["acceptance_by_position"] == acceptance_by_position([5, 4, 5, 6])
    assert record["results"]["ngram"]["code"]["speedup_vs_none"] == 2.0
    assert "text_differs" not in record["summary"]["none"]
    assert json.loads(json.dumps(record)) == record


def test_table_rows_are_workloads_then_summary(record):
    lines = format_table(record).splitlines()
    assert lines[0].split() == ["acceptance", "length", "none", "ngram"]
    assert lines[2].split() == ["code", "1.00", "4.00"] and lines[3].split() == ["chat", "1.00", "2.00"]
    assert lines[5].split() == ["macro", "mean", "1.00", "3.00"]
    assert lines[6].split() == ["tokens/s", "20.0", "30.0"]
    assert lines[7].split() == ["speedup", "vs", "none", "1.00x", "1.50x"]
    assert lines[8].split() == ["text", "differs", "-", "1/3"]
    assert lines[9] == "skipped eagle: no drafter"


def test_table_without_plain_decoding_has_no_comparisons():
    record = build_record({"ngram": {"code": cell(10, 40, [2, 8], 1.0, [("a",)])}}, True, {}, {})
    assert "speedup" not in format_table(record) and "differs" not in format_table(record)


def test_plot_writes_a_png(record, tmp_path):
    plot(record, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_hf_folder(tiny_checkpoint("llama"), tmp_path_factory.mktemp("tiny"), torch.float32)


def test_bench_two_prompts_on_a_tiny_model(tiny_folder, tmp_path, capsys):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [{"turns": ["abc abc abc", "again abc"]},
                                                          {"prompt": "hello hello"}, {"prompt": "unused"}]))
    out = tmp_path / "bench.json"
    rc = main(["bench", "--model-path", str(tiny_folder), "--kv-cache-memory", str(1 << 22),
               "--algorithms", "none,ngram,standalone,eagle", "--draft-model-path-standalone", str(tiny_folder),
               "--workload-file", str(prompts), "--num-prompts", "2", "--max-new-tokens", "8", "--json", str(out)])
    assert rc == 0
    record = json.loads(out.read_text())
    assert list(record["results"]) == ["none", "ngram", "standalone"] and "eagle" in record["skipped"]
    for algorithm in ("ngram", "standalone"):
        assert record["summary"][algorithm]["text_differs"] == 0
        assert record["results"][algorithm]["mine"]["prompts"] == 2
    assert record["results"]["none"]["mine"]["accept_length"] == 1.0
    assert record["results"]["standalone"]["mine"]["accept_length"] > 1.0   # its own drafter agrees with it
    table = capsys.readouterr().out
    assert "mine" in table and "text differs" in table and "skipped eagle" in table
