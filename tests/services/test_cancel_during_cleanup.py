"""Cancellation during a worker's cleanup (found by review, 2026-12-06).

A Generate (decode) or Prefill handler that ends without finishing cleans up in its
``finally``: it aborts the request in the engine (waiting up to one engine step) and cancels the
KV transfer. A second cancel arriving in that wait (the router's cancel after the worker's own
deadline fired, the shared mux call ending, the decode worker cancelling a Prefill whose
transfer failed) used to cancel the engine's abort command before it ran and skip the rest:
the request went on generating for nobody, ``inflight`` never came back to 0 (a drain waited its
whole timeout), and on the prefill worker the blocks handed to the sender stayed pinned for
good. Each scenario slows the engine's steps so the window is always hit; the controls run
without the second cancel.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import grpc
import pytest

from decode_service.server import DecodeServicer
from kvtransfer import LoopbackNetwork, create_receiver
from kvtransfer.errors import KVTransferError
from prefill_service.server import PrefillServicer
from shared.engine.sampling_params import SamplingParams
from shared.proto import pdserve_pb2 as pb
from shared.proto.mux import serve_mux
from tests.services.inprocess_worker import standalone_runtime


async def _settle(done, timeout: float = 10.0) -> None:
    """Wait until ``done()`` holds (cleanup is asynchronous), ``timeout`` at most."""
    end = time.monotonic() + timeout
    while not done() and time.monotonic() < end:
        await asyncio.sleep(0.05)


async def _engine_settled(rt, value, timeout: float = 10.0):
    """``value(engine)`` on the engine thread, asked again until it is falsy (the abort and
    the unpinning follow the handler's end), ``timeout`` at most; the last answer."""
    end = time.monotonic() + timeout
    while True:
        got = await asyncio.wrap_future(rt.loop.submit(value))
        if not any(got) if isinstance(got, tuple) else not got:
            return got
        if time.monotonic() > end:
            return got
        await asyncio.sleep(0.05)


@pytest.fixture
def runtime(tiny_llama):
    rt = standalone_runtime(tiny_llama, "decode")
    rt.loop.start()
    yield rt
    rt.loop.stop()


@pytest.fixture
def prefill_runtime(tiny_llama):
    rt = standalone_runtime(tiny_llama, "prefill")
    rt.loop.start()
    yield rt
    rt.loop.stop()


def _slow_steps(rt, seconds: float) -> None:
    """Every engine step takes ``seconds`` more (a big batch on a GPU): a handler's wait for the
    engine's abort lasts that long, so a second cancel always lands inside it."""
    real_step = rt.engine.step

    def slow_step():
        time.sleep(seconds)
        return real_step()

    rt.engine.step = slow_step


class _MuxCall:
    """A decode servicer behind one GenerateMux call, driven as the router drives it; its
    ``in_abort`` is set once a handler waits for the engine's abort."""

    def __init__(self, rt) -> None:
        self.receiver = create_receiver(
            "loopback", rt.engine.runner.kv_cache, rt.kv_geometry(), network=LoopbackNetwork()
        )
        self.servicer = DecodeServicer(rt, self.receiver, prefill_timeout_s=5.0)
        self.in_abort = asyncio.Event()
        self.got_chunk = asyncio.Event()
        self.ups: asyncio.Queue = asyncio.Queue()
        real_abort = self.servicer._abort

        async def abort(*a):
            self.in_abort.set()
            await real_abort(*a)

        self.servicer._abort = abort
        self.call = asyncio.ensure_future(self._consume())  # what grpc runs for the call

    async def _ups(self):
        while (u := await self.ups.get()) is not None:  # None: the router half-closes
            yield u

    async def _consume(self) -> None:
        async for d in serve_mux(self.servicer.Generate, self._ups()):
            if d.chunks:
                self.got_chunk.set()

    def start(self, deadline_s: float = 0.0) -> None:
        request = pb.GenerateRequest(
            request_id="X",
            prompt_token_ids=[5, 6, 7, 8],
            sampling=pb.SamplingParams(temperature=0, max_tokens=200),
            deadline_s=deadline_s,
        )
        self.ups.put_nowait(pb.MuxUp(start=[request]))

    def cancel(self) -> None:
        self.ups.put_nowait(pb.MuxUp(cancel=["X"]))


@pytest.mark.parametrize("cancel", [False, True], ids=["control-no-cancel", "cancel-in-abort"])
def test_a_cancel_while_the_decode_worker_aborts_after_its_deadline_leaks_nothing(runtime, cancel):
    rt = runtime
    _slow_steps(rt, 0.15)

    async def scenario():
        mux = _MuxCall(rt)
        servicer = mux.servicer
        mux.start(deadline_s=0.6)
        await asyncio.wait_for(mux.in_abort.wait(), 20)  # deadline hit: the worker aborts X
        # the router's watchdog hit the same deadline and cancels X on the shared call
        if cancel:
            mux.cancel()
        await _settle(lambda: not servicer.flights and rt.inflight == 0)
        mux.ups.put_nowait(None)  # the router half-closes; the call ends once X's task ended
        await asyncio.wait_for(mux.call, 10)
        state = dict(
            flights=list(servicer.flights),
            by_engine_id=list(servicer.by_engine_id),
            queues=list(servicer.outputs.queues),
            inflight=rt.inflight,
        )
        stats = await _engine_settled(rt, lambda e: (e.stats().running, e.stats().waiting))
        mux.receiver.close()
        return state, stats

    state, stats = asyncio.run(scenario())
    assert state == dict(flights=[], by_engine_id=[], queues=[], inflight=0), state
    assert stats == (0, 0), f"request X left in the engine: running/waiting={stats}"


def test_the_mux_call_ending_while_a_request_aborts_leaks_nothing(runtime):
    rt = runtime
    _slow_steps(rt, 0.15)

    async def scenario():
        mux = _MuxCall(rt)
        servicer = mux.servicer
        mux.start()
        await asyncio.wait_for(mux.got_chunk.wait(), 20)
        mux.cancel()  # router shutting down: its client requests end
        await asyncio.wait_for(mux.in_abort.wait(), 20)  # X's handler waits for the engine's abort
        mux.call.cancel()  # ... then it closes the shared call (grpc cancels the handler)
        try:
            await mux.call
        except asyncio.CancelledError:
            pass
        await _settle(lambda: not servicer.flights and rt.inflight == 0)
        state = dict(flights=list(servicer.flights), inflight=rt.inflight)
        running = await _engine_settled(rt, lambda e: e.stats().running)
        await asyncio.wrap_future(rt.loop.submit(lambda e: e.abort_request(list(e.parents))))
        mux.receiver.close()
        return state, running

    state, running = asyncio.run(scenario())
    assert state == dict(flights=[], inflight=0) and running == 0, (state, running)


class _Handle:
    def __init__(self, tid, n):
        self.transfer_id = tid
        self._f = concurrent.futures.Future()
        self._err = None
        self.checksums = [None] * n
        self.bytes_sent = 0
        self.sent = []

    @property
    def done(self):
        return self._f.done()

    def send_blocks(self, src, first):
        self.sent.append((list(src), first))

    def finish(self, note=b""):  # the link to D breaks a little later: the transfer fails
        def fail():
            if not self._f.done():
                self._err = KVTransferError("link lost")
                self._f.set_result("failed")

        threading.Timer(0.15, fail).start()

    def cancel(self):
        if not self._f.done():
            self._err = KVTransferError("cancelled")
            self._f.set_result("cancelled")

    def raise_for_state(self):
        if self._err is not None:
            raise self._err

    def __await__(self):
        return asyncio.shield(asyncio.wrap_future(self._f)).__await__()


class _Sender:
    stats = None

    def __init__(self):
        self.handles = []

    def open(self, tid, addr, dst, timeout_s):
        h = _Handle(tid, len(dst))
        self.handles.append(h)
        return h


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self):
        self.aborted = asyncio.Event()
        self.code = None

    async def abort(self, code, details="", trailing_metadata=()):
        self.code = code
        self.aborted.set()
        raise _Aborted(details)


