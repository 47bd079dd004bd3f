"""Tensor parallelism for the Llama family, in Megatron's layout: each rank holds its share of the attention
heads (QKV split by output rows, O by input columns), of the MLP (gate/up by rows, down by columns), of the
vocabulary (embedding and LM head by rows) and of the KV cache (its KV heads). A layer's attention and MLP
each end in one sum over the ranks; the residual stream, norms and rotary tables are replicated.

`TensorParallelModel` is rank 0's face of the sharded target: the interface of LlamaModel that the engine,
runner, proposers and cost table use. Its forward and logits hand each call to the other ranks
(`rank_main`, one process each, distributed.py) and run rank 0's own shard beside them."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import queue
import time
import weakref
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from specserve.attention.sdpa import AttentionMetadata
from specserve.config import ModelConfig, ParallelConfig
from specserve.distributed import (
    RankFailure,
    Topology,
    broadcast_command,
    check_alive,
    concat_over_ranks,
    init_group,
    start_ranks,
    sum_over_ranks,
    threads_per_rank,
)
from specserve.kv_pages import KVGeometry, KVPool
from specserve.loader import LoadedCheckpoint, load_checkpoint
from specserve.models.layers import Linear, make_linear, rms_norm
from specserve.models.llama import LlamaModel, warm_up
from specserve.quantization import Int8Linear, served_quantization

log = logging.getLogger(__name__)


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    """A rank must hold whole KV heads (and so whole query groups) and an equal share of the MLP."""
    kv_heads, heads = config.num_kv_heads, config.num_heads
    if kv_heads % tp_size or config.intermediate_size % tp_size:
        valid = [n for n in range(1, kv_heads + 1) if kv_heads % n == 0 and config.intermediate_size % n == 0]
        raise ValueError(f"--tp-size {tp_size} does not divide {config.name or config.architecture}'s "
                         f"{kv_heads} KV heads ({heads} heads) and {config.intermediate_size} MLP columns: "
                         f"use one of {', '.join(map(str, valid))}")


def vocab_share(vocab_size: int, rank: int, tp_size: int) -> tuple[int, int]:
    """[start, end) of the vocabulary rows a rank holds: ceil(vocab / tp) each, the last one fewer."""
    per = math.ceil(vocab_size / tp_size)
    return min(rank * per, vocab_size), min((rank + 1) * per, vocab_size)


def shard_weights(config: ModelConfig, weights: dict[str, torch.Tensor], rank: int,
                  tp_size: int) -> dict[str, torch.Tensor]:
    """The rank's share of every tensor, under the same names (copies: the full tensors can be freed)."""
    hd = config.head_dim
    q = slice(rank * config.num_heads // tp_size * hd, (rank + 1) * config.num_heads // tp_size * hd)
    kv = slice(rank * config.num_kv_heads // tp_size * hd, (rank + 1) * config.num_kv_heads // tp_size * hd)
    ff = slice(rank * config.intermediate_size // tp_size, (rank + 1) * config.intermediate_size // tp_size)
    vocab = slice(*vocab_share(config.vocab_size, rank, tp_size))
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": ff, "up_proj": ff,
            "embed_tokens": vocab, "lm_head": vocab}
    columns = {"o_proj": q, "down_proj": ff}
    out = {}
    for name, w in weights.items():
        module = name.split(".")[-2]
        if module in rows:
            out[name] = w[rows[module]].clone()
        elif module in columns and name.endswith("weight"):
            out[name] = w[:, columns[module]].clone()
        else:
            out[name] = w                           # norms: replicated
    return out


def shard_config(config: ModelConfig, rank: int, tp_size: int) -> ModelConfig:
    start, end = vocab_share(config.vocab_size, rank, tp_size)
    return dataclasses.replace(config, num_heads=config.num_heads // tp_size,
                               num_kv_heads=config.num_kv_heads // tp_size,
                               intermediate_size=config.intermediate_size // tp_size, vocab_size=end - start)


class ModelShard:
    """One rank's part of the target; every rank calls forward and logits together."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 quantization: str, rank: int, tp_size: int) -> None:
        self.config = config
        self.tp_size = tp_size
        self.vocab_start, _ = vocab_share(config.vocab_size, rank, tp_size)
        self.vocab_per_rank = math.ceil(config.vocab_size / tp_size)
        self.model = LlamaModel(shard_config(config, rank, tp_size), shard_weights(config, weights, rank, tp_size),
                                dtype, quantization=quantization)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, pool: KVPool,
                aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """LlamaModel.forward over this rank's shard and KV pool; the results are the same on every rank."""
        m = self.model
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < len(m.embed))
        # exactly one rank holds each token's row, so the sum adds only zeros to it
        x = sum_over_ranks(m.embed[local.clamp(0, len(m.embed) - 1)] * inside[:, None].to(m.embed.dtype))
        cos, sin = m.rope.tables(positions)
        chunks = list(meta.chunks)
        aux = []
        for i, layer in enumerate(m.layers):
            x = x + sum_over_ranks(layer.attention(x, cos, sin, pool.k[i], pool.v[i], meta.slot_mapping, chunks,
                                                   meta.rows))
            x = x + sum_over_ranks(layer.mlp(x))
            if i in aux_layer_ids:
                aux.append(x)
        return rms_norm(x, m.final_norm, self.config.rms_norm_eps), aux

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [rows, hidden] → [rows, vocab], every rank's vocabulary rows gathered
        local = self.model.logits(hidden)
        pad = self.vocab_per_rank - local.shape[1]
        if pad:
            local = torch.cat([local, local.new_full((len(local), pad), float("-inf"))], dim=1)
        return concat_over_ranks(local, dim=1)[:, :self.config.vocab_size]


@dataclass(frozen=True)
class PoolSpec:
    """A KV pool as rank 0 names it; each rank keeps its own shard of it under the same key."""
    key: int
    geometry: KVGeometry
    num_pages: int
    page_size: int


@dataclass(frozen=True)
class Forward:
    pool: PoolSpec
    dropped_pools: tuple[int, ...]     # keys of pools rank 0 has let go of
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    aux_layer_ids: tuple[int, ...]


@dataclass(frozen=True)
class Logits:
    hidden: torch.Tensor


@dataclass(frozen=True)
class GatherKV:
    pool_key: int


class Stop:
    pass


def run_command(shard: ModelShard, pools: dict[int, KVPool], command: object) -> object:
    """What every rank does for one of rank 0's commands."""
    if isinstance(command, Forward):
        for key in command.dropped_pools:
            pools.pop(key, None)
        spec = command.pool
        if spec.key not in pools:
            pools[spec.key] = KVPool(spec.geometry, spec.num_pages, spec.page_size)
        return shard.forward(command.input_ids, command.positions, command.meta, pools[spec.key],
                             command.aux_layer_ids)
    if isinstance(command, Logits):
        return shard.logits(command.hidden)
    if isinstance(command, GatherKV):
        pool = pools[command.pool_key]
        return concat_over_ranks(pool.k, dim=2), concat_over_ranks(pool.v, dim=2)
    raise TypeError(f"unknown tensor-parallel command {command!r}")


def build_shard(rank: int, topology: Topology, args: dict) -> ModelShard:
    ckpt = args["checkpoint"] or load_checkpoint(args["model_path"], args["dtype"])
    quantization = served_quantization(args["quantization"], ckpt)
    return ModelShard(ckpt.config, ckpt.weights, args["dtype"], quantization, rank, topology.tp_size)


def rank_main(rank: int, topology: Topology, threads: int, args: dict) -> None:
    """A rank other than 0: build the shard, report ready (or why not), join the group, serve commands."""
    torch.set_num_threads(threads)
    ready: queue.Queue | None = args.get("ready")
    try:
        shard = build_shard(rank, topology, args)
    except Exception as exc:
        if ready is not None:
            ready.put((rank, f"{type(exc).__name__}: {exc}"))
        raise
    if ready is not None:
        ready.put((rank, None))
    init_group(rank, topology)
    pools: dict[int, KVPool] = {}
    while not isinstance(command := broadcast_command(), Stop):
        run_command(shard, pools, command)
    # leaving the gloo group to interpreter teardown once aborted a node-1 rank (SIGABRT, exit -6) in CI
    torch.distributed.destroy_process_group()


def serve_node(parallel: ParallelConfig, model_path: str | None, dtype: torch.dtype, quantization: str | None,
               threads: int | None) -> None:
    """A machine other than node 0 (--node-rank > 0): run its ranks until rank 0 stops them."""
    topology = Topology.of(parallel)
    args = {"checkpoint": None, "model_path": model_path, "dtype": dtype, "quantization": quantization}
    processes = start_ranks(topology.local_ranks, topology, threads_per_rank(topology, threads), rank_main, args)
    log.info("node %d: tensor-parallel ranks %s started, waiting for rank 0 at %s", topology.node_rank,
             list(topology.local_ranks), topology.init_addr)
    for p in processes:
        p.join()
    if failed := [p for p in processes if p.exitcode]:
        raise RankFailure(f"rank process {failed[0].name} exited with code {failed[0].exitcode}")


class TensorParallelModel:
    """Rank 0's face of a target split over --tp-size ranks, with LlamaModel's interface. The drafters, which
    run on rank 0 only, share the target's full embedding and vocabulary projection, kept here for them."""

    def __init__(self, ckpt: LoadedCheckpoint, dtype: torch.dtype, quantization: str, parallel: ParallelConfig,
                 threads: int | None) -> None:
        topology = Topology.of(parallel)
        check_tp_size(ckpt.config, topology.tp_size)
        self.config = ckpt.config
        self.dtype = dtype
        self.quantization = quantization
        self.tp_size = topology.tp_size
        self.embed = ckpt.weights["model.embed_tokens.weight"].to(dtype)       # [vocab, hidden], for drafters
        self._head_weight = self.embed if ckpt.config.tie_word_embeddings else ckpt.weights["lm_head.weight"]
        threads = threads_per_rank(topology, threads)
        torch.set_num_threads(threads)
        # each rank loads a checkpoint from its file or folder; one built in memory travels to them
        on_disk = Path(ckpt.source).exists()
        ready = torch.multiprocessing.get_context("spawn").Queue()
        args = {"checkpoint": None if on_disk else dataclasses.replace(ckpt, tokenizer=None),
                "model_path": ckpt.source if on_disk else None, "dtype": dtype, "quantization": quantization,
                "ready": ready}
        self.processes = start_ranks(topology.local_ranks[1:], topology, threads, rank_main, args)
        try:
            self._wait_ready(ready, len(self.processes))
            self.shard = ModelShard(ckpt.config, ckpt.weights, dtype, quantization, 0, topology.tp_size)
            init_group(0, topology)
        except BaseException:
            self._kill()
            raise
        self._pool_keys: weakref.WeakKeyDictionary[KVPool, int] = weakref.WeakKeyDictionary()
        self._next_key = itertools.count()
        self._dropped: list[int] = []
        self.closed = False
        log.info("tensor parallel: %d ranks (%d on this machine), %d threads each, rendezvous at %s; rank processes %s",
                 topology.tp_size, len(topology.local_ranks), threads, topology.init_addr,
                 [p.pid for p in self.processes])

    def _wait_ready(self, ready, count: int) -> None:
        for _ in range(count):
            while True:
                try:
                    rank, error = ready.get(timeout=0.5)
                    break
                except queue.Empty:
                    check_alive(self.processes)
            if error is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} failed to load its shard: {error}")

    def _kill(self) -> None:
        for p in self.processes:
            p.kill()
            p.join()

    @cached_property
    def head(self) -> Linear | Int8Linear:
        """The whole vocabulary projection, built on a drafter's first use."""
        return make_linear(self._head_weight.to(self.dtype), quantization=self.quantization, plain_single_row=True)

    def kv_geometry(self, dtype: torch.dtype) -> KVGeometry:
        """Each rank's share of the target's KV cache."""
        return KVGeometry.of(self.shard.model.config, dtype)

    def row_weights(self) -> int:
        return self.shard.model.row_weights() * self.tp_size

    def warm_up(self, kv_dtype: torch.dtype) -> None:
        warm_up(self, kv_dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, pool: KVPool,
                aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        spec = PoolSpec(self._key(pool), pool.geometry, pool.num_pages, pool.page_size)
        dropped, self._dropped = tuple(self._dropped), []
        command = Forward(spec, dropped, input_ids, positions, meta, tuple(aux_layer_ids))
        return self._run(command, {spec.key: pool})

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._run(Logits(hidden), {})

    def gather_kv(self, pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's share of a pool's K and V, concatenated over KV heads: [layers, slots, kv_heads, head_dim]."""
        return self._run(GatherKV(self._key(pool)), {self._key(pool): pool})

    def _run(self, command: object, pools: dict[int, KVPool]) -> object:
        if self.closed:
            raise RankFailure("the tensor-parallel ranks were stopped")
        try:
            check_alive(self.processes)
            broadcast_command(command)
            return run_command(self.shard, pools, command)
        except RankFailure:
            raise
        except RuntimeError as exc:       # gloo: a peer closed its connection
            self._wait_for_an_exit()
            check_alive(self.processes)   # names the rank whose death broke the collective
            raise RankFailure(f"a tensor-parallel collective failed: {exc}") from exc

    def _wait_for_an_exit(self, wait_s: float = 2.0) -> None:
        """A dying rank's socket can close before its exit is seen: give it that long to be reaped."""
        deadline = time.monotonic() + wait_s
        while all(p.is_alive() for p in self.processes) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _key(self, pool: KVPool) -> int:
        key = self._pool_keys.get(pool)
        if key is None:
            key = self._pool_keys[pool] = next(self._next_key)
            weakref.finalize(pool, self._dropped.append, key)
        return key

    def close(self) -> None:
        """Stop the other ranks and leave the group; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        # A broadcast to a dead rank may wait forever (gloo does not always see the closed connection): stop the
        # ranks by message only while all live; _kill ends the rest.
        if all(p.is_alive() for p in self.processes):
            try:
                broadcast_command(Stop())
            except RuntimeError:
                pass                     # a rank died meanwhile: nothing left to stop there
        for p in self.processes:
            p.join(timeout=10)
        self._kill()
        torch.distributed.destroy_process_group()
