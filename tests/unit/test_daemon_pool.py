"""``DaemonPool``: an executor whose threads never hold up the process's exit (grammar
compiles past their bound; ``ThreadPoolExecutor``'s threads are joined at exit)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import CancelledError
from pathlib import Path

import pytest

from shared.daemon_pool import DaemonPool

pytestmark = pytest.mark.unit


def test_results_errors_and_the_thread_bound():
    pool = DaemonPool(2, "t")
    gate = threading.Event()
    names: list[str] = []

    def job(x):
        names.append(threading.current_thread().name)
        assert threading.current_thread().daemon
        gate.wait(10)
        if x == 3:
            raise ValueError("three")
        return x * 10

    futs = [pool.submit(job, i) for i in range(5)]
    deadline = time.monotonic() + 10
    while sum(f.running() for f in futs) < 2:
        assert time.monotonic() < deadline, futs
        time.sleep(0.001)
    assert len(pool._threads) == 2 and sum(f.running() for f in futs) == 2  # two at most
    gate.set()
    assert [f.result(10) for f in (futs[0], futs[1], futs[2], futs[4])] == [0, 10, 20, 40]
    with pytest.raises(ValueError, match="three"):
        futs[3].result(10)
    assert set(names) <= {"t-0", "t-1"}
    # idle threads are reused, not multiplied
    assert [pool.submit(lambda: 1).result(10) for _ in range(20)] == [1] * 20
    assert len(pool._threads) == 2
    pool.shutdown()


def test_a_job_cancelled_while_queued_never_runs():
    pool = DaemonPool(1, "t")
    gate = threading.Event()
    ran: list[int] = []
    busy = pool.submit(gate.wait, 10)
    queued = pool.submit(ran.append, 1)
    assert queued.cancel()
    gate.set()
    assert busy.result(10) is True
    pool.submit(lambda: None).result(10)  # after the cancelled one in the queue
    assert ran == []
    with pytest.raises(CancelledError):
        queued.result(0)
    pool.shutdown()


def test_a_job_that_never_ends_does_not_hold_up_the_exit():
    """With ``ThreadPoolExecutor`` this process waits for the job (here: for ever)."""
    code = (
        "import threading; from shared.daemon_pool import DaemonPool\n"
        "p = DaemonPool(1, 'stuck'); p.submit(threading.Event().wait)\n"
        "print('bye', flush=True)\n"
    )
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.stdout.strip() == "bye"
    assert time.monotonic() - t0 < 20


def test_a_full_queue_refuses_at_once_and_cancelled_jobs_free_their_places():
    """Found by review: while every thread was stuck (a template that loops for hours), each
    refused request left its job, and its payload, queued (2,000 requests: 25 MB)."""
    from shared.daemon_pool import PoolBusyError

    pool = DaemonPool(1, "t", max_queued=2)
    gate = threading.Event()
    stuck = pool.submit(gate.wait, 30)
    deadline = time.monotonic() + 10
    while not stuck.running():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    waiting = [pool.submit(lambda: 1), pool.submit(lambda: 2)]
    with pytest.raises(PoolBusyError):
        pool.submit(lambda: 3)
    for f in waiting:
        assert f.cancel()  # their callers gave up
    again = [pool.submit(lambda: 4), pool.submit(lambda: 5)]
    assert pool.queued == 2  # the cancelled ones were dropped, not counted
    gate.set()
    assert [f.result(10) for f in again] == [4, 5]
    pool.shutdown()
