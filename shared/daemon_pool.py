"""An executor whose threads never hold up the process's exit.

For work that cannot be interrupted and may run long after whoever asked for it gave up: a
grammar compile past its bound, a chat template rendering past its request's deadline.
``concurrent.futures.ThreadPoolExecutor`` (and asyncio's default executor) joins its threads
when the interpreter exits, so a worker that should exit now (its engine died, SIGTERM) stayed
alive until such work ended; the threads here are daemons, abandoned at exit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class DaemonPool(Executor):
    """At most ``workers`` daemon threads named ``name-N``, started as work arrives."""

    def __init__(self, workers: int, name: str) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self._workers = workers
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple, dict] | None]
        self._jobs = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError(f"{self._name}: cannot submit after shutdown")
            self._jobs.put((fut, fn, args, kwargs))
            if self._idle:  # a waiting thread takes it
                self._idle -= 1
            elif len(self._threads) < self._workers:
                t = threading.Thread(
                    target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(t)
                t.start()
        return fut

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn, args, kwargs = job
            if fut.set_running_or_notify_cancel():  # False: cancelled while queued
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:  # noqa: BLE001 - the caller's to read
                    fut.set_exception(e)
                else:
                    fut.set_result(result)
            del job, fut, fn, args, kwargs
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
        for _ in threads:
            self._jobs.put(None)
        if wait:
            for t in threads:
                t.join()
