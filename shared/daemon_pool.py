"""An executor whose threads never hold up the process's exit.

For work that cannot be interrupted and may run long after whoever asked for it gave up: a
grammar compile past its bound, a chat template rendering past its request's deadline.
``concurrent.futures.ThreadPoolExecutor`` (and asyncio's default executor) joins its threads
when the interpreter exits, so a worker that should exit now (its engine died, SIGTERM) stayed
alive until such work ended; the threads here are daemons, abandoned at exit.

Its queue is bounded (``max_queued``; jobs cancelled while queued do not count): while every
thread is stuck in such work, new work is refused at once (:class:`PoolBusyError`, which the
callers answer as "busy") instead of piling up with its request's payload.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class PoolBusyError(RuntimeError):
    """Every thread is busy and ``max_queued`` jobs already wait."""


class DaemonPool(Executor):
    """At most ``workers`` daemon threads named ``name-N``, started as work arrives, and at
    most ``max_queued`` jobs waiting for one."""

    def __init__(self, workers: int, name: str, max_queued: int = 64) -> None:
        if workers < 1 or max_queued < 0:
            raise ValueError("workers must be >= 1 and max_queued >= 0")
        self._workers = workers
        self._name = name
        self._max_queued = max_queued
        self._jobs: collections.deque[tuple[Future, Callable[..., Any], tuple, dict]]
        self._jobs = collections.deque()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for a job
        self._cond = threading.Condition()
        self._shutdown = False

    @property
    def queued(self) -> int:
        """Jobs waiting for a thread (cancelled ones included until they are dropped)."""
        return len(self._jobs)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        fut: Future = Future()
        with self._cond:
            if self._shutdown:
                raise RuntimeError(f"{self._name}: cannot submit after shutdown")
            # threads that would take a job at once: the idle ones and those not started yet
            free = self._idle + self._workers - len(self._threads)
            if len(self._jobs) - free >= self._max_queued:
                live = collections.deque(j for j in self._jobs if not j[0].cancelled())
                self._jobs = live
                if len(live) - free >= self._max_queued:
                    raise PoolBusyError(
                        f"{self._name}: {self._workers} threads busy and {len(live)} jobs waiting"
                    )
            self._jobs.append((fut, fn, args, kwargs))
            if self._idle == 0 and len(self._threads) < self._workers:
                t = threading.Thread(
                    target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(t)
                t.start()
            else:
                self._cond.notify()
        return fut

    def _run(self) -> None:
        while True:
            with self._cond:
                self._idle += 1
                while not self._jobs and not self._shutdown:
                    self._cond.wait()
                self._idle -= 1
                if not self._jobs:  # shut down, nothing left
                    return
                fut, fn, args, kwargs = self._jobs.popleft()
            if fut.set_running_or_notify_cancel():  # False: cancelled while queued
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:  # noqa: BLE001 - the caller's to read
                    fut.set_exception(e)
                else:
                    fut.set_result(result)
            del fut, fn, args, kwargs

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cond:
            self._shutdown = True
            threads = list(self._threads)
            if cancel_futures:
                while self._jobs:
                    self._jobs.popleft()[0].cancel()
            self._cond.notify_all()
        if wait:
            for t in threads:
                t.join()
