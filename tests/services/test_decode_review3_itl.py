"""``pdserve:inter_token_latency_seconds`` on a decode worker: one gap per sample per engine
step, none of them an artificial zero. Before, the last token's time was shared by every
sample of an ``n > 1`` request (each sample's token after the first in a step observed a gap
of 0 from its sibling's), and outputs of several steps taken from the queue together all got
the same timestamp (gaps of 0 between them). ``n = 4`` samples of 6 tokens each have 4 x 5
gaps, all positive, whether the stream reads every step as it comes or several at once."""

from __future__ import annotations

import asyncio

import pytest

from decode_service.server import DecodeServicer
from kvtransfer import LoopbackNetwork, create_receiver
from shared.proto import pdserve_pb2 as pb
from tests.services.inprocess_worker import RejectingContext, running_runtime

pytestmark = pytest.mark.integration

N, TOKENS = 4, 6


@pytest.fixture
def runtime(tiny_llama):
    with running_runtime(tiny_llama, "decode") as rt:
        yield rt


@pytest.mark.parametrize("reader", ["prompt", "slow"])
def test_one_positive_gap_per_sample_per_step(runtime, reader):
    """``slow``: the reader sleeps after each chunk, so the outputs of several steps wait in
    the queue and reach the stream together."""
    rt = runtime
    gaps: list[float] = []
    ttfts: list[float] = []
    real_itl, real_ttft = rt.metrics.itl.observe, rt.metrics.ttft.observe

    def itl(v: float) -> None:
        gaps.append(v)
        real_itl(v)

    def ttft(v: float) -> None:
        ttfts.append(v)
        real_ttft(v)

    rt.metrics.itl.observe = itl  # type: ignore[method-assign]
    rt.metrics.ttft.observe = ttft  # type: ignore[method-assign]
    steps_before = rt.loop.num_steps

    async def scenario() -> list[pb.GenerateChunk]:
        receiver = create_receiver(
            "loopback", rt.engine.runner.kv_cache, rt.kv_geometry(), network=LoopbackNetwork()
        )
        servicer = DecodeServicer(rt, receiver, prefill_timeout_s=5.0)
        req = pb.GenerateRequest(
            request_id="itl",
            prompt_token_ids=[5, 6, 7, 8],
            sampling=pb.SamplingParams(
                n=N, max_tokens=TOKENS, temperature=1.0, seed=1, ignore_eos=True
            ),
        )
        chunks = []
        try:
            async for c in servicer.Generate(req, RejectingContext()):
                chunks.append(c)
                if reader == "slow":
                    await asyncio.sleep(0.3)
        finally:
            receiver.close()
        return chunks

    chunks = asyncio.run(scenario())
    per_sample = [0] * N
    for c in chunks:
        for d in c.outputs:
            per_sample[d.index] += len(d.token_ids)
    assert per_sample == [TOKENS] * N and chunks[-1].finished
    assert len(ttfts) == 1
    if reader == "slow":  # (else the test shows nothing the prompt reader does not)
        assert len(chunks) < TOKENS, "no chunk carried several steps"
    assert rt.loop.num_steps - steps_before == TOKENS
    assert len(gaps) == N * (TOKENS - 1), gaps
    assert all(g > 0 for g in gaps), gaps
