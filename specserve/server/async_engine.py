"""The engine replicas, bridged to asyncio.

An engine is not thread-safe, so only its replica's loop (`drive`) touches it: HTTP handlers submit and abort
through the replica's thread-safe inbox, which the loop drains between steps, and the loop hands each step's
outputs back to the event loop, which routes them to per-request asyncio queues. Replica 0 is an engine in a
thread of this process; with --dp-size N, replicas 1..N-1 run the same loop in processes of their own
(replicas.py), and each HTTP request goes to the replica that router.py picks: the one likely to hold its
prompt's prefix, unless it is much busier than the least loaded one."""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from specserve.distributed import RankFailure
from specserve.engine import Engine
from specserve.server.metrics import EngineSnapshot, Metrics
from specserve.server.router import PrefixRouter
from specserve.types import RequestOutput, SamplingParams

log = logging.getLogger(__name__)

Command = tuple | None   # ("add", request id, prompt ids, params) | ("abort", request id) | None: abort all, stop
Item = tuple[str, RequestOutput | Exception]    # a request's latest (cumulative) output, or why it failed
Deliver = Callable[[list[Item], EngineSnapshot], None]


class Unavailable(Exception):
    """The server cannot take the request now (full queue, shutting down); the client should retry."""


class EngineError(Exception):
    """An engine failed while running a request (a failed step, or a replica that died): the request gets 500."""


def drive(engine: Engine, receive: Callable[[bool], list[Command]], deliver: Deliver) -> None:
    """A replica's loop until the stop command: apply the commands `receive` gives (it blocks when told to, that
    is when nothing is left to step), step, and deliver the outputs with the engine's gauges."""
    deliver([], EngineSnapshot.of(engine))      # a replica process's gauges show before its first request
    while True:
        items: list[Item] = []
        for command in receive(not engine.has_unfinished):
            if command is None:
                items += [(rid, engine.abort(rid)) for rid in list(engine.requests)]
                deliver(items, EngineSnapshot.of(engine))
                return
            _apply(engine, command, items)
        if engine.has_unfinished:
            try:
                items += [(out.request_id, out) for out in engine.step()]
            except Exception as exc:
                # the culprit cannot be told apart inside a batched step: fail the running requests and
                # leave the queued ones (a request that fails alone is failed once it runs)
                running = [req.request_id for req in engine.scheduler.running]
                log.exception("engine step failed; failing its %d running requests", len(running))
                error = EngineError(f"the engine failed: {type(exc).__name__}: {exc}")
                for rid in running:
                    engine.abort(rid)
                    items.append((rid, error))
                if isinstance(exc, RankFailure):     # its tensor-parallel ranks are gone: it cannot step again
                    deliver(items, EngineSnapshot.of(engine))
                    raise
        deliver(items, EngineSnapshot.of(engine))


def _apply(engine: Engine, command: tuple, items: list[Item]) -> None:
    if command[0] == "add":
        _, rid, prompt, params = command
        try:
            engine.add_request(prompt, params, request_id=rid)
        except ValueError as exc:
            items.append((rid, exc))
    elif (out := engine.abort(command[1])) is not None:
        items.append((out.request_id, out))


class Replica(Protocol):
    """An engine that takes commands through `inbox` and delivers from a thread of its own."""
    inbox: queue.SimpleQueue

    @property
    def alive(self) -> bool: ...

    def start(self, deliver: Deliver, on_exit: Callable[[EngineError], None]) -> None:
        """Run; `on_exit` is called (from that thread) if the replica ends without being stopped."""

    def stop(self) -> None:
        """Abort what runs, deliver it, and end."""


