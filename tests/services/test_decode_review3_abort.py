"""``DecodeWorker.Abort`` with a long ``indices`` list (``[63] * 1_000_000`` on an ``n = 64``
request: an 8 MB message) blocked the engine thread about a second: the list went to the
engine as it came, and ``EngineCore.abort_samples`` rebuilt ``set(indices)`` once per sample.
Now Abort hands the engine only the distinct indices of the request's samples (at most ``n``),
and ``abort_samples`` reads its ``indices`` once. Both asserted on what is passed and read,
not on time."""

from __future__ import annotations

import asyncio

import pytest

from decode_service.server import DecodeServicer
from kvtransfer import LoopbackNetwork, create_receiver
from shared.engine.sampling_params import SamplingParams
from shared.proto import pdserve_pb2 as pb
from tests.services.inprocess_worker import RejectingContext, running_runtime

pytestmark = pytest.mark.integration


@pytest.fixture
def runtime(tiny_llama):
    with running_runtime(tiny_llama, "decode") as rt:
        yield rt


def test_abort_hands_the_engine_only_distinct_indices_of_the_request(runtime):
    rt = runtime
    n = 8
    passed: list[list[int]] = []
    real = rt.engine.abort_samples

    def recording(request_id, indices):
        passed.append(list(indices))
        return real(request_id, indices)

    rt.engine.abort_samples = recording  # type: ignore[method-assign]

    async def scenario():
        receiver = create_receiver(
            "loopback", rt.engine.runner.kv_cache, rt.kv_geometry(), network=LoopbackNetwork()
        )
        servicer = DecodeServicer(rt, receiver, prefill_timeout_s=5.0)
        req = pb.GenerateRequest(
            request_id="ab",
            prompt_token_ids=[5, 6, 7, 8],
            sampling=pb.SamplingParams(
                n=n, max_tokens=400, temperature=1.0, seed=1, ignore_eos=True
            ),
        )
        stream = servicer.Generate(req, RejectingContext())
        try:
            first = await asyncio.wait_for(stream.__anext__(), 30)
            assert not first.finished
            indices = [n - 1] * 100_000 + [2, 2, n, n + 5, 1_000_000, 2]
            reply = await servicer.Abort(pb.AbortRequest(request_id="ab", indices=indices), None)
            assert reply.aborted == 2
            assert len(passed) == 1
            assert len(passed[0]) <= n and sorted(passed[0]) == [2, n - 1]
            whole = await servicer.Abort(pb.AbortRequest(request_id="ab", whole=True), None)
            assert whole.aborted == n
            async for _ in stream:
                pass
        finally:
            await stream.aclose()
            receiver.close()
        return await asyncio.wrap_future(rt.loop.submit(lambda e: len(e.parents)))

    assert asyncio.run(scenario()) == 0


class _CountingIndices(list):
    """A list that counts how often it is read whole."""

    def __init__(self, items) -> None:
        super().__init__(items)
        self.reads = 0

    def __iter__(self):
        self.reads += 1
        return super().__iter__()


def test_abort_samples_reads_its_indices_once(runtime):
    rt = runtime
    indices = _CountingIndices([1, 3])

    def run(e):
        e.add_request("p", [5, 6, 7, 8], SamplingParams(n=6, max_tokens=4))
        outs = e.abort_samples("p", indices)
        e.abort_request(["p"])
        return outs

    outs = rt.loop.submit(run).result(timeout=30)
    assert sorted(o.index for o in outs) == [1, 3]
    assert all(o.finish_reason == "abort" for o in outs)
    assert indices.reads == 1, f"indices read {indices.reads} times for 6 samples"
