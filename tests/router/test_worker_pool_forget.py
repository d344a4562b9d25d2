"""The worker pool forgets worker ids the registry stopped listing, once they have been gone
``FORGET_AFTER_S`` with nothing in flight. Found by review: every id that ever served stayed in
seven per-worker tables for the router's lifetime (ids are per process by default, or per pod:
1,000 worker generations left 1,000-2,000 entries in each)."""

from __future__ import annotations

import asyncio

import pytest

import router.workers as workers
from router.workers import WorkerPool
from shared.directory import ROLE_DECODE, ROLE_PREFILL, WorkerInfo, WorkerLoad, WorkerRecord

pytestmark = pytest.mark.unit

TABLES = (
    "_restarts",
    "_cooldown",
    "_cooldown_gen",
    "_inflight",
    "_inflight_by_address",
    "_left",
    "_left_at_refresh",
    "_left_before_report",
    "_wrong_model",
)


class _Reader:
    def __init__(self) -> None:
        self.records: list[WorkerRecord] = []

    async def live_workers(self) -> list[WorkerRecord]:
        return list(self.records)


def _record(wid: str, role: str, port: int, gen: str = "g1", model: str = "tiny") -> WorkerRecord:
    info = WorkerInfo(wid, role, model, f"127.0.0.1:{port}", 16, 64)
    return WorkerRecord(info, WorkerLoad(64, 0, 0), gen, 1)


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """The pool's ``time.monotonic``, which the test moves by hand."""
    now = [1000.0]
    monkeypatch.setattr(workers.time, "monotonic", lambda: now[0])
    return now


def _sizes(pool: WorkerPool) -> dict[str, int]:
    return {t: len(getattr(pool, t)) for t in TABLES}


def test_departed_worker_ids_are_forgotten_after_the_bound(clock):

    async def scenario():
        reader = _Reader()
        pool = WorkerPool(model="tiny", reader=reader)
        try:
            held = None
            for i in range(50):  # 50 generations of a decode and a prefill worker
                d = _record(f"decode-{i}", ROLE_DECODE, 20000 + i)
                p = _record(f"prefill-{i}", ROLE_PREFILL, 30000 + i)
                odd = _record(f"other-{i}", ROLE_DECODE, 40000 + i, model="another")
                reader.records = [d, p, odd]
                await pool.refresh()
                for _ in range(3):
                    pool.acquire(d)
                    pool.release(d)
                if i == 0:
                    pool.acquire(d)  # a stream still running on the first one
                    held = d
                pool.mark_failed(d.worker_id, "crashed")
                reader.records = [_record(d.worker_id, ROLE_DECODE, 20000 + i, "g2"), p, odd]
                await pool.refresh()
            grown = _sizes(pool)
            assert grown["_restarts"] == 50 and grown["_wrong_model"] == 50  # kept, for now
            clock[0] += workers.FORGET_AFTER_S - 1
            await pool.refresh()
            assert _sizes(pool)["_restarts"] == 50  # not yet: a worker may come back
            clock[0] += 2
            await pool.refresh()
            assert _sizes(pool)["_restarts"] == 2  # the listed one and the busy one stay
            reader.records = []  # the last ones leave too (kept through the registry's grace)
            for _ in range(3):  # the grace ends, then they are gone for the bound
                clock[0] += pool.registry_grace_s + workers.FORGET_AFTER_S + 1
                await pool.refresh()
            left = _sizes(pool)
            # only the worker with a stream in flight keeps its entries
            assert left["_restarts"] == 1 and left["_inflight"] == 1, left
            assert left["_wrong_model"] == 0 and left["_cooldown"] == 0, left
            assert pool.inflight("decode-0") == 1 and pool.restarts("decode-0") == 1
            assert held is not None
            pool.release(held)
            await pool.refresh()
            assert _sizes(pool) == {t: 0 for t in TABLES}, _sizes(pool)
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_worker_back_within_the_bound_keeps_its_restart_count(clock):

    async def scenario():
        reader = _Reader()
        pool = WorkerPool(model="tiny", reader=reader)
        try:
            reader.records = [_record("d", ROLE_DECODE, 20000, "g1")]
            await pool.refresh()
            reader.records = [_record("d", ROLE_DECODE, 20000, "g2")]
            await pool.refresh()
            assert pool.restarts("d") == 1
            reader.records = []  # its lease lapsed while it restarted
            await pool.refresh()
            clock[0] += 30
            await pool.refresh()
            assert pool.restarts("d") == 1
        finally:
            await pool.close()

    asyncio.run(scenario())
