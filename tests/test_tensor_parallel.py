"""Tensor parallelism (models/tensor_parallel.py over distributed.py): the shards partition the weights, and
an engine at --tp-size 2 (gloo, one process per rank) emits what the engine at TP 1 emits, for plain decoding
and every speculative algorithm, with each rank's KV the matching slice of the TP-1 KV."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from specserve.config import ParallelConfig
from specserve.distributed import RankFailure, Topology, free_port
from specserve.engine import LLM, Engine
from specserve.kv_pages import slots_for
from specserve.models.block_drafter import random_block_drafter
from specserve.models.tensor_parallel import check_tp_size, shard_config, shard_weights
from specserve.types import Request, SamplingParams
from tests.conftest import save_hf_folder
from tests.spec_harness import (
    GREEDY,
    PROMPTS,
    SAMPLED,
    assert_pages_released,
    drive,
    eagle_kwargs,
    first_layers,
    make_engine,
    programmed_head,
)

BATCH = 4
CASES = {
    "plain": lambda target, d: {},
    "ngram": lambda target, d: {"speculative_algorithm": "NGRAM"},
    "standalone": lambda target, d: {"speculative_algorithm": "STANDALONE", "draft": first_layers(target, 1)},
    "eagle": lambda target, d: eagle_kwargs(programmed_head(target, feature_scale=0.03)),
    "dflash": lambda target, d: {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": d["dflash"]},
    "dspark": lambda target, d: {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": d["dspark"],
                                 "speculative_dspark_confidence_threshold": 0.3, "speculative_ngram_hybrid": True},
}


@pytest.fixture(scope="module")
def drafters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-drafters")
    ckpts = {"dflash": random_block_drafter(tiny_llama.config, "DFLASH", seed=1, dtype=torch.float64),
             "dspark": random_block_drafter(tiny_llama.config, token_map=torch.arange(128) * 2, seed=2,
                                            dtype=torch.float64)}
    for name, ckpt in ckpts.items():
        ckpt.save(root / name)
    return {name: str(root / name) for name in ckpts}


def capture_full_kv(engine: Engine) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """At each request's finish, its committed target K/V over all KV heads (gathered from the ranks at TP > 1)."""
    captured = {}
    finish = engine.scheduler.finish

    def capturing(req: Request, reason: str) -> None:
        if req.pages:
            k, v = engine.model.gather_kv(engine.pool) if engine.model.tp_size > 1 else (engine.pool.k, engine.pool.v)
            slots = slots_for(req.pages, 0, req.num_computed_tokens, engine.pool.page_size)
            captured[req.request_id] = (k[:, slots].clone(), v[:, slots].clone())
        finish(req, reason)

    engine.scheduler.finish = capturing
    return captured


def generate(engine: Engine, params=GREEDY[:BATCH]):
    kv = capture_full_kv(engine)
    try:
        result = drive(engine, PROMPTS[:BATCH], params)
        assert_pages_released(engine)
    finally:
        engine.close()
    return result, kv


def test_the_shards_partition_every_weight(tiny_qwen):
    config, weights = tiny_qwen.config, tiny_qwen.weights
    shards = [shard_weights(config, weights, rank, 2) for rank in range(2)]
    for name, full in weights.items():
        parts = [s[name] for s in shards]
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=0)
        elif name.endswith("norm.weight"):
            assert all(p is full for p in parts)
        else:                               # QKV (bias too), gate, up, embedding, LM head: by rows
            torch.testing.assert_close(torch.cat(parts), full, rtol=0, atol=0)
    half = shard_config(config, 1, 2)
    assert (half.num_heads, half.num_kv_heads, half.intermediate_size) == (2, 1, config.intermediate_size // 2)


def test_a_tp_size_that_does_not_divide_the_kv_heads_names_the_valid_ones(tiny_llama):
    smollm2_like = dataclasses.replace(tiny_llama.config, num_heads=9, num_kv_heads=3, intermediate_size=1536,
                                       name="SmolLM2-135M")
    with pytest.raises(ValueError, match=r"--tp-size 2 does not divide SmolLM2-135M's 3 KV heads.*use one of 1, 3"):
        check_tp_size(smollm2_like, 2)
    check_tp_size(smollm2_like, 3)


def test_topology_checks_its_flags():
    with pytest.raises(ValueError, match="--nnodes 2 must divide --tp-size 3"):
        Topology.of(ParallelConfig(tp_size=3, nnodes=2, dist_init_addr="h:1"))
    with pytest.raises(ValueError, match="needs --dist-init-addr"):
        Topology.of(ParallelConfig(tp_size=2, nnodes=2))
    with pytest.raises(ValueError, match="HOST:PORT"):
        Topology.of(ParallelConfig(tp_size=2, dist_init_addr="nohost"))
    second_node = Topology.of(ParallelConfig(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="h:1"))
    assert second_node.local_ranks == range(2, 4)


@pytest.mark.parametrize("case", CASES)
def test_tp2_emits_what_tp1_emits(tiny_llama, drafters, case):
    kwargs = CASES[case](tiny_llama, drafters)
    want, want_kv = generate(make_engine(tiny_llama, **kwargs))
    got, got_kv = generate(make_engine(tiny_llama, tp_size=2, **kwargs))
    for i, (g, w) in enumerate(zip(got.outputs, want.outputs, strict=True)):
        assert g.token_ids == w.token_ids, f"request {i} differs at TP 2"
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-9
        for got_t, want_t in zip(got_kv[g.request_id], want_kv[w.request_id]):
            # each rank's heads are the TP-1 heads; the residual stream differs only in float64 rounding
            torch.testing.assert_close(got_t, want_t, rtol=0, atol=1e-9)
    assert got.engine.stats == want.engine.stats       # the drafters saw the same features and drafted alike


def test_tp2_samples_what_tp1_samples_with_a_seed(tiny_llama, drafters):
    want, _ = generate(make_engine(tiny_llama), SAMPLED)
    got, _ = generate(make_engine(tiny_llama, tp_size=2, **CASES["dspark"](tiny_llama, drafters)), SAMPLED)
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]