class LocalReplica:
    """Replica 0: the engine in a thread of the server process (the only replica without --dp-size)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, deliver: Deliver, on_exit: Callable[[EngineError], None]) -> None:
        self._thread = threading.Thread(target=self._run, args=(deliver, on_exit), name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.inbox.put(None)
        self._thread.join()

    def _run(self, deliver: Deliver, on_exit: Callable[[EngineError], None]) -> None:
        try:
            drive(self.engine, self._receive, deliver)
        except Exception as exc:
            log.exception("the engine thread failed")
            on_exit(EngineError(f"replica 0 failed: {type(exc).__name__}: {exc}"))

    def _receive(self, block: bool) -> list[Command]:
        commands = [self.inbox.get()] if block else []
        while not self.inbox.empty():
            commands.append(self.inbox.get())
        return commands


@dataclass
class _Route:
    queue: asyncio.Queue
    index: int
    replica: int
    submitted: float
    first_token: float | None = None


@dataclass
class Submission:
    """The engine requests of one HTTP request (prompts × n choices), index i = choice i."""
    owner: AsyncEngine
    ids: list[str]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, cumulative output) until every choice has finished. Outputs that queued up while
        the consumer was busy are merged to the latest per choice: each one holds everything before it."""
        remaining = len(self.ids)
        while remaining:
            batch = [await self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            latest: dict[int, RequestOutput] = {}
            for index, item in batch:
                if isinstance(item, Exception):
                    raise item
                latest[index] = item
            for index, out in latest.items():
                remaining -= out.finished
                yield index, out

    def abort(self) -> None:
        """Abort the choices that have not finished (no-op for the rest); safe to call more than once."""
        for rid in self.ids:
            self.owner.abort(rid)


class AsyncEngine:
    def __init__(self, replicas: list[Replica], metrics: Metrics, max_requests: int, page_size: int) -> None:
        self.replicas = replicas
        self.router = PrefixRouter(len(replicas), page_size)
        self.metrics = metrics
        self.max_requests = max_requests      # running + queued engine requests admitted at once
        self.routes: dict[str, _Route] = {}   # event-loop side: unfinished engine requests
        self.load = [0] * len(replicas)       # unfinished engine requests per replica
        self.accepting = False
        self.on_failure: Callable[[], None] | None = None   # called once a replica has died
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- event-loop side ----------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for i, replica in enumerate(self.replicas):
            replica.start(functools.partial(self._deliver, i),
                          functools.partial(self._loop.call_soon_threadsafe, self._lost, i))
        self.accepting = True

    @property
    def healthy(self) -> bool:
        return self.accepting and all(replica.alive for replica in self.replicas)

    def submit(self, jobs: list[tuple[list[int], SamplingParams]]) -> Submission:
        if not self.accepting:
            raise Unavailable("the server is shutting down")
        if len(self.routes) + len(jobs) > self.max_requests:
            raise Unavailable(f"the server is at its limit of {self.max_requests} running and queued requests "
                              f"(--max-running-requests + --max-queued-requests): retry later")
        # one replica for all the choices: they share the prompt's prefix cache
        replica = self.router.route(jobs[0][0], self.load)
        inbox = self.replicas[replica].inbox
        sub = Submission(self, [f"r{next(self._ids)}" for _ in jobs])
        now = time.perf_counter()
        for index, (rid, (prompt, params)) in enumerate(zip(sub.ids, jobs)):
            self.routes[rid] = _Route(sub.queue, index, replica, now)
            inbox.put(("add", rid, prompt, params))
        self.load[replica] += len(jobs)
        self.metrics.routed.labels(str(replica)).inc(len(jobs))
        self.metrics.prompt_tokens.inc(sum(len(prompt) for prompt, _ in jobs))
        return sub

    def abort(self, rid: str) -> None:
        """Abort an engine request if it has not finished."""
        if (route := self.routes.get(rid)) is not None:
            self.replicas[route.replica].inbox.put(("abort", rid))

    def drain(self, grace_s: float, on_idle: Callable[[], None]) -> None:
        """Stop admitting (health and new requests answer 503); requests still running after `grace_s`
        seconds are aborted; `on_idle` runs once none is left. Signal-handler safe."""
        def later() -> None:
            self.accepting = False
            self._loop.call_later(grace_s, self._abort_all)
            self._loop.create_task(self._when_idle(on_idle))
        if self._loop is None:          # a signal during startup: nothing admitted yet
            on_idle()
        else:
            self._loop.call_soon_threadsafe(later)

    async def _when_idle(self, on_idle: Callable[[], None]) -> None:
        while self.routes:
            await asyncio.sleep(0.05)
        on_idle()

    async def stop(self) -> None:
        self.accepting = False
        await asyncio.gather(*(asyncio.to_thread(replica.stop) for replica in self.replicas))

    def _abort_all(self) -> None:
        for rid in list(self.routes):
            self.abort(rid)

    def _dispatch(self, items: list[Item]) -> None:
        now = time.perf_counter()
        for rid, item in items:
            route = self.routes.get(rid)
            if route is None:
                continue
            if isinstance(item, Exception) or item.finished:
                del self.routes[rid]
                self.load[route.replica] -= 1
                self.metrics.finished.labels(getattr(item, "finish_reason", "error")).inc()
            if isinstance(item, RequestOutput) and item.token_ids:
                if route.first_token is None:
                    route.first_token = now
                    self.metrics.ttft.observe(now - route.submitted)
                if item.finished and len(item.token_ids) > 1:
                    self.metrics.tpot.observe((now - route.first_token) / (len(item.token_ids) - 1))
            route.queue.put_nowait((route.index, item))

    def _lost(self, replica: int, error: EngineError) -> None:
        """A replica ended unasked: its requests fail with `error`, and the server is told."""
        log.error("%s", error)
        self.accepting = False
        self._dispatch([(rid, error) for rid, route in self.routes.items() if route.replica == replica])
        if self.on_failure is not None:
            self.on_failure()

    # ---- replica threads ----------------------------------------------------------------------------
    def _deliver(self, replica: int, items: list[Item], snap: EngineSnapshot) -> None:
        self.metrics.observe(replica, snap)
        if items:
            self._loop.call_soon_threadsafe(self._dispatch, items)
