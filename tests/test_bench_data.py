"""Workload loaders on small fixtures in the packaged files' layouts: HumanEval, MT-Bench's two turns,
mmath's MATH-500 / AIME split, ShareGPT's evaluation split, and a user's JSONL."""
import gzip
import json

import pytest

from specserve.bench import data
from specserve.bench.data import MMATH, MTBENCH, load_workload, parse_humaneval, parse_workload_file
from specserve.train import data as train_data


def test_parse_humaneval_fixture(tmp_path):
    path = tmp_path / "HumanEval.jsonl.gz"
    records = [{"task_id": "HumanEval/0", "prompt": "def f():\n", "entry_point": "f"},
               {"task_id": "HumanEval/1", "prompt": "def g():\n", "entry_point": "g"}]
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in records) + "\n\n")
    assert [r["task_id"] for r in parse_humaneval(path)] == ["HumanEval/0", "HumanEval/1"]


def test_workload_file_reads_turns_prompts_and_chat_records(tmp_path):
    path = tmp_path / "mine.jsonl"
    lines = [{"turns": ["first", "second"]}, {"prompt": "plain"},
             {"messages": [{"role": "user", "content": "openai"}]}, {"other": 1}]
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n\n")
    assert parse_workload_file(path) == [("first", "second"), ("plain",), ("openai",)]
    (tmp_path / "empty.jsonl").write_text('{"other": 1}\n')
    with pytest.raises(ValueError, match="no prompts"):
        parse_workload_file(tmp_path / "empty.jsonl")


@pytest.fixture
def packaged(tmp_path, monkeypatch):
    """package_file served from small fixtures in the real files' layouts, without PyPI."""
    mtbench = tmp_path / "question.jsonl"
    mtbench.write_text("".join(json.dumps({"question_id": 81 + i, "category": "writing", "turns": turns}) + "\n"
                               for i, turns in enumerate([["Write a poem.", "Now shorten it."],
                                                          ["Name a color.", "Why that one?"]])))
    mmath = tmp_path / "en.json"
    sources = ["AIME2024", "MATH500", "CNMO", "MATH500", "AIME2025"]
    mmath.write_text(json.dumps([{"question": f"q{i}", "answer": "1", "data_source": s, "lang": "en"}
                                 for i, s in enumerate(sources)], indent=4))
    files = {MTBENCH: mtbench, MMATH: mmath}
    monkeypatch.setattr(data, "package_file", lambda *spec: files[spec])


def test_mtbench_conversations_keep_both_turns(packaged):
    assert load_workload("mtbench") == [("Write a poem.", "Now shorten it."), ("Name a color.", "Why that one?")]


def test_mmath_splits_math500_from_aime(packaged):
    math500, aime = load_workload("math500"), load_workload("aime")
    assert [c[0].split("\n")[0] for c in math500] == ["q1", "q3"]
    assert [c[0].split("\n")[0] for c in aime] == ["q0", "q4"]
    assert all(len(c) == 1 and c[0].endswith("within \\boxed{}.") for c in math500 + aime)


def test_sharegpt_workload_is_the_evaluation_split(tmp_path, monkeypatch):
    records = [{"id": str(i), "conversations": [{"from": "human" if i != 1 else "gpt", "value": f"text {i}"}]}
               for i in range(5)]
    text = json.dumps(records + [{"id": "cut", "conversations": []}], indent=2)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:text.index('"cut"')])                  # truncated like the PyPI file
    monkeypatch.setattr(data, "sharegpt_path", lambda: path)
    monkeypatch.setattr(train_data, "SHAREGPT_TRAIN", 2)         # usable 0, 2 train; 3, 4 evaluate
    assert load_workload("sharegpt") == [("text 3",), ("text 4",)]


def test_unknown_workload_names_the_choices():
    with pytest.raises(ValueError, match="humaneval, mtbench, math500, aime, sharegpt"):
        load_workload("gsm8k")
