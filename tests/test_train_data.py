"""Drafter training data: ShareGPT's truncated JSON array read record by record and split, prompt
JSONL formats, regeneration through the engine (resumable after a cut-off line), and the token map."""
from __future__ import annotations

import gzip
import json

import pytest
import torch

from specserve.engine import LLM
from specserve.train import data
from specserve.train.data import (Example, Prompt, build_token_map, is_regenerated, iter_json_array, jsonl_prompts,
                                  load_examples, regenerate, sharegpt_prompts)
from specserve.types import SamplingParams

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
    monkeypatch.setattr(data, "SHAREGPT_TRAIN", 2)
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
    assert not is_regenerated(path)


def test_regeneration_matches_the_engine_and_resumes_after_a_cut_off_line(tiny_llama, tmp_path):
    prompts = [Prompt(f"p{i}", text) for i, text in enumerate(["Hello", "How are you?", "abc " * 40, "Tell me",
                                                               "Why?", "x"])]

    def engine() -> LLM:
        return LLM(checkpoint=tiny_llama, dtype="float64", page_size=4, num_pages=256, max_running_requests=2)

    fresh = tmp_path / "fresh.jsonl"
    regenerate(engine(), prompts, fresh, max_new_tokens=12, max_prompt_tokens=60, max_running=2)
    assert is_regenerated(fresh)
    records = {e.id: e for e in load_examples(fresh)}
    assert sorted(records) == ["p0", "p1", "p3", "p4", "p5"], "the 160-byte prompt is skipped"
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    want = engine().generate(["Hello", "Tell me"], params, chat=True)
    assert records["p0"] == Example("p0", want[0].prompt_token_ids, want[0].token_ids)
    assert records["p3"].output_ids == want[1].token_ids

    resumed = tmp_path / "resumed.jsonl"
    regenerate(engine(), prompts[:3], resumed, max_new_tokens=12, max_prompt_tokens=60, max_running=2)
    text = resumed.read_text()
    resumed.write_text(text[:-9])                       # an interrupted run leaves half a line
    regenerate(engine(), prompts, resumed, max_new_tokens=12, max_prompt_tokens=60, max_running=2)
    again = load_examples(resumed)
    assert sorted(e.id for e in again) == sorted(records)
    assert {e.id: e for e in again} == records


def test_token_map_holds_the_most_frequent_answer_tokens():
    examples = [Example("a", [9, 9, 9, 9], [5, 5, 5, 2, 2, 7]), Example("b", [], [2, 7, 1])]
    # counts in answers: 5 → 3, 2 → 3, 7 → 2, 1 → 1; the prompt's 9 does not count; ties go to the lower id
    assert build_token_map(examples, 3, 10).tolist() == [2, 5, 7]
    assert build_token_map(examples, 6, 10).tolist() == [0, 1, 2, 3, 5, 7]
    assert build_token_map(examples, 10, 10) is None
    assert build_token_map(examples, 3, 10).dtype == torch.long


def test_compressed_regenerated_data_loads_like_plain(tmp_path):
    lines = [json.dumps({"id": f"c{i}", "prompt_ids": [1, 2, i], "output_ids": [i, 4, 5]}) for i in range(3)]
    plain, packed = tmp_path / "data.jsonl", tmp_path / "data.jsonl.gz"
    plain.write_text("\n".join(lines) + "\n")
    with gzip.open(packed, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    assert is_regenerated(packed)
    assert load_examples(packed) == load_examples(plain) and len(load_examples(packed)) == 3
