"""A remote prefill that is cancelled before its task ever ran still drops the pin on its
blocks. (An asyncio task cancelled before its first step never enters its coroutine, so a pin
released in the coroutine's ``finally`` stayed forever: the 44 blocks of an aborted 700-token
request held until the worker restarted. Seen as the flaky
``test_decode_abort_whole_ends_the_stream_normally_and_leaks_nothing[prefilling]``.)"""

from __future__ import annotations

import asyncio

import pytest

from decode_service.server import _Flight
from shared.directory import EmbeddedRedis
from shared.proto import pdserve_pb2 as pb
from tests.services.inprocess_worker import decode_runtime

pytestmark = pytest.mark.integration


def test_a_remote_prefill_cancelled_before_it_ran_drops_its_pin(tiny_llama, tmp_path):
    with EmbeddedRedis() as server:
        rt, servicer = decode_runtime(tiny_llama, server.url, "pin-0", tmp_path / "r.json", "pin:")
        rt.loop.start()
        try:

            async def scenario() -> int:
                def reserve(e):  # blocks held as admission holds them, pinned as D pins them
                    blocks = e.kv.pool.get_new_blocks(3)
                    ids = [b.block_id for b in blocks]
                    return ids, e.kv.pin(ids)

                ids, pin_id = await asyncio.wrap_future(rt.loop.submit(reserve))
                eid = "r@1"
                flight = _Flight(
                    pb.GenerateRequest(request_id="r", prefill_address="127.0.0.1:9"),
                    eid,
                    1,
                    asyncio.Queue(),
                )
                servicer.flights["r"] = flight
                servicer.by_engine_id[eid] = flight
                servicer._start_remote(eid, 0, ids, pin_id)  # the task exists, has not run
                assert flight.remote_task is not None and not flight.remote_task.done()
                flight.aborting = True
                await servicer._abort(eid, flight)  # cancels it before its first step
                for _ in range(100):
                    pinned = await asyncio.wrap_future(
                        rt.loop.submit(lambda e: e.kv.num_pinned_blocks)
                    )
                    if pinned == 0:
                        break
                    await asyncio.sleep(0.02)
                return pinned

            assert asyncio.run(scenario()) == 0
        finally:
            rt.loop.stop()
            servicer.receiver.close()
