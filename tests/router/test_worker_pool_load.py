"""WorkerPool's view of a worker's queue between lagging load reports (unit tier)."""

from __future__ import annotations

import asyncio

from router.policy import Candidate, PolicyConfig, choose_route
from router.workers import WorkerPool
from shared.directory import WorkerInfo, WorkerLoad, WorkerRecord

INFO = WorkerInfo(
    worker_id="p0", role="prefill", model="m", grpc="127.0.0.1:9", block_size=16, num_blocks=64
)
D_INFO = WorkerInfo(
    worker_id="d0", role="decode", model="m", grpc="127.0.0.1:8", block_size=16, num_blocks=64
)


class Registry:
    """A DirectoryReader that lists one worker with the load last "heartbeated"."""

    def __init__(self, info: WorkerInfo = INFO) -> None:
        self.info = info
        self.gen = "g1"
        self.seq = 0
        self.load = WorkerLoad(64, 0, 0)

    def heartbeat(self, running: int, waiting: int = 0) -> None:
        self.seq += 1
        self.load = WorkerLoad(64, running, waiting)

    async def live_workers(self) -> list[WorkerRecord]:
        return [WorkerRecord(self.info, self.load, self.gen, self.seq)]


def queue(pool: WorkerPool, role: str = "prefill") -> tuple[int, int]:
    (record,) = pool.healthy(role)
    return pool.reported_queue(record)


def test_a_prefill_that_finished_after_the_report_does_not_count_as_running():
    async def main() -> None:
        reg = Registry()
        pool = WorkerPool(model="m", reader=reg)  # type: ignore[arg-type]
        reg.heartbeat(0)
        await pool.refresh()
        assert queue(pool) == (0, 0)
        # a prompt is sent; the worker reports it running; the router then sees its first
        # token, before the next report: it did count as busy here (the next prompt went to
        # the decode worker as if this one were still prefilling)
        pool.add_backlog("p0", 150)
        reg.heartbeat(1)
        await pool.refresh()
        assert queue(pool) == (1, 0)
        pool.add_backlog("p0", -150)
        assert queue(pool) == (0, 0)
        await pool.refresh()  # the same report again
        assert queue(pool) == (0, 0)
        # the report was taken while it ran but read after it finished
        pool.add_backlog("p0", 200)
        pool.add_backlog("p0", -200)
        reg.heartbeat(1)
        await pool.refresh()
        assert queue(pool) == (0, 0)
        # fresh reports count in full again: work from other routers shows
        reg.heartbeat(0)
        await pool.refresh()
        reg.heartbeat(2, 3)
        await pool.refresh()
        assert queue(pool) == (2, 3)
        pool.add_backlog("p0", 10)
        pool.add_backlog("p0", -10)  # one of them was this router's
        assert queue(pool) == (2, 2)

    asyncio.run(main())


def test_a_stream_that_ended_after_the_report_does_not_count_on_the_decode_worker():
    """A one-at-a-time client: each request starts right after the last one's stream ended,
    while the decode worker's latest report (taken during that stream) still says it runs
    one. It counted as busy, so the idle decode worker's own prefill of a short prompt
    (``policy.idle``) was skipped for a prefill worker's: measured on a 1P + 1D cluster,
    5 of 16 such requests went local (TTFT 12-15 ms), the other 11 through P (19-25 ms)."""

    async def main() -> None:
        reg = Registry(D_INFO)
        pool = WorkerPool(model="m", reader=reg)  # type: ignore[arg-type]
        reg.heartbeat(0)
        await pool.refresh()
        (record,) = pool.healthy("decode")
        # a request on D (local prefill); D reports it running; then its stream ends
        pool.acquire(record)
        pool.add_backlog("d0", 200)
        reg.heartbeat(1)
        await pool.refresh()
        assert queue(pool, "decode") == (1, 0)
        pool.add_backlog("d0", -200)  # its first token: still running on D
        pool.add_decoding("d0", 1)
        assert queue(pool, "decode") == (1, 0)
        pool.add_decoding("d0", -1)
        pool.release(record)  # the stream ended
        assert queue(pool, "decode") == (0, 0)
        await pool.refresh()  # the same report again
        assert queue(pool, "decode") == (0, 0)
        # the next report was taken while a second request ran, and read after it ended
        pool.acquire(record)
        pool.release(record)
        reg.heartbeat(1)
        await pool.refresh()
        (record,) = pool.healthy("decode")
        running, waiting = queue(pool, "decode")
        assert (running, waiting) == (0, 0)
        d = Candidate("d0", "a", 0, running, waiting, 64, 16, pool.inflight("d0"), 0, 0)
        p = Candidate("p0", "b", 0, 0, 0, 64, 16)
        assert choose_route(256, [d], [p], PolicyConfig()).path == "local"
        # fresh reports count in full again (another router's work)
        reg.heartbeat(0)
        await pool.refresh()
        reg.heartbeat(2, 1)
        await pool.refresh()
        assert queue(pool, "decode") == (2, 1)

    asyncio.run(main())


def test_a_restarted_worker_is_routable_without_its_old_incarnations_cooldown():
    """Calls routed to a dead decode worker while its lease lived on put its id in cooldown;
    the restarted worker (same id, a new generation) was then kept out of routing for up to
    ``--worker-cooldown`` after it registered: 503s when it is the only decode worker."""

    async def main() -> None:
        reg = Registry(D_INFO)
        pool = WorkerPool(model="m", reader=reg, cooldown_s=60.0)  # type: ignore[arg-type]
        reg.heartbeat(0)
        await pool.refresh()
        (record,) = pool.healthy("decode")
        pool.mark_failed("d0", "UNAVAILABLE", generation=record.generation)
        assert pool.healthy("decode") == []
        reg.heartbeat(0)  # the same incarnation reports again: still cooling down
        await pool.refresh()
        assert pool.healthy("decode") == []
        reg.gen = "g2"  # restarted under the same id
        reg.heartbeat(0)
        await pool.refresh()
        assert [r.generation for r in pool.healthy("decode")] == ["g2"]
        # a failure of the new incarnation cools it down as before
        pool.mark_failed("d0", "UNAVAILABLE", generation="g2")
        await pool.refresh()
        assert pool.healthy("decode") == []

    asyncio.run(main())
