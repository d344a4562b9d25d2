"""``shared/proto/mux.py``: a request cancelled as soon as it was started (a client that leaves
at once), on both sides of ``GenerateMux``.

- Router: the writer batches what was sent in one event-loop turn; a batched message must
  never change the order of a start and a cancel of one request id (the worker applies a
  message's starts before its cancels).
- Worker: a handler task cancelled before its first step (its coroutine body and ``finally``
  never run) must still leave the call's bookkeeping: its id can be started again, and the
  call ends once the router half-closed (or the worker drains) with nothing running.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shared.proto import pdserve_pb2 as pb
from shared.proto.mux import GenerateMuxMixin, MuxClient, _merged, serve_mux
from tests.router.test_generate_mux import Scripted, _all_started, _drain, _pair, _run

WAIT_S = 10  # generous: "the call ends" is the state asserted, not how fast


def _ops(ups: list[pb.MuxUp]) -> list[tuple[str, str]]:
    """The (op, id) sequence a worker applies for ``ups``: each message's starts, then its
    cancels."""
    out: list[tuple[str, str]] = []
    for u in ups:
        out += [("start", r.request_id) for r in u.start]
        out += [("cancel", rid) for rid in u.cancel]
    return out


def _no_id_in_both(ups: list[pb.MuxUp]) -> bool:
    return all(not {r.request_id for r in u.start} & set(u.cancel) for u in ups)


# ---- router: _merged / MuxClient keep starts and cancels of one id in order ----------------


@pytest.mark.unit
def test_merged_keeps_a_cancel_before_a_later_start_of_the_same_id():
    ups = [pb.MuxUp(cancel=["x"]), pb.MuxUp(start=[pb.GenerateRequest(request_id="x")])]
    out = _merged(ups)
    assert _ops(out) == [("cancel", "x"), ("start", "x")]
    assert _no_id_in_both(out)


@pytest.mark.unit
def test_merged_never_carries_a_start_and_a_cancel_of_one_id_in_one_message():
    ups = [
        pb.MuxUp(start=[pb.GenerateRequest(request_id="r1")]),
        pb.MuxUp(cancel=["r1"]),
        pb.MuxUp(start=[pb.GenerateRequest(request_id="r1")]),  # the id reused after it
        pb.MuxUp(cancel=["r1"]),
    ]
    out = _merged(ups)
    assert _ops(out) == [("start", "r1"), ("cancel", "r1"), ("start", "r1"), ("cancel", "r1")]
    assert _no_id_in_both(out)


@pytest.mark.unit
def test_merged_still_merges_starts_and_cancels_of_different_ids():
    ups = [
        pb.MuxUp(start=[pb.GenerateRequest(request_id="a")]),
        pb.MuxUp(cancel=["old"]),
        pb.MuxUp(start=[pb.GenerateRequest(request_id="b")]),
        pb.MuxUp(cancel=["a2"]),
    ]
    out = _merged(ups)
    assert len(out) == 1
    assert [r.request_id for r in out[0].start] == ["a", "b"]
    assert list(out[0].cancel) == ["old", "a2"]


class _FakeCall:
    """The shared grpc call under a MuxClient: records what its writer sends."""

    def __init__(self) -> None:
        self.written: list[pb.MuxUp] = []

    async def write(self, up: pb.MuxUp) -> None:
        self.written.append(up)

    async def read(self):
        await asyncio.Event().wait()

    def cancel(self) -> None:
        pass


@pytest.mark.unit
def test_client_start_then_cancel_in_one_turn_is_written_in_that_order():
    async def scenario():
        call = _FakeCall()
        client = MuxClient(lambda: call, "d:1")
        m = client.start(pb.GenerateRequest(request_id="r1"))
        client.start(pb.GenerateRequest(request_id="r2"))
        assert m.cancel()  # the client left at once: same event-loop turn as its start
        for _ in range(WAIT_S * 100):
            if len(_ops(call.written)) >= 3:
                break
            await asyncio.sleep(0.01)
        await client.close()
        return call.written

    written = asyncio.run(scenario())
    assert _ops(written) == [("start", "r1"), ("start", "r2"), ("cancel", "r1")]
    assert _no_id_in_both(written)


# ---- worker: serve_mux cleans up a task cancelled before it ran -----------------------------


class _Ups:
    """A router's side of a mux call, driven by the test: ``send`` a MuxUp, ``close`` to
    half-close."""

    def __init__(self) -> None:
        self._q: asyncio.Queue[pb.MuxUp | None] = asyncio.Queue()

    def send(self, up: pb.MuxUp) -> None:
        self._q.put_nowait(up)

    def close(self) -> None:
        self._q.put_nowait(None)

    async def __aiter__(self):
        while (up := await self._q.get()) is not None:
            yield up


class _Handler:
    """``Generate``: one chunk per request, once ``go`` is set; records the ids it ran for."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.ran: list[str] = []

    async def __call__(self, req, ctx):
        self.ran.append(req.request_id)
        await self.go.wait()
        yield pb.GenerateChunk(request_id=req.request_id, finished=True)


