"""A worker's request metrics count every request, however it ends (found by review,
2026-12-06):

- decode: ``request_success``, ``prompt_tokens``, ``generation_tokens``, e2e and queue time
  moved only when the worker finished every sample itself. A request the router ended (a
  stop string, the client gone: the call cancelled or ``Abort(whole)``), a deadline or a
  failure counted nothing, though its TTFT was observed; generation tokens moved only at a
  request's end. Now tokens count as they stream, the prompt and the queue time at the first
  token, and every admitted request's samples once in request_success (``abort``, ``error``).
- decode, n > 1: a sample the router ended by a stop string (``Abort`` with indices: only a
  stop string sends it) counted ``abort``; now ``stop``, as vLLM counts a stop string.
- decode: a request resumed here after a failover observed an e2e latency from its arrival
  here (partial); now none, as for its TTFT.
- prefill: the queue time was computed for the reply but never observed in
  ``pdserve:request_queue_time_seconds``."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from decode_service.server import DecodeServicer
from kvtransfer import LoopbackNetwork, create_receiver, create_sender
from prefill_service.server import PrefillServicer
from shared.proto import pdserve_pb2 as pb
from tests.services.inprocess_worker import (
    Aborted,
    AbortingContext,
    RejectingContext,
    running_runtime,
)

pytestmark = pytest.mark.integration

PROMPT = list(range(5, 45))  # 40 tokens


@pytest.fixture
def runtime(tiny_llama):
    with running_runtime(tiny_llama, "decode") as rt:
        yield rt


def value(rt, name: str, **labels: str) -> float:
    """The sum of the samples ``name`` whose labels include ``labels``."""
    total = 0.0
    for family in rt.metrics.registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


COUNTS = {
    "prompt": ("pdserve:prompt_tokens_total", {}),
    "gen": ("pdserve:generation_tokens_total", {}),
    "length": ("pdserve:request_success_total", {"finished_reason": "length"}),
    "stop": ("pdserve:request_success_total", {"finished_reason": "stop"}),
    "abort": ("pdserve:request_success_total", {"finished_reason": "abort"}),
    "error": ("pdserve:request_success_total", {"finished_reason": "error"}),
    "e2e": ("pdserve:e2e_request_latency_seconds_count", {}),
    "queue": ("pdserve:request_queue_time_seconds_count", {}),
    "ttft": ("pdserve:time_to_first_token_seconds_count", {}),
}


def counts(rt) -> dict[str, float]:
    return {k: value(rt, name, **labels) for k, (name, labels) in COUNTS.items()}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def _request(rid: str, n: int = 1, max_tokens: int = 6, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=PROMPT,
        sampling=pb.SamplingParams(
            n=n, temperature=0 if n == 1 else 1.0, max_tokens=max_tokens, ignore_eos=True
        ),
        **kw,
    )


def _scenario(rt, body):
    async def run():
        receiver = create_receiver(
            "loopback", rt.engine.runner.kv_cache, rt.kv_geometry(), network=LoopbackNetwork()
        )
        try:
            return await body(DecodeServicer(rt, receiver, prefill_timeout_s=2.0))
        finally:
            receiver.close()

    return asyncio.run(run())


def _tokens(chunks) -> int:
    return sum(len(o.token_ids) for c in chunks for o in c.outputs)


def test_a_request_that_finishes_counts_once(runtime):
    rt = runtime
    before = counts(rt)

    async def body(s):
        return [c async for c in s.Generate(_request("a"), RejectingContext())]

    chunks = _scenario(rt, body)
    assert chunks[-1].finished and _tokens(chunks) == 6
    assert delta(counts(rt), before) == {
        "prompt": 40,
        "gen": 6,
        "length": 1,
        "e2e": 1,
        "queue": 1,
        "ttft": 1,
    }


@pytest.mark.parametrize("how", ["abort_whole", "call_cancelled"])
def test_a_request_ended_early_counts_its_tokens_and_once_as_abort(runtime, how):
    rt = runtime
    before = counts(rt)

    async def body(s):
        got = []
        mid = None
        stream = s.Generate(_request("b", max_tokens=200), AbortingContext())
        async for c in stream:
            got.append(c)
            if len(got) == 3:
                mid = counts(rt)  # tokens count as they stream, not at the request's end
                if how == "abort_whole":  # the client left (or a stop string, n = 1)
                    await s.Abort(pb.AbortRequest(request_id="b", whole=True), None)
                else:  # the router cancelled the call: the stream is closed under it
                    break
        await stream.aclose()
        return got, mid

    got, mid = _scenario(rt, body)
    assert len(got) == 3 and not got[-1].finished
    streamed = _tokens(got)
    assert delta(mid, before) == {"prompt": 40, "gen": streamed, "queue": 1, "ttft": 1}
    assert delta(counts(rt), before) == {
        "prompt": 40,
        "gen": streamed,
        "abort": 1,
        "e2e": 1,
        "queue": 1,
        "ttft": 1,
    }


def test_a_sample_the_router_stops_counts_as_stop(runtime):
    rt = runtime
    before = counts(rt)

    async def body(s):
        got = []
        async for c in s.Generate(_request("c", n=2, max_tokens=30), RejectingContext()):
            got.append(c)
            if len(got) == 2:  # a stop string matched in sample 0: the router stops it
                await s.Abort(pb.AbortRequest(request_id="c", indices=[0]), None)
        return got

    got = _scenario(rt, body)
    assert got[-1].finished
    d = delta(counts(rt), before)
    assert d.pop("gen") == got[-1].usage.completion_tokens == _tokens(got)
    assert d == {"prompt": 40, "stop": 1, "length": 1, "e2e": 1, "queue": 1, "ttft": 1}


def test_a_failed_request_counts_once_as_error(runtime):
    rt = runtime
    before = counts(rt)

    async def body(s):
        got = []
        with pytest.raises(Aborted):
            async for c in s.Generate(_request("f", max_tokens=200), AbortingContext()):
                got.append(c)
                if len(got) == 2:
                    s._fail_inflight("the engine is hung (test)")
        return got

    got = _scenario(rt, body)
    d = delta(counts(rt), before)
    assert d.pop("gen") == _tokens(got) > 0
    assert d == {"prompt": 40, "error": 1, "e2e": 1, "queue": 1, "ttft": 1}


def test_a_resumed_request_observes_no_e2e_latency(runtime):
    rt = runtime
    before = counts(rt)
    req = _request("d", resume=[pb.ResumeTokens(index=0, token_ids=[7, 8, 9])])

    async def body(s):
        return [c async for c in s.Generate(req, RejectingContext())]

    chunks = _scenario(rt, body)
    assert chunks[-1].finished and _tokens(chunks) == 3
    # its prompt is prefilled again here: counted (the help text says so)
    assert delta(counts(rt), before) == {"prompt": 40, "gen": 3, "length": 1, "queue": 1}


def test_the_prefill_worker_observes_the_queue_time_once_per_request(tiny_llama):
    with running_runtime(tiny_llama, "prefill") as rt:

        async def scenario():
            net = LoopbackNetwork()
            geometry = rt.kv_geometry()
            sender = create_sender(
                "loopback", rt.engine.runner.transfer_pool, geometry, network=net
            )
            dst = np.zeros(64 * geometry.block_bytes, dtype=np.uint8)
            receiver = create_receiver("loopback", dst, geometry, network=net)
            servicer = PrefillServicer(rt, sender, transfer_timeout_s=5.0)
            try:
                for i in range(2):
                    blocks = list(range(10 * i, 10 * i + 3))  # 40 tokens: 3 blocks of 16
                    receive = receiver.expect(f"t{i}", blocks, timeout_s=5.0)
                    req = pb.PrefillRequest(
                        request_id=f"p{i}",
                        prompt_token_ids=[t + i for t in PROMPT],
                        sampling=pb.SamplingParams(temperature=0, max_tokens=4),
                        decode_kv_address=receiver.address,
                        decode_worker_id="d0",
                        first_block_index=0,
                        dst_block_ids=blocks,
                        transfer_id=f"t{i}",
                    )
                    result = await servicer.Prefill(req, RejectingContext())
                    assert len(result.first_tokens) == 1
                    await asyncio.wait_for(receive, 5.0)
            finally:
                sender.close()
                receiver.close()

        asyncio.run(scenario())
        assert value(rt, "pdserve:request_queue_time_seconds_count") == 2
