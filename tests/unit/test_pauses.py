"""A worker paused as a whole (SIGSTOP, a debugger, its VM paused) for longer than
``--engine-hang-timeout`` in the middle of an engine step is not hung: on resume the watcher
used to find the step "stalled" for the whole pause and declare a hang (NOT_SERVING, every
request in flight failed with UNAVAILABLE, a worker of several ranks past three times the
timeout exiting) before the step could finish. The watcher now takes off the time the process
did not run, seen from its own late wake-ups during which the process used no CPU; a late
wake-up during which the process's threads did run is not forgiven (it errs towards a hang).

The watcher (``shared.worker.service._watch_hang``) runs for real here; its clocks are scripted:
each watcher turn advances the wall and CPU clocks by one scripted step."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from shared.pauses import PauseLog, PauseMeter
from shared.worker import service

PERIOD = 0.5
LIMIT = 2.0  # --engine-hang-timeout


class _Clocks:
    """Wall and process-CPU clocks advanced one scripted step per watcher turn; after the
    script, each turn is one quiet period in which the engine finishes steps again."""

    def __init__(self, steps: list[tuple[float, float]]) -> None:
        self.wall = 0.0
        self.cpu = 0.0
        self.steps = list(steps)
        self.heartbeat = 0.0  # an engine step began at 0 and has not finished

    def advance(self) -> None:
        if self.steps:
            w, c = self.steps.pop(0)
        else:
            w, c = PERIOD, PERIOD
            self.heartbeat = self.wall + w  # the step finished: the loop shows life again
        self.wall += w
        self.cpu += c


class _Runtime:
    def __init__(self, clocks: _Clocks, world: int = 1) -> None:
        self.clocks = clocks
        self.args = SimpleNamespace(engine_hang_timeout=LIMIT)
        self.engine = SimpleNamespace(parallel_config=SimpleNamespace(world_size=world))
        self.loop = SimpleNamespace(stalled_for=self._stalled_for)
        self.transitions: list[bool] = []
        self.metrics = SimpleNamespace(hung=self.transitions.append)
        self.hung = False
        self.draining = False
        self.failed: list[str] = []
        self.on_hang = [self.failed.append]
        self.turns = 0

    def _stalled_for(self) -> float:
        stalled = self.clocks.wall - self.clocks.heartbeat
        self.clocks.advance()  # the next watcher turn's clocks
        self.turns += 1
        return stalled


class _Health:
    def __init__(self) -> None:
        self.statuses: list[int] = []

    def set(self, name, status) -> None:
        self.statuses.append(status)


def _watch(steps: list[tuple[float, float]], world: int = 1, turns: int = 30) -> _Runtime:
    clocks = _Clocks(steps)
    meter = PauseMeter(PERIOD, wall=lambda: clocks.wall, cpu=lambda: clocks.cpu)
    clocks.advance()  # the first turn's clocks
    rt = _Runtime(clocks, world)

    async def run() -> None:
        task = asyncio.ensure_future(
            service._watch_hang(rt, _Health(), 0.0, pauses=PauseLog(PERIOD, meter=meter))
        )
        while rt.turns < turns:
            await asyncio.sleep(0)
        task.cancel()

    asyncio.run(run())
    return rt


BUSY = (PERIOD, PERIOD)  # one period with the engine thread computing


def test_a_pause_longer_than_the_hang_timeout_in_the_middle_of_a_step_is_not_a_hang() -> None:
    # the step runs 1 s, the process is stopped 5 s (the watcher wakes 5 s late having used
    # no CPU), then the step needs 0.5 s more and the engine goes on
    rt = _watch([BUSY, BUSY, (PERIOD + 5.0, 0.0), BUSY])
    assert rt.transitions == [] and rt.failed == [] and not rt.hung


def test_pauses_inside_a_real_hang_do_not_hide_it() -> None:
    # stuck (no CPU, the watcher on time) for 1 s, paused 5 s, stuck 1.5 s more: 2.5 s of hang
    # outside the pause, past the 2 s timeout
    stuck = (PERIOD, 0.0)
    rt = _watch([stuck, stuck, (PERIOD + 5.0, 0.0), stuck, stuck, stuck], turns=6)
    assert rt.transitions == [True] and len(rt.failed) == 1 and rt.hung


def test_a_late_wake_up_while_the_process_ran_still_counts() -> None:
    # the watcher 5 s late while the process used 5 s of CPU (its threads ran, the event loop
    # did not get to the watcher): not a pause, so the stuck step is a hang
    rt = _watch([BUSY, BUSY, (PERIOD + 5.0, 5.0), BUSY])
    assert rt.transitions[0] is True and rt.failed


def test_a_worker_of_several_ranks_paused_past_three_timeouts_does_not_exit(monkeypatch) -> None:
    exits: list[int] = []
    monkeypatch.setattr(service.os, "_exit", exits.append)
    monkeypatch.setattr(service.logging, "shutdown", lambda: None)
    rt = _watch([BUSY, (PERIOD + 3 * LIMIT + 1.0, 0.0), BUSY], world=2)
    assert exits == [] and rt.transitions == []


@pytest.mark.parametrize(
    ("late", "used", "paused"),
    [(0.1, 0.0, 0.0), (3.0, 0.0, 3.0), (3.0, 1.0, 2.0), (3.0, 4.0, 0.0)],
    ids=["on-time", "stopped", "partly-ran", "busy"],
)
def test_pause_meter(late: float, used: float, paused: float) -> None:
    t = {"wall": 10.0, "cpu": 1.0}
    meter = PauseMeter(PERIOD, wall=lambda: t["wall"], cpu=lambda: t["cpu"])
    t["wall"] += PERIOD + late
    t["cpu"] += used
    assert meter.tick() == pytest.approx(paused)


def test_pause_log_keeps_noticeable_pauses_and_answers_for_a_window() -> None:
    from shared.pauses import NOTICEABLE_S, PauseLog

    t = {"wall": 100.0, "cpu": 5.0}
    log = PauseLog(
        period_s=PERIOD,
        meter=PauseMeter(PERIOD, wall=lambda: t["wall"], cpu=lambda: t["cpu"]),
    )

    def run(wall: float, cpu: float) -> None:
        t["wall"] += wall
        t["cpu"] += cpu
        log.check()

    run(PERIOD, 0.0)
    run(PERIOD + NOTICEABLE_S / 2, 0.0)  # too short to be a resume
    assert not log.resumed_within(60.0) and log.paused_since(0.0) == 0.0
    before = t["wall"]
    run(PERIOD + 4.0, 0.0)  # stopped 4 s
    assert log.resumed_within(1.0)
    assert log.paused_since(before) == pytest.approx(4.0)
    assert log.paused_since(t["wall"] - 1.0) == pytest.approx(1.0)  # only the part after t0
    assert log.paused_since(t["wall"]) == 0.0
    run(PERIOD + 4.0, 4.0)  # late, but the process ran: not a pause
    assert log.paused_since(before) == pytest.approx(4.0)
    assert not log.resumed_within(PERIOD + 3.9) and log.resumed_within(PERIOD + 4.1)


def test_the_stream_watchdog_forgives_the_routers_pause_without_spinning() -> None:
    """``router.dispatch._Watchdog`` (``--stall-timeout``) on a stream whose latest output came
    just before the router was paused for longer than the stall timeout: not a stall, and its
    timer is re-armed for the end of the stall timeout counted without the pause (it was
    re-armed for a time already past, so it ran on every loop turn: ~26,000 checks in 0.7 s);
    a stream that then stays silent for the stall timeout is failed."""
    import asyncio
    import time

    from router import dispatch
    from shared.pauses import PauseLog

    stall_s = 2.0
    checks: list[float] = []

    class Counting(dispatch._Watchdog):
        __slots__ = ()

        def _check(self) -> None:
            checks.append(time.monotonic())
            super()._check()

    class Call:
        cancelled_at: float | None = None

        def cancel(self) -> None:
            self.cancelled_at = time.monotonic()

    async def scenario() -> tuple[float, float, float | None]:
        pauses = PauseLog(period_s=0.05)
        ticker = asyncio.ensure_future(pauses.run())
        call = Call()
        dog = Counting(call, time.monotonic() + 60, stall_s, pauses)
        dog.first_output()
        await asyncio.sleep(0.2)
        time.sleep(stall_s + 0.5)  # the router is paused past the stall timeout
        resumed = time.monotonic()
        await asyncio.sleep(0.5)
        during = len([t for t in checks if t >= resumed])
        while call.cancelled_at is None and time.monotonic() - resumed < 5:
            await asyncio.sleep(0.05)
        dog.stop()
        ticker.cancel()
        return resumed, during, call.cancelled_at

    resumed, during, cancelled_at = asyncio.run(scenario())
    assert during <= 3, during  # re-armed once, not on every loop turn
    assert cancelled_at is not None  # the stream stayed silent: a stall after all
    # ... once the stall timeout has passed without the pause (0.2 s before it, ~1.8 s after)
    assert cancelled_at - resumed >= 1.0


def test_pause_log_warns_once_a_minute_at_most(caplog) -> None:
    """A starved host may show a pause every second: one warning, then one a minute with
    the count of those not logged."""
    import logging

    from shared.pauses import WARN_EVERY_S, PauseLog

    t = {"wall": 0.0, "cpu": 0.0}
    log = PauseLog(
        period_s=PERIOD, meter=PauseMeter(PERIOD, wall=lambda: t["wall"], cpu=lambda: t["cpu"])
    )
    with caplog.at_level(logging.WARNING, logger="shared.pauses"):
        for _ in range(int(WARN_EVERY_S / 2.0) + 1):  # a 1.5 s pause every 2 s
            t["wall"] += PERIOD + 1.5
            log.check()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert "more such pauses since the last warning" in warnings[1]


@pytest.mark.parametrize(
    ("kind", "excusable"),
    [("", True), ("engine", False), ("draining", False), ("stall", False)],
    ids=["no-word", "engine", "draining", "routers-stall-verdict"],
)
def test_only_a_call_that_broke_without_a_word_from_the_worker_may_be_a_pauses_doing(
    kind: str, excusable: bool
) -> None:
    """``router.dispatch``: of the UNAVAILABLE failures, only one without ``pdserve-failure``
    metadata (keepalive, a reset connection) may have been caused by the router's own pause;
    a worker that said why (its engine failed or hung, it is draining) or the router's stall
    verdict (which already leaves the pause out) is blamed as before."""
    import grpc

    from router import dispatch
    from shared.proto.failure import failure_metadata

    stream = dispatch.GenerationStream.__new__(dispatch.GenerationStream)
    stream.tokens = [[]]
    e = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*(failure_metadata(kind) if kind else ())),
        "broken",
    )
    err = stream._classify(e, got_output=False)
    assert isinstance(err, dispatch._Retryable)
    assert err.transport is excusable
