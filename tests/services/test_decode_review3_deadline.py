"""A request's ``deadline_s`` counts from its arrival at the decode worker. Before, the deadline
timer was armed only once the engine had added the request, so a request waiting for admission
behind a long engine turn (a stalled engine), or for its grammar to compile, waited unbounded.
Now both waits are bounded by the deadline: the stream ends DEADLINE_EXCEEDED while the engine
is still busy, and the request, added meanwhile or not, leaves nothing behind in the engine or
in the servicer. Asserted on events (the stall is 6 s against a 0.5 s deadline), not timings."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from shared.proto import pdserve_pb2 as pb
from tests.services.inprocess_worker import collect, loopback_servicer, running_runtime

pytestmark = pytest.mark.integration

STALL_S = 6.0


@pytest.fixture
def runtime(tiny_llama):
    with running_runtime(tiny_llama, "decode") as rt:
        yield rt


async def _nothing_left(rt, servicer) -> None:
    def state(e):
        e.check_integrity()
        return len(e.parents), e.kv.num_pinned_blocks, e.num_blocks - e.kv.pool.num_free_blocks

    assert await asyncio.wrap_future(rt.loop.submit(state)) == (0, 0, 0)
    assert not servicer.flights and not servicer.by_engine_id
    assert not servicer.outputs.queues
    assert rt.inflight == 0


def _request(rid: str, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=[1, 2, 3, 4],
        sampling=pb.SamplingParams(max_tokens=4, temperature=0, **sampling),
        deadline_s=0.5,
    )


@pytest.mark.parametrize("added", [False, True], ids=["queued", "added-late"])
def test_the_deadline_bounds_the_wait_for_admission(runtime, added):
    """A long engine turn holds the add command: the stream ends DEADLINE_EXCEEDED before the
    turn ends. ``added-late``: the add was already running when the deadline passed (it
    completes afterwards); the request is aborted in the engine all the same."""
    rt = runtime

    async def scenario():
        servicer, receiver = loopback_servicer(rt)
        stalling = threading.Event()
        stall_over = threading.Event()  # set by the test: the stall may end
        stall_ended = threading.Event()  # set by the stall once it ended
        if added:  # the add command itself is slow: admitted, then the deadline is long past
            real_add = rt.engine.add_request

            def slow_add(*args, **kwargs):
                stalling.set()
                stall_over.wait(STALL_S)
                stall_ended.set()
                return real_add(*args, **kwargs)

            rt.engine.add_request = slow_add  # type: ignore[method-assign]
        else:

            def stall(e):
                stalling.set()
                stall_over.wait(STALL_S)
                stall_ended.set()

            rt.loop.submit(stall)
            assert await asyncio.to_thread(stalling.wait, 30)
        try:
            chunks, status = await asyncio.wait_for(collect(servicer, _request("r")), 30)
            stalled_still = not stall_ended.is_set()
            stall_over.set()
            assert stalling.is_set()
            assert status == grpc.StatusCode.DEADLINE_EXCEEDED and not chunks
            assert stalled_still, "the stream waited for the engine's turn to end"
            await _nothing_left(rt, servicer)
        finally:
            stall_over.set()
            if added:
                del rt.engine.add_request
            receiver.close()

    asyncio.run(scenario())


def test_the_deadline_bounds_the_grammar_compile(runtime):
    rt = runtime
    compiling = threading.Event()
    compile_over = threading.Event()
    compile_ended = threading.Event()

    def slow_compile(params):
        compiling.set()
        compile_over.wait(STALL_S)
        compile_ended.set()

    rt.engine.compile_grammar = slow_compile  # type: ignore[method-assign]

    async def scenario():
        servicer, receiver = loopback_servicer(rt)
        req = _request("g", structured_outputs=pb.StructuredOutputs(regex="[ab]+"))
        try:
            chunks, status = await asyncio.wait_for(collect(servicer, req), 30)
            compiled_still = not compile_ended.is_set()
            compile_over.set()
            assert compiling.is_set()
            assert status == grpc.StatusCode.DEADLINE_EXCEEDED and not chunks
            assert compiled_still, "the stream waited for the grammar compile to end"
            await _nothing_left(rt, servicer)
        finally:
            compile_over.set()
            receiver.close()

    asyncio.run(scenario())
