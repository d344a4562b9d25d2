"""An invalid prompt is INVALID_ARGUMENT on the prefill worker even while it is busy (found by
review, 2026-12-06): the admission check (the waiting queue at its bound) ran before the
engine validated the prompt, so with requests waiting a prompt too long for the model, or with
token ids outside the vocabulary, was refused RESOURCE_EXHAUSTED (the decode worker counted a
"busy" fallback for a request that can never be served)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from prefill_service.server import PrefillServicer
from shared.engine.sampling_params import SamplingParams
from shared.proto import pdserve_pb2 as pb
from tests.services.inprocess_worker import standalone_runtime


class _Handle:
    transfer_id = "p1:t"
    done = True  # (terminal at once: nothing is sent)
    checksums: list = []
    bytes_sent = 0

    def send_blocks(self, src, first):
        pass

    def finish(self, note=b""):
        pass

    def cancel(self):
        pass

    def raise_for_state(self):
        pass


class _Sender:
    stats = None

    def open(self, tid, addr, dst, timeout_s):
        return _Handle()


class _Aborted(Exception):
    pass


class _Context:
    code = None
    details = ""

    async def abort(self, code, details="", trailing_metadata=()):
        self.code, self.details = code, details
        raise _Aborted(code, details)


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "one-waiting"])
@pytest.mark.parametrize("bad", ["too-long", "out-of-vocab"])
def test_an_invalid_prompt_is_invalid_argument_even_when_requests_wait(tiny_llama, busy, bad):
    rt = standalone_runtime(tiny_llama, "prefill", "--max-waiting-requests", "1")
    vocab = rt.engine.model_config.vocab_size
    prompt = list(range(5, 5 + 600)) if bad == "too-long" else [5, 6, vocab + 7]
    bs = rt.engine.block_size
    n_blocks = -(-len(prompt) // bs)
    request = pb.PrefillRequest(
        request_id="p1",
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(temperature=0, max_tokens=8),
        decode_kv_address=b"x",
        decode_worker_id="d",
        first_block_index=0,
        dst_block_ids=list(range(n_blocks)),
        transfer_id="p1:t",
    )
    if busy:  # one request waits (the loop is not started yet: nothing is scheduled)
        rt.engine.add_request("w", [3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=4))

    async def scenario():
        sv = PrefillServicer(rt, _Sender(), transfer_timeout_s=5.0)
        ctx = _Context()
        task = asyncio.ensure_future(sv.Prefill(request, ctx))
        # the call reaches its admission (queued: the loop has not started) or is refused
        end = asyncio.get_running_loop().time() + 30
        while not (task.done() or sv.queues) and asyncio.get_running_loop().time() < end:
            await asyncio.sleep(0.02)
        rt.loop.start()
        try:
            await asyncio.wait_for(task, 30)
        except _Aborted:
            pass
        return ctx.code, ctx.details, rt.inflight

    try:
        code, details, inflight = asyncio.run(scenario())
    finally:
        rt.loop.stop()
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    if bad == "too-long":
        assert details == (
            "prompt has 600 tokens; the model's maximum context length is 512 "
            "(prompt + at least one output token must fit)"
        )
    else:
        assert details == f"prompt: token ids must be in [0, {vocab}), got {vocab + 7}"
    assert inflight == 0
