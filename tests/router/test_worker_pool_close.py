"""WorkerPool.close ends its refresh loop at once, even when the cancellation lands as a Redis
write completes (Python 3.11's asyncio.wait_for, used by redis-py for socket writes, then
swallows it): before, the loop went on refreshing and close() waited until the router's
5 s clean-up timeout cancelled it, so every such router took 5 s longer to stop."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from router.workers import WorkerPool
from shared.directory import DirectoryKeys, EmbeddedRedis
from shared.directory.reader import DirectoryReader
from shared.directory.records import connect_async

pytestmark = pytest.mark.integration


def test_close_ends_the_refresh_loop_at_once():
    async def main(url: str) -> list[float]:
        slow = []
        rng = random.Random(0)
        for _ in range(30):
            client = connect_async(url)
            pool = WorkerPool(
                model="tiny",
                reader=DirectoryReader(client, DirectoryKeys("pc:")),
                refresh_interval_s=0.0005,  # nearly always inside a Redis call
            )
            await pool.start()
            await asyncio.sleep(rng.uniform(0.001, 0.02))
            t0 = time.monotonic()
            try:
                async with asyncio.timeout(3):
                    await pool.close()
            except TimeoutError:
                pass
            slow += [time.monotonic() - t0] if time.monotonic() - t0 > 1.0 else []
            await client.aclose()
        return slow

    with EmbeddedRedis() as server:
        assert asyncio.run(main(server.url)) == []


@pytest.mark.unit
def test_the_directory_janitor_stops_when_a_redis_call_swallowed_its_cancel():
    # the same swallowed cancel in the router's directory sweep: it went on sweeping, and the
    # router's clean-up waited its whole bound
    from types import SimpleNamespace

    from router.server import _sweep

    class Reader:
        def __init__(self) -> None:
            self.calls = 0
            self.sweeping = asyncio.Event()

        async def sweep(self, name, cursor, count):
            self.calls += 1
            self.sweeping.set()
            if self.calls > 1:
                await asyncio.sleep(0.2)  # a later call: cancellable
                return 7, 0
            try:
                await asyncio.sleep(0.2)
            except asyncio.CancelledError:
                pass  # what Python 3.11's wait_for does when the write completes meanwhile
            return 7, 0  # a pass in progress: the janitor comes back in 0.05 s

    async def main() -> tuple[bool, int]:
        reader = Reader()
        config = SimpleNamespace(name="tiny", directory_sweep_interval_s=0.0)
        task = asyncio.create_task(_sweep(reader, config))
        await reader.sweeping.wait()
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=2.0)
        task.cancel()  # (before the fix: still running; end it for the test's loop)
        await asyncio.gather(task, return_exceptions=True)
        return bool(done), reader.calls

    stopped, calls = asyncio.run(main())
    assert stopped and calls == 1
