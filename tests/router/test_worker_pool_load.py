"""WorkerPool's view of a prefill worker's queue between lagging load reports (unit tier)."""

from __future__ import annotations

import asyncio

from router.workers import WorkerPool
from shared.directory import WorkerInfo, WorkerLoad, WorkerRecord

INFO = WorkerInfo(
    worker_id="p0", role="prefill", model="m", grpc="127.0.0.1:9", block_size=16, num_blocks=64
)


class Registry:
    """A DirectoryReader that lists one prefill worker with the load last "heartbeated"."""

    def __init__(self) -> None:
        self.seq = 0
        self.load = WorkerLoad(64, 0, 0)

    def heartbeat(self, running: int, waiting: int = 0) -> None:
        self.seq += 1
        self.load = WorkerLoad(64, running, waiting)

    async def live_workers(self) -> list[WorkerRecord]:
        return [WorkerRecord(INFO, self.load, "g1", self.seq)]


def queue(pool: WorkerPool) -> tuple[int, int]:
    (record,) = pool.healthy("prefill")
    return pool.prefill_queue(record)


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
