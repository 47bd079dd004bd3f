"""Data parallelism (--dp-size N): replicas 1..N-1 of the engine, each in a process of its own.

A replica process builds its engine from the server's engine arguments and runs replica 0's loop
(async_engine.drive) over two pipes: commands in, each step's (outputs, gauges) out. In the server, one thread
per replica forwards its inbox to the pipe and another hands what comes back to the event loop. When a replica
process dies, that thread tells the AsyncEngine: the replica's requests fail with 500 and the server drains the
others and exits 1. A replica process ends when told to, or when the server's end of its pipes closes."""
from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from specserve.config import engine_config
from specserve.engine import Engine
from specserve.server.async_engine import Command, Deliver, EngineError, drive

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0   # for a replica to abort its requests and exit when told to, before it is killed


class ReplicaError(RuntimeError):
    """A replica process could not start."""


def replica_args(engine_args: dict, index: int) -> dict:
    """Replica `index`'s engine arguments: one replica each, and a seed of its own, so that unseeded sampled
    requests on different replicas draw different tokens (seeded ones are the same on any replica). Replicas
    with tensor-parallel ranks meet at ports of their own: --dist-init-addr's port plus the replica's index."""
    args = {**engine_args, "dp_size": 1, "seed": engine_args.get("seed", 0) + index}
    if index and (addr := engine_args.get("dist_init_addr")):
        host, _, port = addr.rpartition(":")
        args["dist_init_addr"] = f"{host}:{int(port) + index}"
    return args


class RemoteReplica:
    """The server's handle on a replica process; it starts loading at once, beside the others."""

    def __init__(self, index: int, engine_args: dict) -> None:
        self.index = index
        self.inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        # spawned, not forked: a fork would copy the server's threads, locks and torch thread pools
        context = multiprocessing.get_context("spawn")
        their_commands, self._commands = context.Pipe(duplex=False)
        self._results, their_results = context.Pipe(duplex=False)
        # not daemonic: a replica may start tensor-parallel ranks of its own; serve() joins or kills it
        self._process = context.Process(target=_run, args=(index, engine_args, their_commands, their_results),
                                        name=f"specserve-dp{index}")
        self._process.start()
        # only the child holds its ends now, so its death reads as EOF here and a send to it fails
        their_commands.close()
        their_results.close()
        log.info("data-parallel replica %d started as process %d", index, self._process.pid)
        self._stopping = False
        self._threads: list[threading.Thread] = []

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    def wait_ready(self) -> None:
        """Return once the replica has built its engine; ReplicaError if it could not."""
        try:
            failure = self._results.recv()
        except EOFError:
            self._process.join(STOP_TIMEOUT_S)
            failure = f"it exited ({_exit_reason(self._process.exitcode)})"
        if failure is not None:
            raise ReplicaError(f"data-parallel replica {self.index} failed to start: {failure}")

    def start(self, deliver: Deliver, on_exit: Callable[[EngineError], None]) -> None:
        self._threads = [threading.Thread(target=self._send, name=f"dp{self.index}-send", daemon=True),
                         threading.Thread(target=self._receive, args=(deliver, on_exit), name=f"dp{self.index}-receive",
                                          daemon=True)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stopping = True
        self.inbox.put(None)
        self._process.join(STOP_TIMEOUT_S)
        self.kill()
        for thread in self._threads:
            thread.join()

    def kill(self) -> None:
        """End the process now if it still runs (a no-op after stop)."""
        self._stopping = True
        if self._process.is_alive():
            self._process.kill()
        self._process.join()

    def _send(self) -> None:
        while True:
            command = self.inbox.get()
            try:
                self._commands.send(command)
            except ConnectionError:
                return          # the process is gone: _receive reports it
            if command is None:
                return

    def _receive(self, deliver: Deliver, on_exit: Callable[[EngineError], None]) -> None:
        while True:
            try:
                items, snap = self._results.recv()
            except EOFError:
                break
            deliver(items, snap)
        self._process.join(STOP_TIMEOUT_S)
        if not self._stopping:
            on_exit(EngineError(f"data-parallel replica {self.index} died ({_exit_reason(self._process.exitcode)}); "
                                "the server is shutting down"))


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def _run(index: int, engine_args: dict, commands: Connection, results: Connection) -> None:
    """The replica process: report readiness (None) or why the engine could not be built, then serve commands."""
    # Ctrl-C reaches the whole process group: the server drains, then stops its replicas itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"[replica {index}] %(message)s", stream=sys.stderr)
    try:
        engine = Engine(engine_config(**engine_args))
    except Exception as exc:
        results.send(f"{type(exc).__name__}: {exc}")
        raise

    def receive(block: bool) -> list[Command]:
        batch = [commands.recv()] if block else []
        while commands.poll():
            batch.append(commands.recv())
        return batch

    try:
        results.send(None)      # ready
        drive(engine, receive, lambda items, snap: results.send((items, snap)))
    except (EOFError, ConnectionError):
        pass                    # the server is gone
    finally:
        engine.close()
