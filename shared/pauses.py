"""Time this process did not run: stopped (SIGSTOP, a debugger), its VM paused, or its host
starving it.

``time.monotonic`` goes on while a process is stopped, so every "no progress for N seconds"
check in it finds, on resume, N seconds that passed without it, and fails what was in fact
healthy: a worker declared its engine hung, a router its decode workers stuck, before the
messages that waited in the sockets meanwhile could be read. A :class:`PauseMeter` tells such
a pause from a stall it should see: a wake-up later than asked during which the process used
less CPU than the lateness (a stopped process uses none). It errs towards the stall: a late
wake-up during which the process's threads ran counts as little as they ran, so a busy event
loop or a thread holding the GIL is never taken for a pause.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: A pause shorter than this is scheduling noise: not logged, and not a resume (``PauseLog``).
NOTICEABLE_S = 1.0
#: At most one warning per this many seconds (a starved host may show a pause every second).
WARN_EVERY_S = 60.0


class PauseMeter:
    """Seconds paused between ticks that are meant to come every ``period_s``: the lateness
    beyond ``slack_s``, less the process CPU time used meanwhile. ``wall`` and ``cpu`` are the
    clocks (``time.monotonic``, ``time.process_time``; tests script them)."""

    def __init__(
        self,
        period_s: float,
        slack_s: float = 0.25,
        wall: Callable[[], float] = time.monotonic,
        cpu: Callable[[], float] = time.process_time,
    ) -> None:
        self.period_s = period_s
        self.slack_s = slack_s
        self._wall, self._cpu = wall, cpu
        self.reset()

    def reset(self) -> None:
        """Start measuring from now (the ticks begin)."""
        self._last = (self._wall(), self._cpu())

    def tick(self) -> float:
        """Seconds paused since the last tick (0 when on time or busy)."""
        now = (self._wall(), self._cpu())
        late = now[0] - self._last[0] - self.period_s
        used = now[1] - self._last[1]
        self._last = now
        return max(0.0, late - used) if late > self.slack_s else 0.0


class PauseLog:
    """The process's recent noticeable pauses, kept by a task that ticks a :class:`PauseMeter`
    every ``period_s`` (:meth:`run`). Checks tick it too (:meth:`paused_since`,
    :meth:`resumed_within`), so one made on resume, before that task ran again, sees the pause
    already: on resume every overdue timer fires at once, in no order one could rely on."""

    def __init__(self, period_s: float = 0.25, meter: PauseMeter | None = None) -> None:
        self.period_s = period_s
        self._meter = meter or PauseMeter(period_s)
        self._wall = self._meter._wall
        self._pauses: deque[tuple[float, float]] = deque(maxlen=32)  # (resumed at, seconds)
        self._warned_at: float | None = None
        self._unwarned = 0  # pauses since the last warning

    def check(self) -> float:
        """Tick the meter; record (and warn of, at most once per ``WARN_EVERY_S``) a
        noticeable pause that ended now. Returns the seconds paused since the last tick,
        noticeable or not."""
        paused = self._meter.tick()
        if paused >= NOTICEABLE_S:
            now = self._wall()
            self._pauses.append((now, paused))
            self._unwarned += 1
            if self._warned_at is None or now - self._warned_at >= WARN_EVERY_S:
                logger.warning(
                    "this process did not run for %.1f s (stopped, its machine paused, or "
                    "starved of CPU)%s; timeouts that ran meanwhile are not held against its "
                    "peers",
                    paused,
                    f" ({self._unwarned - 1} more such pauses since the last warning)"
                    if self._unwarned > 1
                    else "",
                )
                self._warned_at, self._unwarned = now, 0
        return paused

    def paused_since(self, t0: float) -> float:
        """Seconds of noticeable pauses after ``t0`` (``time.monotonic``)."""
        self.check()
        return sum(min(s, at - t0) for at, s in self._pauses if at > t0)

    def resumed_within(self, seconds: float) -> bool:
        """Whether a noticeable pause ended less than ``seconds`` ago."""
        self.check()
        return bool(self._pauses) and self._wall() - self._pauses[-1][0] < seconds

    async def run(self) -> None:
        """Tick every ``period_s`` until cancelled."""
        self._meter.reset()
        while True:
            await asyncio.sleep(self.period_s)
            self.check()
