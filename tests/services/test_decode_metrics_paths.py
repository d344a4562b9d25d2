"""A decode worker's request metrics say what happened to each request:

- ``pdserve:decode_prefill_path``: a remote prefill that failed and was done here counts as
  ``fallback`` (it was counted ``disagg`` at admission, before the prefill worker was tried,
  so ``fallback`` never appeared); one count per request, local ones as ``local``.
- ``pdserve:time_to_first_token_seconds``: a request resumed here after a failover got its
  first token on the worker that failed; its first token here is not a time to first token
  (it was observed again, from the resumed call's arrival)."""

from __future__ import annotations

import asyncio

import pytest

from decode_service.server import DecodeServicer
from kvtransfer import LoopbackNetwork, create_receiver
from shared.proto import pdserve_pb2 as pb
from tests.services.inprocess_worker import RejectingContext, running_runtime

pytestmark = pytest.mark.integration


@pytest.fixture
def runtime(tiny_llama):
    with running_runtime(tiny_llama, "decode") as rt:
        yield rt


def _run(rt, requests: list[pb.GenerateRequest]) -> tuple[list[str], list[float]]:
    """Serve ``requests`` one after another; returns the paths and TTFTs the metrics got."""
    paths: list[str] = []
    ttfts: list[float] = []
    real_path, real_ttft = rt.metrics.path, rt.metrics.ttft.observe

    def path(p: str) -> None:
        paths.append(p)
        real_path(p)

    def ttft(v: float) -> None:
        ttfts.append(v)
        real_ttft(v)

    rt.metrics.path = path  # type: ignore[method-assign]
    rt.metrics.ttft.observe = ttft  # type: ignore[method-assign]

    async def scenario() -> None:
        receiver = create_receiver(
            "loopback", rt.engine.runner.kv_cache, rt.kv_geometry(), network=LoopbackNetwork()
        )
        servicer = DecodeServicer(rt, receiver, prefill_timeout_s=2.0)
        try:
            for req in requests:
                chunks = [c async for c in servicer.Generate(req, RejectingContext())]
                assert chunks and chunks[-1].finished
        finally:
            receiver.close()

    asyncio.run(scenario())
    return paths, ttfts


def _request(rid: str, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=list(range(5, 45)),
        sampling=pb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        **kw,
    )


def test_a_remote_prefill_done_here_counts_as_fallback(runtime):
    # nothing listens on port 9: the Prefill call fails at once and D prefills locally
    paths, ttfts = _run(runtime, [_request("far", prefill_address="127.0.0.1:9"), _request("near")])
    assert paths == ["fallback", "local"]
    assert len(ttfts) == 2


def test_a_resumed_request_observes_no_time_to_first_token(runtime):
    resumed = _request("again", resume=[pb.ResumeTokens(index=0, token_ids=[7, 8])])
    paths, ttfts = _run(runtime, [resumed, _request("fresh")])
    assert paths == ["local", "local"]
    assert len(ttfts) == 1  # the fresh one's only