@pytest.mark.parametrize("cancel", [False, True], ids=["control-no-cancel", "cancel-in-finally"])
def test_a_prefill_cancelled_while_it_cleans_up_unpins_its_blocks(prefill_runtime, cancel):
    rt = prefill_runtime
    _slow_steps(rt, 0.4)

    async def scenario():
        sender = _Sender()
        servicer = PrefillServicer(rt, sender, transfer_timeout_s=5.0)
        # another request keeps the engine stepping (a busy prefill worker)
        await asyncio.wrap_future(
            rt.loop.submit(
                lambda e: e.add_request(
                    "busy", [3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=400)
                )
            )
        )
        bs = rt.engine.block_size
        prompt = list(range(5, 5 + 3 * bs))
        req = pb.PrefillRequest(
            request_id="p1",
            prompt_token_ids=prompt,
            sampling=pb.SamplingParams(temperature=0, max_tokens=8),
            decode_kv_address=b"x",
            decode_worker_id="d",
            first_block_index=0,
            dst_block_ids=list(range(3)),
            transfer_id="p1:t",
        )
        in_abort = asyncio.Event()  # set once the handler's finally submits the engine abort
        real_abort_and_release = servicer._abort_and_release

        def abort_and_release(*a):
            in_abort.set()
            return real_abort_and_release(*a)

        servicer._abort_and_release = abort_and_release
        ctx = _Context()
        task = asyncio.ensure_future(servicer.Prefill(req, ctx))
        await asyncio.wait_for(ctx.aborted.wait(), 30)  # P's transfer failed: status UNAVAILABLE
        # its finally now waits for the engine abort (a slow step: 0.4 s)
        await asyncio.wait_for(in_abort.wait(), 30)
        if cancel:
            task.cancel()  # D saw the failure too and cancels the Prefill call
        # the handler ends with its status (the abort), or with the cancel
        with pytest.raises(asyncio.CancelledError if cancel else _Aborted):
            await task
        await _settle(lambda: rt.inflight == 0 and not servicer.queues)
        pinned = await _engine_settled(rt, lambda e: e.kv.num_pinned_blocks)
        sent = sender.handles[0].sent
        state = dict(
            pinned_blocks=pinned,
            inflight=rt.inflight,
            pending_sends=servicer.pending_sends,
            queues=list(servicer.queues),
            sinks=list(rt.loop._sinks),
        )
        await asyncio.wrap_future(rt.loop.submit(lambda e: e.abort_request(["busy"])))
        return ctx.code, sent, state

    code, sent, state = asyncio.run(scenario())
    assert code == grpc.StatusCode.UNAVAILABLE, code  # the transfer's failure, as its status
    assert sent, "the blocks were handed to the sender (and pinned)"
    assert state == dict(pinned_blocks=0, inflight=0, pending_sends=0, queues=[], sinks=[]), state


