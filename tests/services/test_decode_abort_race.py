"""The decode worker's abort-during-admission race, driven in process with a fixed ordering.

D admits a remote-prefill request in an engine step and hands it to the event loop
(``_start_remote``); if the client cancels in that window, the abort frees the reserved
blocks, and before the fix ``_start_remote`` then still posted receives into them and called
Prefill, so P's bytes landed in blocks that another request may own (and hash into the prefix
cache). The gate below opens the window deterministically: ``_start_remote`` runs exactly
while the abort is in progress. Now no receive is posted, no Prefill call is made, and the
blocks stay pinned until nothing can touch them. (This test fails on the code before the fix:
a Prefill call and a posted receive appear for the aborted request.)
"""

from __future__ import annotations

import asyncio

import pytest

from decode_service.server import DecodeServicer
from kvtransfer import LoopbackNetwork, create_receiver
from shared.proto import pdserve_pb2 as pb
from tests.services.inprocess_worker import RejectingContext, running_runtime


class _RecordingPrefill:
    def __init__(self) -> None:
        self.calls: list[pb.PrefillRequest] = []

    async def Prefill(self, request, timeout=None):
        self.calls.append(request)
        await asyncio.sleep(3600)


@pytest.fixture
def runtime(tiny_llama):
    with running_runtime(tiny_llama, "decode") as rt:
        yield rt


def test_abort_while_the_remote_prefill_starts_posts_nothing_and_leaks_nothing(runtime):
    async def scenario():
        rt = runtime
        net = LoopbackNetwork()
        receiver = create_receiver(
            "loopback", rt.engine.runner.kv_cache, rt.kv_geometry(), network=net
        )
        servicer = DecodeServicer(rt, receiver, prefill_timeout_s=5.0)
        prefill = _RecordingPrefill()
        servicer._stub = lambda address: prefill
        posted: list[str] = []
        real_expect = receiver.expect

        def expect(transfer_id, block_ids, timeout_s):
            posted.append(transfer_id)
            return real_expect(transfer_id, block_ids, timeout_s)

        receiver.expect = expect
        admitted = asyncio.Event()
        gate = asyncio.Event()
        real_start = servicer._start_remote

        def gated_start(*args):  # the engine step admitted it; hold the hand-over at the gate
            admitted.set()

            async def later():
                await gate.wait()
                real_start(*args)

            asyncio.ensure_future(later())

        servicer._start_remote = gated_start
        real_abort = servicer._abort

        async def abort(*args):  # the window: the hand-over runs while the abort is under way
            gate.set()
            await real_abort(*args)

        servicer._abort = abort
        req = pb.GenerateRequest(
            request_id="r1",
            prompt_token_ids=list(range(5, 85)),
            sampling=pb.SamplingParams(temperature=0, max_tokens=4),
            prefill_address="127.0.0.1:9",
        )
        stream = servicer.Generate(req, RejectingContext())
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.wait_for(admitted.wait(), 10)
        first.cancel()  # the client goes away
        with pytest.raises(asyncio.CancelledError):
            await first
        await stream.aclose()
        for _ in range(20):  # let every callback and task run
            await asyncio.sleep(0.05)
        try:
            assert posted == [], "a receive was posted for an aborted request"
            assert prefill.calls == [], "Prefill was called for an aborted request"
            pinned, free, total = await asyncio.wrap_future(
                rt.loop.submit(
                    lambda e: (e.kv.num_pinned_blocks, e.kv.pool.num_free_blocks, e.num_blocks)
                )
            )
            await asyncio.wrap_future(rt.loop.submit(lambda e: e.check_integrity()))
            assert pinned == 0 and free == total, f"{pinned} still pinned, {total - free} in use"
        finally:
            receiver.close()

    asyncio.run(scenario())
