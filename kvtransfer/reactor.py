"""The I/O thread of a sender or receiver: callbacks, timers and transport progress.

Every transfer state machine and every UCX call runs on this one thread, so they need no
locks; other threads (the engine loop, asyncio users) only enqueue work with
:meth:`Reactor.call_soon_threadsafe`, which never blocks on I/O.

Loop, per iteration: run queued callbacks, run due timers, let the transport make progress.
When nothing happened it keeps polling for ``spin_s`` seconds (lower latency, burns a core),
then arms the transport's event fd and sleeps in ``epoll`` until the transport has an event,
another thread enqueues work, or the next timer is due.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

logger = logging.getLogger("kvtransfer")

_MAX_SLEEP_S = 0.5


class ProgressSource(Protocol):
    """A transport that the reactor drives (the UCX worker)."""

    def progress(self) -> bool:
        """Advance communication and run completions; True when anything happened."""

    def arm(self) -> bool:
        """Prepare to sleep; True when it is safe to wait for :meth:`fileno` to become readable."""

    def fileno(self) -> int:
        """File descriptor that becomes readable when the transport has events; -1 for a
        source that is only polled (its :meth:`arm` bounds the sleep with a timer)."""


class TimerHandle:
    """A callback scheduled with :meth:`Reactor.call_later`; :meth:`cancel` is idempotent."""

    __slots__ = ("args", "cancelled", "fn", "seq", "when")

    def __init__(self, when: float, seq: int, fn: Callable[..., Any], args: tuple[Any, ...]):
        self.when, self.seq, self.fn, self.args, self.cancelled = when, seq, fn, args, False

    def cancel(self) -> None:
        self.cancelled = True

    def __lt__(self, other: TimerHandle) -> bool:
        return (self.when, self.seq) < (other.when, other.seq)


class Reactor:
    """One daemon thread running callbacks, timers and an optional :class:`ProgressSource`."""

    def __init__(self, name: str, *, spin_s: float = 0.0):
        self.name = name
        self.spin_s = spin_s
        self._ready: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = (
            collections.deque()
        )
        self._timers: list[TimerHandle] = []
        self._seq = itertools.count()
        self._sources: list[ProgressSource] = []
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._sleeping = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"kvtransfer-{name}", daemon=True)

    # ---- control from any thread -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def in_thread(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the reactor thread soon; safe and non-blocking from any thread."""
        self._ready.append((fn, args))
        if self._sleeping:
            self._wake()

    def run_teardown(self, fn: Callable[[], None], timeout: float, what: str) -> None:
        """A transport's close: ``fn()`` on the reactor thread while the reactor runs, bounded
        by ``timeout``; a teardown that times out or finds the reactor gone is logged."""
        if not self.running:
            return
        try:
            self.run_sync(fn, timeout=timeout)
        except (TimeoutError, RuntimeError) as e:
            logger.warning("kvtransfer: %s teardown: %s", what, e)

    def run_sync(self, fn: Callable[..., Any], *args: Any, timeout: float = 10.0) -> Any:
        """Run ``fn(*args)`` on the reactor thread and return its result (or raise its error).

        Raises ``TimeoutError`` if it has not run within ``timeout`` seconds.
        """
        if self.in_thread:
            return fn(*args)
        if not self._thread.is_alive():
            raise RuntimeError(f"reactor {self.name} is not running")
        fut: Future[Any] = Future()

        def call() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001  (re-raised in the caller)
                    fut.set_exception(e)

        self.call_soon_threadsafe(call)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise TimeoutError(
                f"reactor {self.name} did not run {fn.__name__} within {timeout}s"
            ) from None

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop and join the thread (at most ``timeout`` seconds); idempotent."""
        self._stopping = True
        self._wake()
        if self._thread.is_alive() and not self.in_thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("reactor %s did not stop within %.1fs", self.name, timeout)
                return
        if not self._thread.is_alive():
            self._close_fds()

    # ---- reactor-thread API ------------------------------------------------------------

    def add_source(self, source: ProgressSource) -> None:
        """Drive ``source`` from this reactor (call on the reactor thread or before start)."""
        self._sources.append(source)
        if source.fileno() >= 0:
            self._epoll.register(source.fileno(), select.EPOLLIN)

    def remove_source(self, source: ProgressSource) -> None:
        if source in self._sources:
            self._sources.remove(source)
            if source.fileno() < 0:
                return
            try:
                self._epoll.unregister(source.fileno())
            except (OSError, ValueError):
                pass

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Reactor thread only: run ``fn(*args)`` after the current callback."""
        self._ready.append((fn, args))

    def call_later(self, delay: float, fn: Callable[..., Any], *args: Any) -> TimerHandle:
        """Reactor thread only: run ``fn(*args)`` after ``delay`` seconds unless cancelled."""
        handle = TimerHandle(time.monotonic() + max(0.0, delay), next(self._seq), fn, args)
        heapq.heappush(self._timers, handle)
        return handle

    # ---- loop ------------------------------------------------------------------------

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\x01")
        except (BlockingIOError, OSError):
            pass  # pipe full (a wake-up is already pending) or closed during shutdown

    def _call(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            fn(*args)
        except Exception:
            logger.exception("kvtransfer reactor %s: callback %r failed", self.name, fn)

    def _run_timers(self, now: float) -> bool:
        ran = False
        while self._timers and self._timers[0].when <= now:
            t = heapq.heappop(self._timers)
            if not t.cancelled:
                ran = True
                self._call(t.fn, t.args)
        return ran

    def _progress(self) -> bool:
        made = False
        for source in self._sources:
            try:
                made = source.progress() or made
            except Exception:
                logger.exception("kvtransfer reactor %s: transport progress failed", self.name)
        return made

    def _sleep(self, now: float) -> None:
        self._sleeping = True
        try:
            if self._ready or self._stopping:
                return
            for source in self._sources:
                if not source.arm():
                    return  # events pending: progress again instead of sleeping
            while self._timers and self._timers[0].cancelled:
                heapq.heappop(self._timers)
            timeout = _MAX_SLEEP_S
            if self._timers:
                timeout = min(timeout, max(0.0, self._timers[0].when - now))
            for fd, _ in self._epoll.poll(timeout):
                if fd == self._wake_r:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
        finally:
            self._sleeping = False

    def _run(self) -> None:
        spin_until = 0.0
        while not self._stopping:
            active = False
            for _ in range(len(self._ready)):
                fn, args = self._ready.popleft()
                self._call(fn, args)
                active = True
            now = time.monotonic()
            active = self._run_timers(now) or active
            active = self._progress() or active
            if active or self._ready:
                spin_until = now + self.spin_s
                continue
            if now < spin_until:
                continue
            self._sleep(now)
        # Run what is already queued (teardown callbacks) before the thread ends.
        while self._ready:
            fn, args = self._ready.popleft()
            self._call(fn, args)

    def _close_fds(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1
        try:
            self._epoll.close()
        except OSError:
            pass
