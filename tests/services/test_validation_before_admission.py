"""An invalid request is INVALID_ARGUMENT on the decode worker at once, even while it is busy
(the prefill worker's fix of 2026-12-06, test_prefill_review3_validation.py, for the decode
worker): ``Generate`` ran its admission (the waiting queue at its bound, on the engine thread)
before the engine validated the prompt, so with requests waiting a prompt too long for the
model, or with token ids outside the vocabulary, was refused RESOURCE_EXHAUSTED (the router
retried it elsewhere, then answered 429 for a request that can never be served), and while the
engine thread was busy the call waited its turn there before being refused. Both workers now
run ``EngineCore.validate_prompt`` (add_request's own checks, sampling included) first."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from decode_service.server import DecodeServicer
from kvtransfer import LoopbackNetwork, create_receiver
from shared.engine.sampling_params import SamplingParams
from shared.proto import pdserve_pb2 as pb
from tests.services.inprocess_worker import collect, standalone_runtime


def _bad(kind: str, vocab: int) -> tuple[list[int], pb.SamplingParams, str]:
    """(prompt, sampling, the engine's message) of an invalid request of ``kind``."""
    sampling = pb.SamplingParams(temperature=0, max_tokens=8)
    if kind == "too-long":
        return (
            list(range(5, 5 + 600)),
            sampling,
            "prompt has 600 tokens; the model's maximum context length is 512 "
            "(prompt + at least one output token must fit)",
        )
    if kind == "out-of-vocab":
        return (
            [5, 6, vocab + 7],
            sampling,
            f"prompt: token ids must be in [0, {vocab}), got {vocab + 7}",
        )
    assert kind == "logit-bias-out-of-vocab"  # a sampling check the engine makes (the vocab)
    sampling.logit_bias[vocab] = 1.0
    return [5, 6, 7], sampling, f"logit_bias: token ids must be in [0, {vocab}), got {vocab}"


def _decode_servicer(rt) -> DecodeServicer:
    receiver = create_receiver(
        "loopback", rt.engine.runner.kv_cache, rt.kv_geometry(), network=LoopbackNetwork()
    )
    return DecodeServicer(rt, receiver, prefill_timeout_s=5.0)


class _Refused(Exception):
    pass


class _Context:
    """Records the call's abort (code, details) and ends it as gRPC's abort does."""

    def __init__(self) -> None:
        self.aborts: list[tuple] = []

    async def abort(self, code, details="", trailing_metadata=()):
        self.aborts.append((code, details))
        raise _Refused(code, details)


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "one-waiting"])
@pytest.mark.parametrize("bad", ["too-long", "out-of-vocab", "logit-bias-out-of-vocab"])
def test_decode_refuses_an_invalid_request_invalid_argument_before_admission(tiny_llama, busy, bad):
    rt = standalone_runtime(tiny_llama, "decode", "--max-waiting-requests", "1")
    vocab = rt.engine.model_config.vocab_size
    prompt, sampling, message = _bad(bad, vocab)
    request = pb.GenerateRequest(request_id="d1", prompt_token_ids=prompt, sampling=sampling)
    if busy:  # one request waits (the loop is not started yet: nothing is scheduled)
        rt.engine.add_request("w", [3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=4))
    sv = _decode_servicer(rt)
    ctx = _Context()
    chunks: list = []

    async def call():
        try:
            async for chunk in sv.Generate(request, ctx):
                chunks.append(chunk)
        except _Refused:
            pass

    async def scenario():
        task = asyncio.ensure_future(call())
        # refused, or in flight: queued for admission (the engine loop has not started, so an
        # admission waits for it)
        loop = asyncio.get_running_loop()
        end = loop.time() + 30
        while not (task.done() or sv.flights) and loop.time() < end:
            await asyncio.sleep(0.02)
        refused_at_once = task.done()
        queued = list(rt.engine.parents)  # (the engine thread is not running yet)
        rt.loop.start()  # (before the fix: the admission runs now, and refuses the call)
        await asyncio.wait_for(task, 30)
        return refused_at_once, queued

    try:
        refused_at_once, queued = asyncio.run(scenario())
    finally:
        rt.loop.stop()
    assert ctx.aborts == [(grpc.StatusCode.INVALID_ARGUMENT, message)], ctx.aborts
    assert refused_at_once, "the call waited for its admission on the engine thread"
    assert chunks == [] and rt.inflight == 0 and sv.flights == {} and sv.by_engine_id == {}
    assert queued == (["w"] if busy else [])  # nothing of it reached the engine


def test_decode_still_admits_a_valid_request_and_refuses_it_busy(tiny_llama):
    """The admission itself is unchanged: a valid request at the bound is RESOURCE_EXHAUSTED."""
    rt = standalone_runtime(tiny_llama, "decode", "--max-waiting-requests", "1")
    rt.engine.add_request("w", [3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=4))
    request = pb.GenerateRequest(
        request_id="ok", prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=2)
    )

    async def scenario():
        sv = _decode_servicer(rt)
        task = asyncio.ensure_future(collect(sv, request))
        loop = asyncio.get_running_loop()
        end = loop.time() + 30
        while not (task.done() or sv.flights) and loop.time() < end:
            await asyncio.sleep(0.02)
        assert not task.done()  # it waits for the engine thread's admission
        rt.loop.start()
        return await asyncio.wait_for(task, 30)

    try:
        chunks, how = asyncio.run(scenario())
    finally:
        rt.loop.stop()
    assert how == grpc.StatusCode.RESOURCE_EXHAUSTED and chunks == []


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "one-waiting"])
def test_prefill_refuses_a_bad_sampling_invalid_argument_before_admission(tiny_llama, busy):
    """The prefill worker's validation covers the engine's sampling checks too (an id past the
    vocabulary in logit_bias was RESOURCE_EXHAUSTED while requests waited)."""
    from prefill_service.server import PrefillServicer
    from tests.services.test_prefill_review3_validation import _Aborted, _Context, _Sender

    rt = standalone_runtime(tiny_llama, "prefill", "--max-waiting-requests", "1")
    vocab = rt.engine.model_config.vocab_size
    prompt, sampling, message = _bad("logit-bias-out-of-vocab", vocab)
    request = pb.PrefillRequest(
        request_id="p1",
        prompt_token_ids=prompt,
        sampling=sampling,
        decode_kv_address=b"x",
        decode_worker_id="d",
        first_block_index=0,
        dst_block_ids=[0],
        transfer_id="p1:t",
    )
    if busy:
        rt.engine.add_request("w", [3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=4))

    async def scenario():
        sv = PrefillServicer(rt, _Sender(), transfer_timeout_s=5.0)
        ctx = _Context()
        task = asyncio.ensure_future(sv.Prefill(request, ctx))
        loop = asyncio.get_running_loop()
        end = loop.time() + 30
        while not (task.done() or sv.queues) and loop.time() < end:
            await asyncio.sleep(0.02)
        refused_at_once = task.done()
        rt.loop.start()
        try:
            await asyncio.wait_for(task, 30)
        except _Aborted:
            pass
        return refused_at_once, ctx.code, ctx.details, rt.inflight

    try:
        refused_at_once, code, details, inflight = asyncio.run(scenario())
    finally:
        rt.loop.stop()
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert refused_at_once and inflight == 0
