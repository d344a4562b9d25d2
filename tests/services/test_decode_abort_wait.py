"""An ending request waits a bounded time for the engine's abort. The wait was a
``wait_for`` on the command's future: when it timed out (an engine turn longer than the bound)
it cancelled the command before it ran, and the request generated on for nobody until its
``max_tokens``. The command now stays queued and runs when the engine gets to it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from decode_service.server import _Flight
from shared.engine.sampling_params import SamplingParams
from shared.proto import pdserve_pb2 as pb
from tests.services.inprocess_worker import loopback_servicer
from tests.services.test_decode_review3_deadline import runtime  # noqa: F401

pytestmark = pytest.mark.integration


def test_an_abort_that_outwaits_its_bound_still_runs(runtime):  # noqa: F811
    rt = runtime

    async def scenario():
        servicer, receiver = loopback_servicer(rt)
        servicer.abort_wait_s = 0.2
        sp = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        eid = "r@1"
        await asyncio.wrap_future(rt.loop.submit(lambda e: e.add_request(eid, [1, 2, 3], sp)))
        over = threading.Event()
        stalling = threading.Event()

        def stall(e):
            stalling.set()
            over.wait(30)

        rt.loop.submit(stall)
        try:
            assert await asyncio.to_thread(stalling.wait, 30)
            flight = _Flight(pb.GenerateRequest(request_id="r"), eid, 1, asyncio.Queue())
            await asyncio.wait_for(servicer._abort(eid, flight), 20)  # gives up waiting
            assert not over.is_set()
        finally:
            over.set()
        # commands run in order: the abort, if still queued, runs before this one
        left = await asyncio.wrap_future(rt.loop.submit(lambda e: len(e.parents)))
        receiver.close()
        return left

    assert asyncio.run(scenario()) == 0
