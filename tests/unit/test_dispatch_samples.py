"""Failover exactness for every sample (router side): a resumed request marks the samples that
already ended, so the next worker does not continue them; a sample the router ends on a stop
string is aborted on the decode worker while the others go on."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from router.dispatch import GenerationInput, GenerationStream
from shared.proto import pdserve_pb2 as pb

pytestmark = pytest.mark.unit


def stream(n: int) -> GenerationStream:
    inp = GenerationInput(
        "rid", [5, 6, 7], pb.SamplingParams(n=n, max_tokens=8), time.monotonic() + 60
    )
    return GenerationStream(SimpleNamespace(), inp)


def test_resume_marks_the_samples_that_already_ended():
    s = stream(3)
    s.tokens = [[1, 2], [3], [4, 5, 6]]
    s.finished = {0, 2}
    req = s._request(SimpleNamespace(prefill=None))
    assert [(r.index, list(r.token_ids), r.finished) for r in req.resume] == [
        (0, [1, 2], True),
        (1, [3], False),
        (2, [4, 5, 6], True),
    ]


class FakeStub:
    def __init__(self) -> None:
        self.aborts: list[tuple[str, list[int]]] = []

    async def Abort(self, request, timeout=None):
        self.aborts.append((request.request_id, list(request.indices)))
        return pb.AbortReply(aborted=len(request.indices))


def test_a_sample_ended_by_a_stop_string_is_aborted_on_the_worker():
    async def scenario():
        s = stream(3)
        stub = FakeStub()
        s._live = (stub, "rid.1")
        s.finish(1)
        await asyncio.sleep(0)
        s.finish(0)
        await asyncio.sleep(0)
        s.finish(2)  # the last one: the router cancels the whole call instead
        await asyncio.sleep(0)
        return stub.aborts

    assert asyncio.run(scenario()) == [("rid.1", [1]), ("rid.1", [0])]
