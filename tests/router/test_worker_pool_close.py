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
