"""A decode request waiting for admission behind a hung engine step fails over when the hang is
declared, as the one in the step does (and as the prefill worker's do): UNAVAILABLE with the
engine failure, so the router resumes it elsewhere now. Before, its add command waited behind
the stuck step until the step returned or the request's deadline passed (none with
``deadline_s`` 0; in a cluster the router's bound before a first token is the request
deadline, 600 s by default). A request arriving after the declaration is refused at once.
Asserted on events: the step stays stuck until the test has seen every ending."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from shared.proto import pdserve_pb2 as pb
from shared.proto.failure import FAILURE_ENGINE, FAILURE_KEY
from tests.services.inprocess_worker import (
    collect_ending,
    loopback_servicer,
    serve,
    standalone_runtime,
)

pytestmark = pytest.mark.integration


def _request(rid: str, deadline_s: float = 0.0) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=[5, 6, 7],
        sampling=pb.SamplingParams(temperature=0, max_tokens=4),
        deadline_s=deadline_s,
    )


def test_requests_waiting_for_admission_fail_over_when_the_hang_is_declared(tiny_llama, tmp_path):
    ready = tmp_path / "ready.json"
    rt = standalone_runtime(
        tiny_llama, "decode", "--engine-hang-timeout", "1", "--ready-file", str(ready)
    )
    servicer, receiver = loopback_servicer(rt)
    release, in_step = threading.Event(), threading.Event()
    real = rt.engine.runner.execute

    def stuck(out):  # the forward pass hangs until the test lets it go
        in_step.set()
        release.wait(60)
        return real(out)

    async def scenario():
        worker, _address = await serve(rt, servicer, ready)
        try:
            rt.engine.runner.execute = stuck
            first = asyncio.ensure_future(collect_ending(servicer, _request("in-step")))
            assert await asyncio.to_thread(in_step.wait, 10)
            queued = [
                asyncio.ensure_future(collect_ending(servicer, _request("no-deadline"))),
                asyncio.ensure_future(collect_ending(servicer, _request("deadline-60", 60.0))),
            ]
            ends = await asyncio.wait_for(asyncio.gather(first, *queued), 20)
            assert not release.is_set() and rt.hung
            for _chunks, ending in ends:
                code, details, metadata = ending
                assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
                assert metadata.get(FAILURE_KEY) == FAILURE_ENGINE, metadata
            _chunks, late = await asyncio.wait_for(collect_ending(servicer, _request("late")), 5)
            assert late[0] == grpc.StatusCode.UNAVAILABLE and "hung" in late[1], late
        finally:
            release.set()
            rt.engine.runner.execute = real
            worker.cancel()
            try:
                await worker
            except BaseException:  # noqa: BLE001 - the serve task's cancellation
                pass
        assert not servicer.flights

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        receiver.close()
        rt.loop.stop()
