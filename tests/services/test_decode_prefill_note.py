"""Where a decode worker takes a remote prefill's result from (``DecodeServicer._prefill_result``):
the KV transfer's ``fin`` note when it carries one, else the Prefill call's reply once the
transfer is done too; a failed transfer or a note that does not parse is an error (the caller
prefills locally), whatever the call is doing. Real loopback transfers; the call's reply is a
future the test settles."""

from __future__ import annotations

import asyncio
import logging

import pytest

from decode_service.server import DecodeServicer, _BadPrefillResult
from kvtransfer import LoopbackNetwork, TransferTimeoutError, create_receiver, create_sender
from shared.proto import pdserve_pb2 as pb
from tests.kvtransfer.kvt_helpers import random_pool, small_geometry

pytestmark = pytest.mark.unit


@pytest.fixture
def pair():
    g = small_geometry()
    net = LoopbackNetwork()
    dst = random_pool(16, g, 2)
    receiver = create_receiver("loopback", dst, g, network=net)
    sender = create_sender("loopback", random_pool(16, g, 1), g, network=net)
    yield sender, receiver
    sender.close()
    receiver.close()


def _servicer() -> DecodeServicer:
    s = DecodeServicer.__new__(DecodeServicer)  # only what _prefill_result reads
    s.prefill_timeout_s = 5.0
    s.remote_prefills_noted = 0
    s._replies = set()
    return s


def _result(token: int) -> pb.PrefillResult:
    return pb.PrefillResult(request_id="r", first_tokens=[pb.FirstToken(index=0, token_id=token)])


def _send(sender, receiver, tid: str, note: bytes | None):
    rh = receiver.expect(tid, [3, 4], 5)
    sh = sender.open(tid, receiver.address, [3, 4], 5)
    sh.send_blocks([1, 2], 0)
    if note is not None:
        sh.finish(note)
    return rh, sh


def test_the_note_is_taken_without_waiting_for_the_reply(pair, caplog):
    sender, receiver = pair
    s = _servicer()

    async def main():
        rh, _ = _send(sender, receiver, "noted", _result(42).SerializeToString())
        reply = asyncio.get_running_loop().create_future()  # never answered before the result
        result = await asyncio.wait_for(s._prefill_result(rh, reply, 0.0), 5)
        assert not reply.done() and reply in s._replies  # left to end on its own
        reply.set_exception(RuntimeError("P went away after the transfer"))
        await asyncio.sleep(0)
        return result

    with caplog.at_level(logging.DEBUG, logger="decode_service.server"):
        result = asyncio.run(main())
    assert [f.token_id for f in result.first_tokens] == [42]
    assert s.remote_prefills_noted == 1 and not s._replies
    assert "ended after its transfer's note" in caplog.text  # the late error read, and logged


def test_without_a_note_the_reply_and_the_transfer_both_count(pair):
    sender, receiver = pair
    s = _servicer()

    async def main():
        rh, sh = _send(sender, receiver, "plain", None)
        reply = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(s._prefill_result(rh, reply, 0.0))
        reply.set_result(_result(7))  # the reply first: the transfer is not finished yet
        await asyncio.sleep(0.05)
        assert not task.done()
        sh.finish()  # (an older prefill worker: no note)
        return await asyncio.wait_for(task, 5)

    assert [f.token_id for f in asyncio.run(main()).first_tokens] == [7]
    assert s.remote_prefills_noted == 0


def test_a_note_that_does_not_parse_is_a_bad_result(pair):
    sender, receiver = pair
    s = _servicer()

    async def main():
        rh, _ = _send(sender, receiver, "garbage", b"\xff\xff\xff")
        reply = asyncio.get_running_loop().create_future()
        with pytest.raises(_BadPrefillResult, match="does not parse"):
            await asyncio.wait_for(s._prefill_result(rh, reply, 0.0), 5)

    asyncio.run(main())


def test_a_failed_transfer_is_raised_while_the_call_still_runs(pair):
    sender, receiver = pair
    s = _servicer()

    async def main():
        rh = receiver.expect("never", [5], 0.2)  # nothing is ever sent: the receive times out
        reply = asyncio.get_running_loop().create_future()
        with pytest.raises(TransferTimeoutError):
            await asyncio.wait_for(s._prefill_result(rh, reply, 0.0), 5)
        assert not reply.done()  # (the caller cancels the call)

    asyncio.run(main())


def test_first_tokens_outside_the_vocabulary_are_a_bad_result():
    # A prefill worker's token id out of range went to the engine and would have failed its
    # next step, every request in it (found by review, 2026-12-06); now the request is
    # prefilled locally instead.
    from decode_service.server import checked_first_tokens

    def result(*ids):
        return pb.PrefillResult(
            request_id="r",
            first_tokens=[pb.FirstToken(index=i, token_id=t) for i, t in enumerate(ids)],
        )

    assert [t.token_id for t in checked_first_tokens(result(7, 99), 2, 100)] == [7, 99]
    with pytest.raises(_BadPrefillResult, match="outside the vocabulary"):
        checked_first_tokens(result(7, 100), 2, 100)
    with pytest.raises(_BadPrefillResult, match="samples"):
        checked_first_tokens(result(7), 2, 100)
