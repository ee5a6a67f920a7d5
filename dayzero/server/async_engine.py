"""The engine on its own thread, driven from an asyncio event loop.

Threads and ownership
- The engine thread owns the `Engine`: only it calls add_request / abort / step / pop_finished.
  The event loop never runs model compute.
- The event loop talks to it through an inbox of commands (add, abort, call) under one lock; the
  thread applies the whole inbox between steps, steps while any request is unfinished, and sleeps
  on the condition otherwise.
- Updates go back per request group: the thread puts a list of (index, RequestUpdate) on the
  group's asyncio.Queue with `loop.call_soon_threadsafe`, once per step.

Admission: at most `max_running_requests + max_queued_requests` requests are in flight (accepted
and unfinished); a group that would pass it raises `QueueFullError` at once (the server answers 503).
A group that stops being iterated (client gone, task cancelled) aborts its unfinished requests, which
frees their KV blocks at the next command drain.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from dayzero.engine.engine import Engine, RequestUpdate
from dayzero.engine.sampling import SamplingParams
from dayzero.server.metrics import Metrics


class QueueFullError(RuntimeError):
    """More requests than --max-running-requests + --max-queued-requests are in flight."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shutdown or a failed step)."""


@dataclass
class Submission:
    """One sequence to generate: a request id, validated prompt ids and params (and images), and which of
    a request's n completions it is (seeds completion i with seed + i)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sample_index: int = 0
    images: tuple = ()  # the prompt's image placements (Engine.prepare_images)


@dataclass
class _Route:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int  # position of this sequence in its group
    arrival: float  # time.perf_counter() at submission
    last_token: float | None = None  # time of the latest token; None before the first


class AsyncEngine:
    def __init__(self, engine: Engine, max_running_requests: int, max_queued_requests: int):
        self.engine = engine
        self.max_in_flight = max_running_requests + max_queued_requests
        self.metrics = Metrics()
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []  # ("add", Submission, _Route) | ("abort", rid) | ("call", fn, loop, future)
        self._routes: dict[str, _Route] = {}  # engine thread only
        self._in_flight: set[str] = set()  # request ids accepted, not yet finished or aborted; under _cv
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dayzero-engine", daemon=True)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop accepting, abort what is in flight (its streams end with finish_reason "abort"),
        and join the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    # -- requests (event loop side) ---------------------------------------------------------------
    async def generate(self, group: list[Submission]) -> AsyncIterator[tuple[int, RequestUpdate]]:
        """Run a group of sequences; yields (index in group, update) as steps produce them and ends
        once every sequence finished. Leaving early (break, cancellation) aborts the rest."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        now = time.perf_counter()
        with self._cv:
            if self._stopping or not self._thread.is_alive():
                raise EngineDeadError("the server is shutting down" if self._stopping else f"the engine stopped: {self.error!r}")
            if len(self._in_flight) + len(group) > self.max_in_flight:
                raise QueueFullError(
                    f"the server has {len(self._in_flight)} requests in flight and accepts at most "
                    f"{self.max_in_flight} (--max-running-requests + --max-queued-requests); retry later")
            ids = [sub.request_id for sub in group]
            clash = next((rid for rid in ids if rid in self._in_flight), None)
            if clash is not None or len(set(ids)) != len(ids):
                raise ValueError(f"request id {clash or ids!r} is already in flight; request ids must be unique")
            self._in_flight.update(ids)
            for i, sub in enumerate(group):
                self._inbox.append(("add", sub, _Route(loop, queue, i, now)))
            self._cv.notify()
        pending = {sub.request_id for sub in group}
        try:
            while pending:
                batch = await queue.get()
                if isinstance(batch, BaseException):
                    raise EngineDeadError(f"the engine failed: {batch!r}") from batch
                for index, update in batch:
                    if update.finished:
                        pending.discard(update.request_id)
                    yield index, update
        finally:
            if pending:
                with self._cv:
                    self._inbox.extend(("abort", rid) for rid in pending)
                    self._cv.notify()

    async def call(self, fn: Callable[[Engine], object]):
        """Run fn(engine) on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cv:
            if not self._thread.is_alive():
                raise EngineDeadError("the engine thread is not running")
            self._inbox.append(("call", fn, loop, future))
            self._cv.notify()
        return await future

    # -- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cv:
                    while not self._inbox and not engine.has_unfinished() and not self._stopping:
                        self._cv.wait()
                    commands, self._inbox = self._inbox, []
                    stopping = self._stopping
                for command in commands:
                    self._apply(command)
                if stopping:
                    break
                if engine.has_unfinished():
                    self._deliver(engine.step())
        except BaseException as exc:  # a failed step: every in-flight request gets the error
            self.error = exc
            for route in {id(r): r for r in self._routes.values()}.values():
                _send(route, exc)
            raise
        finally:
            self._abort_all()

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, sub, route = command
            self.engine.add_request(sub.request_id, sub.prompt_token_ids, sub.params, sub.sample_index, sub.images)
            self._routes[sub.request_id] = route
            self.metrics.on_prompt(len(sub.prompt_token_ids))
        elif kind == "abort":
            rid = command[1]
            if self._routes.pop(rid, None) is not None:
                self.engine.abort(rid)
                self._release([rid])
                self.metrics.on_finish("abort")
        elif kind == "call":
            _, fn, loop, future = command
            try:
                result, exc = fn(self.engine), None
            except Exception as e:  # handed to the caller
                result, exc = None, e
            loop.call_soon_threadsafe(_resolve, future, result, exc)

    def _deliver(self, updates: list[RequestUpdate]) -> None:
        now = time.perf_counter()
        batches: dict[int, tuple[_Route, list]] = {}
        for update in updates:
            route = self._routes.get(update.request_id)
            if route is None:
                continue
            if update.new_token_ids:
                n = len(update.new_token_ids)
                if route.last_token is None:
                    self.metrics.on_first_token(now - route.arrival, n)
                else:
                    self.metrics.on_token(now - route.last_token, n)
                route.last_token = now
            if update.finished:
                self.engine.pop_finished(update.request_id)
                del self._routes[update.request_id]
                self._release([update.request_id])
                self.metrics.on_finish(update.finish_reason, now - route.arrival)
            batches.setdefault(id(route.queue), (route, []))[1].append((route.index, update))
        for route, batch in batches.values():
            _send(route, batch)

    def _abort_all(self) -> None:
        for rid, route in list(self._routes.items()):
            self.engine.abort(rid)
            _send(route, [(route.index, RequestUpdate(rid, [], "", True, "abort"))])
        self._release(list(self._routes))
        self._routes.clear()
        with self._cv:  # commands that arrived after the last drain
            leftover, self._inbox = self._inbox, []
        for command in leftover:
            if command[0] == "add":
                _, sub, route = command
                _send(route, [(route.index, RequestUpdate(sub.request_id, [], "", True, "abort"))])
                self._release([sub.request_id])
            elif command[0] == "call":
                _, _, loop, future = command
                _safe_call(loop, _resolve, future, None, EngineDeadError("the engine stopped"))

    def _release(self, request_ids: list[str]) -> None:
        with self._cv:
            self._in_flight.difference_update(request_ids)


def _send(route: _Route, item) -> None:
    _safe_call(route.loop, route.queue.put_nowait, item)


def _safe_call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


def _resolve(future: asyncio.Future, result, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
