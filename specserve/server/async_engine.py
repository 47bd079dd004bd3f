"""The engine in its own thread, bridged to asyncio.

The engine is not thread-safe, so only the engine thread touches it: HTTP handlers submit and abort
through a thread-safe inbox that the thread drains between steps, and the thread hands each step's
outputs back to the event loop, which routes them to per-request asyncio queues."""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from specserve.engine import Engine
from specserve.server.metrics import Metrics
from specserve.types import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class Unavailable(Exception):
    """The server cannot take the request now (full queue, shutting down); the client should retry."""


class EngineError(Exception):
    """The engine failed while running a request; the server goes on."""


@dataclass
class _Route:
    queue: asyncio.Queue
    index: int
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
            if rid in self.owner.routes:
                self.owner.inbox.put(("abort", rid))


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: Metrics, max_requests: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_requests = max_requests      # running + queued engine requests admitted at once
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.routes: dict[str, _Route] = {}   # event-loop side: unfinished engine requests
        self.accepting = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- event-loop side ----------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()
        self.accepting = True

    @property
    def healthy(self) -> bool:
        return self.accepting and self._thread.is_alive()

    def submit(self, jobs: list[tuple[list[int], SamplingParams]]) -> Submission:
        if not self.accepting:
            raise Unavailable("the server is shutting down")
        if len(self.routes) + len(jobs) > self.max_requests:
            raise Unavailable(f"the server is at its limit of {self.max_requests} running and queued requests "
                              f"(--max-running-requests + --max-queued-requests): retry later")
        sub = Submission(self, [f"r{next(self._ids)}" for _ in jobs])
        now = time.perf_counter()
        for index, (rid, (prompt, params)) in enumerate(zip(sub.ids, jobs)):
            self.routes[rid] = _Route(sub.queue, index, now)
            self.inbox.put(("add", rid, prompt, params))
        return sub

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
        self.inbox.put(None)
        await asyncio.to_thread(self._thread.join)

    def _abort_all(self) -> None:
        for rid in list(self.routes):
            self.inbox.put(("abort", rid))

    def _dispatch(self, items: list[tuple[str, RequestOutput | Exception]]) -> None:
        now = time.perf_counter()
        for rid, item in items:
            route = self.routes.get(rid)
            if route is None:
                continue
            if isinstance(item, Exception) or item.finished:
                del self.routes[rid]
            if isinstance(item, RequestOutput) and item.token_ids:
                if route.first_token is None:
                    route.first_token = now
                    self.metrics.ttft.observe(now - route.submitted)
                if item.finished and len(item.token_ids) > 1:
                    self.metrics.tpot.observe((now - route.first_token) / (len(item.token_ids) - 1))
            route.queue.put_nowait((route.index, item))

    # ---- engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            items: list[tuple[str, RequestOutput | Exception]] = []
            # block only when there is nothing to step
            commands = [self.inbox.get()] if not engine.has_unfinished else []
            while not self.inbox.empty():
                commands.append(self.inbox.get())
            for command in commands:
                if command is None:
                    self._abort(list(engine.requests), items, None)
                    self._deliver(items)
                    return
                self._apply(command, items)
            if engine.has_unfinished:
                try:
                    items += [(out.request_id, out) for out in engine.step()]
                except Exception as exc:
                    # the culprit cannot be told apart inside a batched step: fail the running requests and
                    # leave the queued ones (a request that fails alone is failed once it runs)
                    running = [req.request_id for req in engine.scheduler.running]
                    log.exception("engine step failed; failing its %d running requests", len(running))
                    self._abort(running, items, EngineError(f"the engine failed: {type(exc).__name__}: {exc}"))
            for _, item in items:
                if isinstance(item, Exception) or item.finished:
                    self.metrics.finished.labels(getattr(item, "finish_reason", "error")).inc()
            self.metrics.observe_engine(engine)
            self._deliver(items)

    def _apply(self, command: tuple, items: list) -> None:
        if command[0] == "add":
            _, rid, prompt, params = command
            try:
                self.engine.add_request(prompt, params, request_id=rid)
                self.metrics.prompt_tokens.inc(len(prompt))
            except ValueError as exc:
                items.append((rid, exc))
        else:
            out = self.engine.abort(command[1])
            if out is not None:
                items.append((out.request_id, out))

    def _abort(self, rids: list[str], items: list, error: Exception | None) -> None:
        """Abort requests; their consumers get `error` or, when None, the aborted output."""
        for rid in rids:
            out = self.engine.abort(rid)
            items.append((rid, error or out))

    def _deliver(self, items: list) -> None:
        if items:
            self._loop.call_soon_threadsafe(self._dispatch, items)
