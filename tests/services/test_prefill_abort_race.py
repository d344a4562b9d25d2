"""The prefill worker's cancel-during-admission race, driven in process with a fixed ordering.

``Prefill`` hands ``add_request`` to the engine thread and awaits it. When the decode worker
cancels the call (its client left) while the engine thread is inside that command, the
cancelled await cannot stop it: the request is admitted all the same. Before the fix the
clean-up aborted the request only if the await had returned, so the admitted request ran on,
its finished blocks were pinned for a sender that no sink collected any more, and the worker
held them for ever (CI saw it as "prefill to release every block" timing out in
``test_decode_abort_whole_ends_the_stream_normally_and_leaks_nothing[prefilling]``). The gate
below holds the engine thread inside ``add_request`` while the call is cancelled; now the
request is aborted and every block comes back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import numpy as np
import pytest

from kvtransfer import LoopbackNetwork, create_receiver, create_sender
from prefill_service.server import PrefillServicer
from shared.proto import pdserve_pb2 as pb
from tests.services.inprocess_worker import RejectingContext, running_runtime


@pytest.fixture
def runtime(tiny_llama):
    with running_runtime(tiny_llama, "prefill") as rt:
        yield rt


@pytest.mark.parametrize("release", ["before_resume", "after_cancel"])
def test_cancel_while_the_engine_admits_the_prompt_leaks_nothing(runtime, release):
    """``after_cancel``: the engine thread finishes ``add_request`` after the call is cancelled
    (the concurrent future could not be cancelled). ``before_resume``: it finishes first, and
    the call is cancelled before the coroutine resumes from its await."""

    async def scenario():
        rt = runtime
        net = LoopbackNetwork()
        geometry = rt.kv_geometry()
        sender = create_sender("loopback", rt.engine.runner.transfer_pool, geometry, network=net)
        dst = np.zeros(64 * geometry.block_bytes, dtype=np.uint8)
        receiver = create_receiver("loopback", dst, geometry, network=net)
        servicer = PrefillServicer(rt, sender, transfer_timeout_s=5.0)
        entered, gate = threading.Event(), threading.Event()
        real_add = rt.engine.add_request

        def gated_add(*args, **kwargs):  # engine thread: hold the admission at the gate
            entered.set()
            assert gate.wait(10), "the test never opened the gate"
            return real_add(*args, **kwargs)

        rt.engine.add_request = gated_add
        submitted = []  # the futures of the commands handed to the engine thread
        real_submit = rt.loop.submit

        def submit(fn):
            fut = real_submit(fn)
            submitted.append(fut)
            return fut

        rt.loop.submit = submit
        prompt = list(range(5, 85))  # 5 blocks of 16
        dst_blocks = list(range(10, 15))
        receive = receiver.expect("t1", dst_blocks, timeout_s=5.0)
        req = pb.PrefillRequest(
            request_id="r1",
            prompt_token_ids=prompt,
            sampling=pb.SamplingParams(temperature=0, max_tokens=4),
            decode_kv_address=receiver.address,
            decode_worker_id="d0",
            first_block_index=0,
            dst_block_ids=dst_blocks,
            transfer_id="t1",
        )
        call = asyncio.ensure_future(servicer.Prefill(req, RejectingContext()))
        assert await asyncio.to_thread(entered.wait, 10), "add_request never ran"
        if release == "before_resume":
            admitted = submitted[-1]
            gate.set()
            # block this loop until the engine thread has set the result: its hand-back to
            # the loop stays queued, so the cancel lands before the coroutine resumes
            concurrent.futures.wait([admitted], timeout=10)
            assert admitted.done() and admitted.exception() is None
        call.cancel()
        if release == "after_cancel":
            await asyncio.sleep(0)  # the cancel reaches the await first
            gate.set()
        with pytest.raises(asyncio.CancelledError):
            await call

        def settled(e):
            return (
                not e.has_unfinished_requests(),
                e.kv.num_pinned_blocks,
                e.kv.pool.num_free_blocks,
                e.num_blocks,
            )

        try:
            state = None
            for _ in range(100):  # the engine may prefill a step or two before the abort
                state = await asyncio.wrap_future(rt.loop.submit(settled))
                idle, pinned, free, total = state
                if idle and pinned == 0 and free == total and servicer.pending_sends == 0:
                    break
                await asyncio.sleep(0.05)
            idle, pinned, free, total = state
            assert idle, "the cancelled request still runs in the engine"
            assert pinned == 0 and free == total, f"{pinned} still pinned, {total - free} in use"
            assert servicer.pending_sends == 0
            await asyncio.wrap_future(rt.loop.submit(lambda e: e.check_integrity()))
        finally:
            receive.cancel()
            sender.close()
            receiver.close()

    asyncio.run(scenario())
