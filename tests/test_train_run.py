"""`specserve train-drafter` end to end on the tiny random target: the exported folder loads in the engine and
decodes losslessly, its model card, the evaluation prompts, and the command line with regeneration and resume."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from specserve.datasets import WORKLOADS
from specserve.engine import LLM
from specserve.models.block_drafter import BlockDrafterCheckpoint
from specserve.models.eagle import EagleCheckpoint
from specserve.train.run import add_train_args, cmd_train_drafter, eval_workloads, train_drafter, training_device
from specserve.train.trainer import TrainConfig
from specserve.types import SamplingParams
from tests.conftest import save_hf_folder

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
SMALL = dict(block_size=4, anchors=8, batch_size=4, markov_rank=8, draft_vocab=160, max_len=128, holdout=4,
             lr=3e-3, dtype="float64")


def engine(ckpt, **spec) -> LLM:
    return LLM(checkpoint=ckpt, dtype="float64", page_size=4, num_pages=256, **spec)


@pytest.mark.parametrize("algorithm", ["DSPARK", "DFLASH"])
def test_export_loads_in_the_engine_and_decodes_losslessly(tiny_llama, tiny_answers, tmp_path, algorithm):
    cfg = TrainConfig(**SMALL, algorithm=algorithm, max_steps=30, save_every=100)
    ckpt = train_drafter(tiny_llama, tiny_answers, cfg, tmp_path / "out", tmp_path / "work", eval_prompts=3,
                         eval_max_new_tokens=16, source="tiny test answers")
    loaded = BlockDrafterCheckpoint.load(tmp_path / "out")
    assert loaded.config == ckpt.config and loaded.weights["token_map"].shape == (160,)
    if algorithm == "DSPARK":
        assert len(loaded.config.confidence_temperatures) == 4
        assert loaded.config.confidence_temperatures != (1.0,) * 4, "calibrated on the held-out examples"
    card = (tmp_path / "out" / "README.md").read_text()
    for row in ("| draft layers | 1 |", "| block size | 4 |", "| draft vocabulary | 160 of 257 |",
                "| target layer ids | [0, 1] |", "| held-out | 3 |"):
        assert row in card
    assert ("| Markov rank | 8 |" in card) == (algorithm == "DSPARK")
    held_out = json.loads((tmp_path / "work" / "held_out.json").read_text())
    assert held_out["examples"] == 4 and "## Held-out rows" in card
    assert f"| this | {held_out['row_top1'][0]:.3f} |" in card

    prompts = [e.prompt_ids for e in tiny_answers[:6]]
    plain = engine(tiny_llama).generate(prompts, GREEDY)
    window = {"speculative_dspark_confidence_threshold": 0.3} if algorithm == "DSPARK" else {}
    spec = engine(tiny_llama, speculative_algorithm=algorithm, speculative_draft_model_path=str(tmp_path / "out"),
                  speculative_block_size=4, **window)
    outs = spec.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert spec.engine.stats.num_accepted_drafts > 0


def test_eagle_export_loads_in_the_engine_and_decodes_losslessly(tiny_llama, tiny_answers, tmp_path):
    cfg = TrainConfig(**SMALL, algorithm="EAGLE", max_steps=30, save_every=100)
    ckpt = train_drafter(tiny_llama, tiny_answers, cfg, tmp_path / "out", tmp_path / "work", eval_prompts=3,
                         eval_max_new_tokens=16, source="tiny test answers")
    loaded = EagleCheckpoint.load(tmp_path / "out")
    assert loaded.config == ckpt.config and "token_map" not in loaded.weights
    card = (tmp_path / "out" / "README.md").read_text()
    for row in ("| algorithm | EAGLE |", "| drafts per step (trained chain) | 4 |",
                "| draft vocabulary | the target's 257 |", "| target layer ids | [0, 1] |", "| held-out | 3 |",
                "--speculative-num-draft-tokens 4"):
        assert row in card
    prompts = [e.prompt_ids for e in tiny_answers[:6]]
    plain = engine(tiny_llama).generate(prompts, GREEDY)
    spec = engine(tiny_llama, speculative_algorithm="EAGLE", speculative_draft_model_path=str(tmp_path / "out"),
                  speculative_num_draft_tokens=4)
    outs = spec.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert spec.engine.stats.num_accepted_drafts > 0


def test_model_card_workloads_are_the_bench_prompts_first_turns(tiny_llama, monkeypatch):
    monkeypatch.setitem(WORKLOADS, "mtbench", lambda: [("x" * 500, "never asked"), ("Hi", "More?"), ("Yo",)])
    chat = engine(tiny_llama).engine.encode
    assert eval_workloads("mtbench", tiny_llama.tokenizer, 1, 100) == {"mtbench": [chat("Hi", chat=True)]}
    assert eval_workloads("", tiny_llama.tokenizer, 1, 100) == {}


def test_cli_regenerates_trains_resumes_and_exports(tiny_llama, tmp_path):
    save_hf_folder(tiny_llama, tmp_path / "target")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Tell me about {w}."}) + "\n"
                                                    for w in ("cats", "dogs", "the sea", "rain", "maths", "tea")))
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    argv = ["--target-model-path", str(tmp_path / "target"), "--algorithm", "DFLASH", "--out", str(tmp_path / "out"),
            "--data", str(tmp_path / "prompts.jsonl"), "--regen-max-new-tokens", "16", "--block-size", "4",
            "--anchors", "4", "--batch-size", "2", "--max-len", "128", "--draft-vocab", "100",
            "--dtype", "float64", "--eval-workloads", "", "--eval-prompts", "0"]
    assert cmd_train_drafter(parser.parse_args([*argv, "--max-steps", "3"])) == 0
    work = tmp_path / "out.work"
    assert len((work / "regenerated.jsonl").read_text().splitlines()) == 6
    assert cmd_train_drafter(parser.parse_args([*argv, "--max-steps", "5", "--resume"])) == 0
    steps = [json.loads(line)["step"] for line in (work / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
    dflash = BlockDrafterCheckpoint.load(tmp_path / "out").config
    assert dflash.algorithm == "DFLASH" and dflash.anchor_slot, "DFLASH trains in DFlash's own slot layout"
    assert "| block slots | DFlash's" in (tmp_path / "out" / "README.md").read_text()
    eagle = [*argv[:argv.index("--out") + 1], str(tmp_path / "eagle"), *argv[argv.index("--out") + 2:]]
    eagle[eagle.index("DFLASH")] = "eagle"
    assert cmd_train_drafter(parser.parse_args([*eagle, "--max-steps", "2", "--work-dir", str(work)])) == 0
    assert EagleCheckpoint.load(tmp_path / "eagle").config.target_layer_ids == (0, 1)
    few = tmp_path / "few.work"
    assert cmd_train_drafter(parser.parse_args([*argv, "--max-steps", "1", "--max-examples", "3",
                                                "--work-dir", str(few), "--kv-cache-dtype", "float32"])) == 0
    (index,) = (few / "features").glob("*/index.jsonl")
    assert len(index.read_text().splitlines()) == 3            # only the first three examples were featurised
    assert json.loads((index.parent / "key.json").read_text())["attention"] == "torch.float32"
    assert cmd_train_drafter(parser.parse_args([*argv, "--max-steps", "1", "--init-from", str(tmp_path / "out"),
                                                "--work-dir", str(tmp_path / "again.work")])) == 0
    assert "| initialised from | an exported drafter's weights" in (tmp_path / "out" / "README.md").read_text()
    assert parser.parse_args([*argv, "--time-budget", "1.5h"]).time_budget == 5400
    assert parser.parse_args([*argv, "--time-budget", "90"]).time_budget == 90


def test_device_names_a_gpu_torch_sees_or_is_refused(monkeypatch):
    assert training_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match=r"--device cuda: torch sees 0 CUDA device\(s\).*--device cpu"):
        training_device("cuda")
    for name in ("tpu", "gpu0", "meta"):
        with pytest.raises(ValueError, match="--device must be cpu or cuda"):
            training_device(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert training_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ValueError, match="--device cuda:1: torch sees 1 CUDA device"):
        training_device("cuda:1")
