"""The prefill worker under an engine hang (found by review, 2026-12-06).

1. A Prefill failed UNAVAILABLE when the hang was declared read its pins and removed its sink
   while the stuck step still ran; when that step pinned the request's first blocks, the
   output carrying the pin reached no sink and the blocks stayed pinned for good after the
   engine recovered. The final pin collection now runs on the engine thread after the abort.
2. Calls waiting for admission behind the stuck step, and calls arriving after the hang was
   declared, were not failed: they waited until the decode worker's prefill timeout.
3. A call cancelled while the engine is stalled waited for the engine's abort without bound,
   holding its handler and ``rt.inflight`` (a drain ran its whole timeout).

The engine is stalled with events, never with timing, and the hang is declared as
``_watch_hang`` declares it (``rt.hung`` set, the ``on_hang`` hooks called).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import grpc
import pytest

import shared.worker.service as service
from kvtransfer.errors import KVTransferError
from prefill_service.server import PrefillServicer
from shared.engine.sampling_params import SamplingParams
from shared.proto import pdserve_pb2 as pb
from tests.services.inprocess_worker import standalone_runtime

WAIT_S = 30.0  # generous: a loaded 2-core CI machine


class _Gate:
    """Every engine step waits until ``open`` is set; ``entered`` tells one began."""

    def __init__(self, rt) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        real_step = rt.engine.step

        def step():
            self.entered.set()
            self.open.wait(120)
            return real_step()

        rt.engine.step = step


@pytest.fixture
def prefill_runtime(tiny_llama):
    rt = standalone_runtime(tiny_llama, "prefill")
    releases: list[threading.Event] = []
    rt.test_releases = releases  # events the teardown sets (a stuck step or command)
    rt.loop.start()
    yield rt
    for ev in releases:
        ev.set()
    rt.loop.stop()


def _gate(rt) -> _Gate:
    gate = _Gate(rt)
    rt.test_releases.append(gate.open)
    return gate


class _Handle:
    """A fake SendHandle; ``settle_on_cancel=False``: a cancel that does not settle."""

    def __init__(self, tid, n, settle_on_cancel=True):
        self.transfer_id = tid
        self._f = concurrent.futures.Future()
        self._err = None
        self.checksums = [None] * n
        self.bytes_sent = 0
        self.sent = []
        self.settle_on_cancel = settle_on_cancel

    @property
    def done(self):
        return self._f.done()

    def send_blocks(self, src, first):
        self.sent.append((list(src), first))

    def finish(self, note=b""):
        pass

    def end(self):
        if not self._f.done():
            self._err = KVTransferError("cancelled")
            self._f.set_result("cancelled")

    def cancel(self):
        if self.settle_on_cancel:
            self.end()

    def raise_for_state(self):
        if self._err is not None:
            raise self._err

    def __await__(self):
        return asyncio.shield(asyncio.wrap_future(self._f)).__await__()


class _Sender:
    stats = None

    def __init__(self, settle_on_cancel=True):
        self.handles = []
        self.settle_on_cancel = settle_on_cancel

    def open(self, tid, addr, dst, timeout_s):
        h = _Handle(tid, len(dst), self.settle_on_cancel)
        self.handles.append(h)
        return h


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self):
        self.code = None
        self.details = None

    async def abort(self, code, details="", trailing_metadata=()):
        self.code, self.details = code, details
        raise _Aborted(code, details)


def _request(rid: str, n_blocks: int, bs: int) -> pb.PrefillRequest:
    return pb.PrefillRequest(
        request_id=rid,
        prompt_token_ids=list(range(5, 5 + n_blocks * bs)),
        sampling=pb.SamplingParams(temperature=0, max_tokens=8),
        decode_kv_address=b"x",
        decode_worker_id="d",
        first_block_index=0,
        dst_block_ids=list(range(n_blocks)),
        transfer_id=rid + ":t",
    )


def _declare_hang(rt) -> None:
    """What ``_watch_hang`` does when the engine made no progress for the hang timeout."""
    rt.hung = True
    for fail_inflight in rt.on_hang:
        fail_inflight("the engine made no progress for 1 s")


async def _settle(done, timeout: float = WAIT_S) -> bool:
    end = time.monotonic() + timeout
    while not done() and time.monotonic() < end:
        await asyncio.sleep(0.05)
    return bool(done())


def _engine_state(e):
    """(blocks pinned, blocks not free, requests in the engine)"""
    return (e.kv.num_pinned_blocks, e.num_blocks - e.kv.pool.num_free_blocks, sorted(e.parents))


async def _engine_settled(rt, timeout: float = WAIT_S):
    """``_engine_state`` asked again until all is released, ``timeout`` at most."""
    end = time.monotonic() + timeout
    while True:
        got = await asyncio.wrap_future(rt.loop.submit(_engine_state))
        if not any(got) or time.monotonic() > end:
            return got
        await asyncio.sleep(0.05)


async def _ended(task) -> None:
    """Wait (bounded) for a Prefill task; its outcome (status or cancel) is not asked here."""
    await asyncio.wait({task}, timeout=WAIT_S)
    assert task.done(), "the Prefill handler did not end"
    if not task.cancelled():
        task.exception()  # retrieved


def _servicer_state(rt, sv):
    return dict(
        inflight=rt.inflight,
        pending_sends=sv.pending_sends,
        queues=list(sv.queues),
        sinks=list(rt.loop._sinks),
    )


CLEAN = dict(inflight=0, pending_sends=0, queues=[], sinks=[])


# ---- 1. the pins made by the step that was stuck ------------------------------------------


def test_a_step_that_pins_after_the_hang_failed_the_call_leaks_no_pin(prefill_runtime):
    rt = prefill_runtime
    gate = _gate(rt)

    async def scenario():
        sender = _Sender()
        sv = PrefillServicer(rt, sender, transfer_timeout_s=60.0)
        ctx = _Context()
        task = asyncio.ensure_future(sv.Prefill(_request("p1", 3, rt.engine.block_size), ctx))
        assert await _settle(gate.entered.is_set), "p1's step never began"
        _declare_hang(rt)  # the step is stuck: p1 fails UNAVAILABLE at once
        await _ended(task)
        code = ctx.code
        inflight = rt.inflight
        gate.open.set()  # the stuck step ends: it pins p1's blocks and hands them over
        rt.hung = False
        await _settle(lambda: not rt.loop._sinks)
        engine = await _engine_settled(rt)
        return code, inflight, sender.handles[0].sent, engine, _servicer_state(rt, sv)

    code, inflight, sent, engine, state = asyncio.run(scenario())
    assert code == grpc.StatusCode.UNAVAILABLE
    assert inflight == 0
    assert engine == (0, 0, []), f"(pinned, not free, requests) after the recovery: {engine}"
    assert sent, "the stuck step handed p1's blocks over (and pinned them) after the call ended"
    assert state == CLEAN, state


def test_pins_made_after_the_hang_drop_only_once_the_transfer_is_terminal(
    prefill_runtime, monkeypatch
):
    rt = prefill_runtime
    gate = _gate(rt)
    monkeypatch.setattr(service, "CANCEL_SETTLE_S", 0.2)  # the cancel does not settle in time

    async def scenario():
        sender = _Sender(settle_on_cancel=False)
        sv = PrefillServicer(rt, sender, transfer_timeout_s=60.0)
        ctx = _Context()
        task = asyncio.ensure_future(sv.Prefill(_request("p1", 3, rt.engine.block_size), ctx))
        assert await _settle(gate.entered.is_set), "p1's step never began"
        _declare_hang(rt)
        await _ended(task)
        gate.open.set()
        rt.hung = False
        await _settle(lambda: not rt.loop._sinks)  # the abort ran on the engine thread
        # the transfer may still read the blocks: they stay pinned
        while_sending = await asyncio.wrap_future(rt.loop.submit(_engine_state))
        sender.handles[0].end()  # the transfer becomes terminal
        engine = await _engine_settled(rt)
        return ctx.code, sender.handles[0].sent, while_sending, engine, _servicer_state(rt, sv)

    code, sent, while_sending, engine, state = asyncio.run(scenario())
    assert code == grpc.StatusCode.UNAVAILABLE
    assert while_sending[0] == 3 and while_sending[2] == [], while_sending
    assert engine == (0, 0, []), engine
    assert sent
    assert state == CLEAN, state


# ---- 2. calls waiting for admission, and new calls, during a hang ---------------------------


def _add_busy(rt) -> None:
    rt.loop.submit(
        lambda e: e.add_request("busy", [3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=50))
    )


async def _abort_busy(rt) -> None:
    await asyncio.wrap_future(rt.loop.submit(lambda e: e.abort_request(["busy"])))


def test_a_prefill_arriving_while_the_engine_is_hung_is_refused_at_once(prefill_runtime):
    rt = prefill_runtime
    gate = _gate(rt)

    async def scenario():
        _add_busy(rt)
        assert await _settle(gate.entered.is_set), "the busy step never began"
        _declare_hang(rt)
        sender = _Sender()
        sv = PrefillServicer(rt, sender, transfer_timeout_s=60.0)
        ctx = _Context()
        task = asyncio.ensure_future(sv.Prefill(_request("p2", 2, rt.engine.block_size), ctx))
        await _ended(task)
        opened = len(sender.handles)
        gate.open.set()
        rt.hung = False
        await _abort_busy(rt)
        await _settle(lambda: not rt.loop._sinks)
        engine = await _engine_settled(rt)
        return ctx.code, opened, engine, _servicer_state(rt, sv)

    code, opened, engine, state = asyncio.run(scenario())
    assert code == grpc.StatusCode.UNAVAILABLE
    assert opened == 0, "no KV transfer is opened for a call refused at entry"
    assert engine == (0, 0, []), engine
    assert state == CLEAN, state


def test_a_prefill_queued_behind_the_stuck_step_fails_when_the_hang_is_declared(prefill_runtime):
    rt = prefill_runtime
    gate = _gate(rt)

    async def scenario():
        _add_busy(rt)
        assert await _settle(gate.entered.is_set), "the busy step never began"
        sender = _Sender()
        sv = PrefillServicer(rt, sender, transfer_timeout_s=60.0)
        ctx = _Context()
        task = asyncio.ensure_future(sv.Prefill(_request("p2", 2, rt.engine.block_size), ctx))
        assert await _settle(lambda: bool(sv.queues)), "p2 was never submitted"
        await asyncio.sleep(0.05)  # p2 waits for its admission (its add is queued)
        _declare_hang(rt)
        await _ended(task)
        code, inflight = ctx.code, rt.inflight
        gate.open.set()
        rt.hung = False
        await _settle(lambda: not rt.loop._sinks)
        admitted = await asyncio.wrap_future(rt.loop.submit(lambda e: sorted(e.parents)))
        await _abort_busy(rt)
        engine = await _engine_settled(rt)
        return code, inflight, admitted, engine, _servicer_state(rt, sv)

    code, inflight, admitted, engine, state = asyncio.run(scenario())
    assert code == grpc.StatusCode.UNAVAILABLE
    assert inflight == 0
    assert admitted == ["busy"], f"p2's add was to be cancelled, not run: {admitted}"
    assert engine == (0, 0, []), engine
    assert state == CLEAN, state


def test_a_prefill_whose_add_runs_when_the_hang_is_declared_is_failed_then_aborted(
    prefill_runtime,
):
    rt = prefill_runtime
    in_add = threading.Event()
    release = threading.Event()
    rt.test_releases.append(release)
    real_admit = rt.admit

    def admit(e, n):  # engine thread: the add command itself is what hangs
        in_add.set()
        release.wait(120)
        real_admit(e, n)

    rt.admit = admit

    async def scenario():
        sender = _Sender()
        sv = PrefillServicer(rt, sender, transfer_timeout_s=60.0)
        ctx = _Context()
        task = asyncio.ensure_future(sv.Prefill(_request("p2", 2, rt.engine.block_size), ctx))
        assert await _settle(in_add.is_set), "p2's add never ran"
        _declare_hang(rt)
        await _ended(task)  # while its add still runs
        code, inflight = ctx.code, rt.inflight
        release.set()  # the add completes (p2 admitted), then the queued abort ends it
        rt.hung = False
        await _settle(lambda: not rt.loop._sinks)
        engine = await _engine_settled(rt)
        return code, inflight, engine, _servicer_state(rt, sv)

    code, inflight, engine, state = asyncio.run(scenario())
    assert code == grpc.StatusCode.UNAVAILABLE
    assert inflight == 0
    assert engine == (0, 0, []), engine
    assert state == CLEAN, state


# ---- 3. the bounded wait for the engine's abort -------------------------------------------


def test_the_abort_wait_is_bounded_by_default():
    assert PrefillServicer.abort_wait_s == 10.0  # as decode_service's _abort


def test_a_prefill_cancelled_while_the_engine_stalls_ends_within_its_abort_bound(prefill_runtime):
    rt = prefill_runtime
    gate = _gate(rt)

    async def scenario():
        sender = _Sender()
        sv = PrefillServicer(rt, sender, transfer_timeout_s=60.0)
        sv.abort_wait_s = 0.5  # the bound under test (10 s in production)
        ctx = _Context()
        task = asyncio.ensure_future(sv.Prefill(_request("p1", 3, rt.engine.block_size), ctx))
        assert await _settle(gate.entered.is_set), "p1's step never began"
        task.cancel()  # D cancels the call while the engine is stalled (no hang declared)
        await _ended(task)
        stalled = not gate.open.is_set()
        during = _servicer_state(rt, sv)
        gate.open.set()  # the stalled step ends: it pins p1's blocks after the handler left
        await _settle(lambda: not rt.loop._sinks)
        engine = await _engine_settled(rt)
        return stalled, during, sender.handles[0].sent, engine, _servicer_state(rt, sv)

    stalled, during, sent, engine, state = asyncio.run(scenario())
    assert stalled
    assert during["inflight"] == 0 and during["queues"] == [], during
    assert engine == (0, 0, []), engine
    assert sent
    assert state == CLEAN, state


def test_a_prefill_waiting_for_its_abort_stops_waiting_when_the_hang_is_declared(
    prefill_runtime,
):
    rt = prefill_runtime
    gate = _gate(rt)

    async def scenario():
        sender = _Sender()
        sv = PrefillServicer(rt, sender, transfer_timeout_s=60.0)
        sv.abort_wait_s = 600.0  # far beyond this test's waits: only the hang ends the wait
        in_abort = asyncio.Event()  # set as the handler submits the abort it then waits for
        real_abort_and_release = sv._abort_and_release

        def abort_and_release(*a):
            in_abort.set()
            return real_abort_and_release(*a)

        sv._abort_and_release = abort_and_release
        ctx = _Context()
        task = asyncio.ensure_future(sv.Prefill(_request("p1", 3, rt.engine.block_size), ctx))
        assert await _settle(gate.entered.is_set), "p1's step never began"
        task.cancel()  # cancelled while the engine stalls: the handler waits for the abort
        # it submitted the abort and waits for it (a hang declared before would skip the wait)
        await asyncio.wait_for(in_abort.wait(), WAIT_S)
        await asyncio.sleep(0)  # (its next step: into that wait)
        _declare_hang(rt)  # ... the stall is declared a hang: the wait ends
        await _ended(task)
        during = _servicer_state(rt, sv)
        gate.open.set()
        rt.hung = False
        await _settle(lambda: not rt.loop._sinks)
        engine = await _engine_settled(rt)
        return during, engine, _servicer_state(rt, sv)

    during, engine, state = asyncio.run(scenario())
    assert during["inflight"] == 0 and during["queues"] == [], during
    assert engine == (0, 0, []), engine
    assert state == CLEAN, state
