"""Tensor-parallel ranks as processes over torch.distributed (gloo on CPU): where they meet, how rank 0
hands each step to the others, and the collectives the sharded model uses.

Rank 0 is the engine's process; the other ranks run `rank_main`, a loop that takes rank 0's commands and
runs them on their shard (models/tensor_parallel.py). With --nnodes > 1, node 0 starts its share of the
ranks and every other node runs `serve_node` for its own."""
from __future__ import annotations

import logging
import multiprocessing
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from specserve.config import ParallelConfig

log = logging.getLogger(__name__)

# A dead peer closes its sockets, which fails a collective at once; the timeout only bounds a hung one,
# and the other ranks wait in a collective for rank 0's next command however long the server idles.
IDLE_TIMEOUT = timedelta(days=7)


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the engine cannot go on."""


@dataclass(frozen=True)
class Topology:
    """Where the ranks of one tensor-parallel group run."""
    tp_size: int
    nnodes: int
    node_rank: int
    init_addr: str                  # HOST:PORT of the rendezvous on node 0

    @staticmethod
    def of(parallel: ParallelConfig) -> Topology:
        if parallel.tp_size < 1:
            raise ValueError(f"--tp-size must be at least 1, got {parallel.tp_size}")
        if parallel.nnodes < 1 or parallel.tp_size % parallel.nnodes:
            raise ValueError(f"--nnodes {parallel.nnodes} must divide --tp-size {parallel.tp_size}: "
                             "every machine runs the same number of ranks")
        if not 0 <= parallel.node_rank < parallel.nnodes:
            raise ValueError(f"--node-rank must be in [0, {parallel.nnodes}), got {parallel.node_rank}")
        addr = parallel.dist_init_addr
        if addr is None:
            if parallel.nnodes > 1:
                raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address), the same on "
                                 "every machine")
            addr = f"127.0.0.1:{free_port()}"
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--dist-init-addr must be HOST:PORT, got {addr!r}")
        return Topology(parallel.tp_size, parallel.nnodes, parallel.node_rank, addr)

    @property
    def local_ranks(self) -> range:
        per_node = self.tp_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, topology: Topology) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://{topology.init_addr}", rank=rank,
                                world_size=topology.tp_size, timeout=IDLE_TIMEOUT)
    except Exception as exc:
        raise RuntimeError(f"rank {rank} could not join the tensor-parallel group at {topology.init_addr}: "
                           f"{exc} (is the port free and reachable from every node?)") from exc


def threads_per_rank(topology: Topology, requested: int | None) -> int:
    """--threads, or this machine's cores shared by its ranks."""
    return requested or max(1, (os.cpu_count() or 1) // len(topology.local_ranks))


# ---- collectives --------------------------------------------------------------------------------------

def sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """Sum of every rank's x, added in rank order on every rank: a row's sum then never depends on how the
    collective splits the buffer (which changes with the batch's rows), so speculation still reproduces
    plain decoding bit for bit."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def concat_over_ranks(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Every rank's x (same shape on each), concatenated along `dim` in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def broadcast_command(command: object | None = None) -> object:
    """Rank 0's command (any picklable value) on every rank."""
    box = [command]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---- processes ----------------------------------------------------------------------------------------

RankMain = Callable[[int, Topology, int, dict], None]


def start_ranks(ranks: range, topology: Topology, threads: int, target: RankMain,
                args: dict) -> list[multiprocessing.Process]:
    """Start `target(rank, topology, threads, args)` in a fresh process per rank (spawn: no forked torch
    state). Daemonic, so they end with the process that started them."""
    context = torch.multiprocessing.get_context("spawn")
    processes = []
    for rank in ranks:
        p = context.Process(target=target, args=(rank, topology, threads, args), name=f"specserve-tp{rank}",
                            daemon=True)
        p.start()
        processes.append(p)
    return processes


def check_alive(processes: list[multiprocessing.Process]) -> None:
    for p in processes:
        if not p.is_alive():
            raise RankFailure(f"tensor-parallel rank process {p.name} exited with code {p.exitcode}")
