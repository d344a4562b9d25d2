"""Runs an ``EngineCore`` on a dedicated thread so network I/O never stalls a step.

Services talk to the engine only through this class: ``submit(fn)`` runs ``fn(engine)`` on the
engine thread between steps and returns a ``concurrent.futures.Future`` (so validation errors
reach the caller as exceptions), and every step's outputs go to the per-request sink registered
with ``add_sink``. After each step, ``on_step(engine, outputs)`` runs on the engine thread (the
services hand KV events, remote-prefill requests and ready blocks to their I/O threads there;
it must not block); before its outputs are delivered, ``on_step_time(seconds, tokens)`` gets
the step's duration and the tokens it scheduled (the worker's step metrics).

Failures: a sink that raises fails its own request (``EngineCore.fail_request``), and the
request's final output still reaches the batch sinks. Anything else that raises on the engine
thread (``step()``, ``on_step``) is fatal: the loop stops, every open request gets a final
output whose ``failure`` is of kind ``ENGINE``, pending commands fail with
:class:`EngineDeadError`, and ``on_fatal(error)`` runs once (the services then leave the
registry and exit non-zero so that their supervisor restarts them).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from shared.engine import EngineCore
from shared.engine.outputs import EngineCoreOutput, FailureKind, RequestFailure

logger = logging.getLogger(__name__)

YIELD_ENV = "PDSERVE_ENGINE_YIELD"

Sink = Callable[[EngineCoreOutput], None]


class EngineDeadError(RuntimeError):
    """The engine loop stopped after a fatal error; nothing more can run on it."""


class EngineLoop:
    def __init__(
        self,
        engine: EngineCore,
        on_step: Callable[[EngineCore, list[EngineCoreOutput]], None] | None = None,
        idle_wait_s: float = 0.05,
        on_fatal: Callable[[BaseException], None] | None = None,
        on_step_time: Callable[[float, int], None] | None = None,
        yield_after_outputs: bool | None = None,
    ) -> None:
        self.engine = engine
        # After a step whose outputs went out, give the CPU up once (sched_yield, the GIL
        # released): the event loop that was just woken to stream them runs now, on the same
        # core, instead of waiting until the scheduler preempts a thread that never blocks
        # (on Linux's EEVDF a woken thread may wait out the running one's slice, ~3 ms). Off
        # with PDSERVE_ENGINE_YIELD=0. docs/benchmarks.md, "The engine thread yields".
        if yield_after_outputs is None:
            yield_after_outputs = os.environ.get(YIELD_ENV, "1") != "0"
        self.yield_after_outputs = yield_after_outputs
        self._delivered = False  # outputs went out since the loop last yielded
        self.on_step = on_step
        self.on_step_time = on_step_time
        self.on_fatal = on_fatal
        self.idle_wait_s = idle_wait_s
        self._commands: deque[tuple[Callable[[EngineCore], Any], Future]] = deque()
        self._sinks: dict[str, Sink] = {}
        self._batch_sinks: list[AsyncOutputs] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.num_steps = 0
        self.step_seconds = 0.0
        self.heartbeat = time.monotonic()  # the loop's last sign of life (a step or an idle turn)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def stalled_for(self) -> float:
        """Seconds since the loop last showed life: an idle loop turns every ``idle_wait_s``,
        a busy one after every step, so this grows only while a step (or a command) hangs."""
        return 0.0 if not self.alive else time.monotonic() - self.heartbeat

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, fn: Callable[[EngineCore], Any]) -> Future:
        """Run ``fn(engine)`` on the engine thread before the next step."""
        fut: Future = Future()
        if not self.alive and self._thread.ident is not None:
            fut.set_exception(EngineDeadError(f"engine loop is not running: {self.error!r}"))
            return fut
        self._commands.append((fn, fut))
        self._wake.set()
        return fut

    def add_sink(self, request_id: str, sink: Sink) -> None:
        self._sinks[request_id] = sink

    def remove_sink(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)

    def add_batch_sink(self, sink: AsyncOutputs) -> None:
        """Receive every step's outputs at once (after the per-request sinks)."""
        self._batch_sinks.append(sink)

    def _run_commands(self) -> None:
        while self._commands:
            fn, fut = self._commands.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:  # noqa: BLE001 - delivered to the caller
                fut.set_exception(e)

    def deliver(self, outputs: list[EngineCoreOutput]) -> None:
        """Hand outputs to their sinks (engine thread; also used by command functions).

        A sink that raises fails its request: the engine ends it with finish reason "error"
        and that final output goes to the sink once more (if it raises again it is dropped)
        and to the batch sinks."""
        failed: dict[str, Exception] = {}
        if outputs:
            self._delivered = True
        for o in outputs:
            sink = self._sinks.get(o.request_id)
            if sink is not None and o.request_id not in failed:
                try:
                    sink(o)
                except Exception as e:
                    logger.exception("output sink of %s failed", o.request_id)
                    failed[o.request_id] = e
        if outputs:
            for batch_sink in self._batch_sinks:
                batch_sink(outputs)
        for rid, e in failed.items():
            final = self.engine.fail_request(rid, f"output sink failed: {type(e).__name__}: {e}")
            sink = self._sinks.get(rid)
            for o in final:
                try:
                    if sink is not None:
                        sink(o)
                except Exception:
                    logger.exception("output sink of %s failed on its final output", rid)
                    self._sinks.pop(rid, None)
                    sink = None
            if final:
                for batch_sink in self._batch_sinks:
                    batch_sink(final)

    def _yield_if_delivered(self) -> None:
        """Give the CPU up once after outputs went out (a step's, or a command's such as a
        remote prefill's first token): see ``yield_after_outputs``."""
        if self._delivered:
            self._delivered = False
            if self.yield_after_outputs:
                os.sched_yield()

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                self.heartbeat = time.monotonic()
                engine.check_alive()
                self._run_commands()
                self._yield_if_delivered()  # e.g. a remote prefill's first token
                if engine.has_unfinished_requests():
                    t0 = time.perf_counter()
                    outputs = engine.step()
                    dt = time.perf_counter() - t0
                    self.step_seconds += dt
                    self.num_steps += 1
                    if self.on_step_time is not None and engine.last_step_tokens:
                        self.on_step_time(dt, engine.last_step_tokens)
                    self.deliver(outputs)
                    if self.on_step is not None:
                        self.on_step(engine, outputs)
                    self._yield_if_delivered()
                else:
                    if self.on_step is not None:
                        self.on_step(engine, [])
                    if engine.prefault_kv():  # one chunk of the KV pool's next pages
                        continue
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
        except BaseException as e:  # fatal: fail every caller, never hang them
            logger.critical("engine loop died: %r", e, exc_info=e)
            self.error = e
            try:
                self._fail_everything(e)
            except Exception:  # the worker must still learn its engine is gone
                logger.exception("failing the open streams after the engine died failed")
            finally:
                if self.on_fatal is not None:
                    try:
                        self.on_fatal(e)
                    except Exception:
                        logger.exception("on_fatal callback failed")

    def _fail_everything(self, e: BaseException) -> None:
        while self._commands:
            _, fut = self._commands.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError(f"engine loop died: {e!r}"))
        failure = RequestFailure(FailureKind.ENGINE, f"the engine stopped: {type(e).__name__}: {e}")
        # tuple(): one atomic copy each; the event loop's thread registers and unregisters
        # streams meanwhile ("dictionary changed size during iteration" skipped on_fatal)
        batch_sinks = tuple(self._batch_sinks)
        rids = set(tuple(self._sinks)) | {r for b in batch_sinks for r in tuple(b.queues)}
        dead = [
            EngineCoreOutput(rid, 0, [], [], finish_reason="error", failure=failure) for rid in rids
        ]
        for o in dead:  # end every open stream
            sink = self._sinks.get(o.request_id)
            try:
                if sink is not None:
                    sink(o)
            except Exception:
                logger.exception("output sink of %s failed", o.request_id)
        for batch_sink in batch_sinks:
            try:
                batch_sink(dead)
            except Exception:
                logger.exception("a batch output sink failed")


class AsyncOutputs:
    """Hands engine outputs to per-request ``asyncio.Queue``s with one event-loop wake-up per
    engine step (not one per request), which matters at hundreds of streams."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        direct: Callable[[EngineCoreOutput], bool] | None = None,
    ) -> None:
        self.loop = loop
        self.queues: dict[str, asyncio.Queue] = {}
        # event loop: takes an output itself (True) instead of its request's queue, e.g. the
        # decode worker streaming a plain token without waking the request's coroutine
        self.direct = direct

    def register(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = q
        return q

    def unregister(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

    def __call__(self, outputs: list[EngineCoreOutput]) -> None:  # engine thread
        mine = [o for o in outputs if o.request_id in self.queues]
        if mine:
            self.loop.call_soon_threadsafe(self._put, mine)

    def _put(self, outputs: list[EngineCoreOutput]) -> None:  # event loop
        direct = self.direct
        for o in outputs:
            q = self.queues.get(o.request_id)
            if q is not None and (direct is None or not direct(o)):
                q.put_nowait(o)