def test_a_prefill_that_produces_nothing_in_time_is_deadline_exceeded(prefill_runtime):
    # The wait for the engine's first output timed out with a bare TimeoutError: gRPC's
    # UNKNOWN, which the decode worker counted as a prefill_error fallback, not a timeout
    # (found by review, 2026-12-06).
    import grpc

    rt = prefill_runtime
    _slow_steps(rt, 0.6)

    async def scenario():
        sender = _Sender()
        servicer = PrefillServicer(rt, sender, transfer_timeout_s=0.2)
        bs = rt.engine.block_size
        req = pb.PrefillRequest(
            request_id="slow",
            prompt_token_ids=list(range(5, 5 + 2 * bs)),
            sampling=pb.SamplingParams(temperature=0, max_tokens=8),
            decode_kv_address=b"x",
            decode_worker_id="d",
            first_block_index=0,
            dst_block_ids=[0, 1],
            transfer_id="slow:t",
        )
        ctx = _Context()
        with pytest.raises(_Aborted, match="produced nothing"):
            await servicer.Prefill(req, ctx)
        await _settle(lambda: rt.inflight == 0 and not servicer.queues)
        pinned = await _engine_settled(rt, lambda e: e.kv.num_pinned_blocks)
        return ctx.code, pinned, rt.inflight, servicer.pending_sends

    code, pinned, inflight, pending = asyncio.run(scenario())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (pinned, inflight, pending) == (0, 0, 0)