def test_int8_speculation_at_tp2_reproduces_plain_decoding_at_tp2(tiny_llama, drafters):
    """Each rank's int8 linears quantize its own share of a row, so TP 2 is not TP 1 bit for bit; but the sums
    over ranks are taken in a fixed order, so a row's result still does not depend on the batch or window."""
    plain, _ = generate(make_engine(tiny_llama, tp_size=2, quantization="int8"))
    spec, _ = generate(make_engine(tiny_llama, tp_size=2, quantization="int8", **CASES["dspark"](tiny_llama, drafters)))
    assert [o.token_ids for o in spec.outputs] == [o.token_ids for o in plain.outputs]


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "just-killed"])
def test_a_dead_rank_fails_the_step_with_rank_failure_naming_it(tiny_llama, reaped):
    """Just killed, the rank's socket may close before its exit is seen: the collective's failure still names it."""
    engine = make_engine(tiny_llama, tp_size=2)
    try:
        engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=4))
        engine.step()
        os.kill(engine.model.processes[0].pid, signal.SIGKILL)
        if reaped:
            engine.model.processes[0].join(timeout=10)
        with pytest.raises(RankFailure, match="tp1 exited with code -9"):
            engine.step()
    finally:
        engine.close()


PROMPT = "Write a Python function that adds two numbers."


@pytest.fixture(scope="module")
def embedded_float64_greedy() -> list[int]:
    with LLM(dtype="float64", quantization="none", num_threads=1) as llm:
        return llm.generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=0.0), chat=True)[0].token_ids


@pytest.mark.real_model
@pytest.mark.parametrize("algorithm", ["NONE", "DSPARK"])
def test_generate_at_tp3_prints_what_tp1_prints_on_the_embedded_pair(embedded_float64_greedy, algorithm):
    """SmolLM2's 3 KV heads over 3 ranks, float64 weights so that TP 3 and TP 1 differ only in rounding."""
    flags = ["--max-new-tokens", "12", "--dtype", "float64", "--quantization", "none", "--threads", "1"]
    done = subprocess.run([sys.executable, "-m", "specserve.cli", "generate", PROMPT, *flags, "--json", "--tp-size",
                           "3", "--speculative-algorithm", algorithm], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1])["token_ids"] == embedded_float64_greedy


def test_a_second_node_runs_its_ranks_for_node_0(tiny_llama, tmp_path):
    """--nnodes 2 on one machine: `serve --node-rank 1` holds rank 1 until node 0's engine stops it."""
    folder = save_hf_folder(tiny_llama, tmp_path / "tiny")
    addr = f"127.0.0.1:{free_port()}"
    flags = ["--model-path", str(folder), "--dtype", "float64", "--tp-size", "2", "--nnodes", "2",
             "--dist-init-addr", addr, "--threads", "1"]
    node1 = subprocess.Popen([sys.executable, "-m", "specserve.cli", "serve", *flags, "--node-rank", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        want, _ = generate(make_engine(tiny_llama))
        got, _ = generate(make_engine(tiny_llama, model_path=str(folder), tp_size=2, nnodes=2, dist_init_addr=addr))
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
        output, _ = node1.communicate(timeout=30)
    finally:
        node1.kill()
    assert node1.returncode == 0, output
    assert "node 1: tensor-parallel ranks [1] started" in output
