"""Drafter training data: regeneration through the engine (resumable after a cut-off line), compressed
data, and the token map."""
from __future__ import annotations

import gzip
import json

import torch

from specserve.datasets import Prompt
from specserve.engine import LLM
from specserve.train.data import Example, build_token_map, is_regenerated, load_examples, regenerate
from specserve.types import SamplingParams


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
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "plain"}) + "\n")
    assert not is_regenerated(tmp_path / "prompts.jsonl")
