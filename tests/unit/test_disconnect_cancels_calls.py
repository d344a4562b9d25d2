"""A client that leaves mid-stream ends the request without cancelling the task that awaits a
gRPC read: grpcio's aio leaks native memory for every task cancelled while a read is in flight
(grpc/grpc#43360; about 4 KiB each here). The router asks the decode worker to end the stream
(``Abort(whole=True)``), so the pending read completes; the call is cancelled only when the
worker does not know the request or does not answer."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from router.dispatch import GenerationInput, GenerationStream
from router.sse import DisconnectWatch
from shared.proto import pdserve_pb2 as pb

pytestmark = pytest.mark.unit


class FakeCall:
    """A gRPC call whose ``read`` waits for a message that never comes; records how the read
    ended: through ``cancel()`` (as grpcio does: the read raises CancelledError) or through a
    cancellation of the task awaiting it (the leaking case)."""

    def __init__(self) -> None:
        self._msg: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.cancelled = False
        self.read_ended_by: str | None = None

    def done(self) -> bool:
        return self.cancelled

    def cancel(self) -> bool:
        self.cancelled = True
        if not self._msg.done():
            self._msg.set_exception(asyncio.CancelledError())
        return True

    async def read(self):
        try:
            await self._msg
        except asyncio.CancelledError:
            self.read_ended_by = "call.cancel()" if self.cancelled else "task.cancel()"
            raise


def _receive_then_disconnect(gone: asyncio.Event):
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    return receive


async def _reader(watch: DisconnectWatch, call: FakeCall) -> str:
    watch.attach()
    try:
        await call.read()
    except asyncio.CancelledError:
        return "ended"
    return "read a message"


def test_disconnect_cancels_the_call_and_the_reading_task_ends_on_its_own():
    async def scenario():
        call = FakeCall()
        gone = asyncio.Event()
        watch = DisconnectWatch(_receive_then_disconnect(gone), on_gone=call.cancel)
        task = asyncio.create_task(_reader(watch, call))
        await asyncio.sleep(0.01)
        gone.set()
        result = await asyncio.wait_for(task, 2)
        watch.stop()
        return result, call.read_ended_by, watch.gone

    assert asyncio.run(scenario()) == ("ended", "call.cancel()", True)


def test_without_a_call_to_cancel_the_task_is_cancelled_at_once():
    async def scenario():
        gone = asyncio.Event()
        watch = DisconnectWatch(_receive_then_disconnect(gone), on_gone=lambda: False)
        blocker = asyncio.get_running_loop().create_future()

        async def routing():
            watch.attach()
            await blocker  # e.g. waiting for the directory: nothing of gRPC's to cancel

        task = asyncio.create_task(routing())
        await asyncio.sleep(0.01)
        t0 = time.monotonic()
        gone.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2)
        watch.stop()
        return time.monotonic() - t0

    assert asyncio.run(scenario()) < 0.5  # no grace period when no call was cancelled


class FakeStub:
    def __init__(self, known: bool) -> None:
        self.known = known
        self.aborts: list[tuple[str, bool]] = []

    async def Abort(self, request, timeout=None):
        self.aborts.append((request.request_id, request.whole))
        return pb.AbortReply(aborted=1 if self.known else 0)


def _stream() -> GenerationStream:
    inp = GenerationInput("rid", [5, 6], pb.SamplingParams(max_tokens=4), time.monotonic() + 9)
    return GenerationStream(SimpleNamespace(), inp)


@pytest.mark.parametrize("known", [True, False])
def test_client_left_asks_the_worker_to_end_the_stream_and_cancels_only_as_a_fallback(known):
    async def scenario():
        s = _stream()
        idle = s.client_left()  # between attempts: nothing to end
        call, stub = FakeCall(), FakeStub(known)
        s._call, s._live = call, (stub, "rid.1")
        running = s.client_left()
        again = s.client_left()  # already leaving: one Abort only
        await asyncio.sleep(0.01)
        return idle, running, again, stub.aborts, call.cancelled

    idle, running, again, aborts, cancelled = asyncio.run(scenario())
    assert (idle, running, again, aborts) == (False, True, False, [("rid.1", True)])
    # a worker that ends the stream lets the pending read complete; one that does not know
    # the request (or does not answer) gets the call cancelled
    assert cancelled is (not known)