async def _collect(stream, downs: list[pb.MuxDown]) -> None:
    async for d in stream:
        downs.append(d)


def _ends(downs: list[pb.MuxDown]) -> list[tuple[str, int]]:
    return [(e.request_id, e.code) for d in downs for e in d.ends]


@pytest.mark.unit
@pytest.mark.parametrize("one_message", [True, False], ids=["one-message", "back-to-back"])
def test_worker_cleans_up_a_request_cancelled_before_its_handler_ran(one_message):
    async def scenario():
        handler = _Handler()
        handler.go.set()
        ups = _Ups()
        downs: list[pb.MuxDown] = []
        call = asyncio.ensure_future(_collect(serve_mux(handler, ups), downs))
        a = pb.GenerateRequest(request_id="a")
        if one_message:  # what a router that merged them sent
            ups.send(pb.MuxUp(start=[a], cancel=["a"]))
        else:  # both already there when the worker reads: no turn for the task in between
            ups.send(pb.MuxUp(start=[a]))
            ups.send(pb.MuxUp(cancel=["a"]))
        for _ in range(5):  # the cancelled start is fully processed
            await asyncio.sleep(0.01)
        ups.send(pb.MuxUp(start=[a]))  # a new request with that id
        while not _ends(downs):  # bounded by the wait_for below
            await asyncio.sleep(0.01)
        ups.close()  # the router half-closes: nothing runs, so the call ends
        await asyncio.wait_for(call, WAIT_S)
        return handler.ran, downs

    ran, downs = asyncio.run(asyncio.wait_for(scenario(), 3 * WAIT_S))
    # the id is free again (no ALREADY_EXISTS) and the new request ended OK; the cancelled
    # one sends no end (the router no longer waits for one), as for any cancel
    assert _ends(downs) == [("a", grpc.StatusCode.OK.value[0])]
    assert [c.request_id for d in downs for c in d.chunks] == ["a"]
    assert ran == ["a"]  # only the second start's handler ran


class _Draining(GenerateMuxMixin):
    def __init__(self, handler: _Handler) -> None:
        self.Generate = handler


@pytest.mark.unit
def test_a_draining_worker_closes_a_call_whose_only_request_was_cancelled_before_it_ran():
    async def scenario():
        svc = _Draining(_Handler())
        ups = _Ups()  # never half-closed: the router keeps its call open
        downs: list[pb.MuxDown] = []
        call = asyncio.ensure_future(_collect(svc.GenerateMux(ups, None), downs))
        ups.send(pb.MuxUp(start=[pb.GenerateRequest(request_id="a")], cancel=["a"]))
        while svc.open_mux_calls == 0:
            await asyncio.sleep(0.01)
        for _ in range(5):
            await asyncio.sleep(0.01)
        left = await svc.close_mux_calls(timeout_s=WAIT_S)
        await asyncio.wait_for(call, WAIT_S)
        return left, downs, svc.Generate.ran

    left, downs, ran = asyncio.run(asyncio.wait_for(scenario(), 3 * WAIT_S))
    assert left == 0 and _ends(downs) == [] and ran == []


# ---- both sides, over a real gRPC call ------------------------------------------------------


@pytest.mark.integration
def test_a_request_cancelled_at_once_frees_its_id_on_the_worker():
    async def scenario():
        svc = Scripted()
        async with _pair(svc) as mux:
            first = mux.start(pb.GenerateRequest(request_id="tok-1-x"))
            assert first.cancel()  # the client left at once
            again = mux.start(pb.GenerateRequest(request_id="tok-1-x"))  # the id reused
            other = mux.start(pb.GenerateRequest(request_id="tok-1-y"))
            await _all_started(svc, 2)
            svc.step.set()
            return await _drain(again), await _drain(other), mux.inflight

    again, other, inflight = _run(scenario)
    assert again == [0] and other == [0] and inflight == 0
