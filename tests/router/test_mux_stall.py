"""``shared/proto/mux.py``: a decode worker whose event loop is stuck fails its shared
``GenerateMux`` call within ``--worker-stall-timeout``, so every request on it fails over.

Keepalive does not see such a worker (gRPC's C core answers the pings without the Python
loop), and the engine-hang watchdog does not either (the engine thread runs on). The worker's
call sends an empty ``MuxDown`` when it opens (the hello) and after ``HEARTBEAT_S`` of
silence, from its event loop; a router that saw one fails a call with requests on it that got
no message for ``stall_timeout_s``. A worker that sends no hello (an older build) is never
timed out, and a healthy worker whose request produces nothing for longer than the timeout is
not either (its heartbeats keep coming).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable

import grpc
import pytest

from router.config import RouterConfig
from router.workers import WorkerPool
from shared.pauses import NOTICEABLE_S, PauseLog
from shared.proto import mux as mux_mod
from shared.proto import pdserve_pb2 as pb
from shared.proto import pdserve_pb2_grpc as pb_grpc
from shared.proto.failure import FAILURE_KEY, FAILURE_STALL
from shared.proto.mux import MuxClient, serve_mux
from tests.ports import free_port
from tests.router.test_generate_mux import Scripted, _client, _drain, _server
from tests.router.test_mux_start_cancel import _Ups

STALL_S = 0.3
BEAT_S = 0.05
WAIT_S = 5  # bounds every wait: a regression fails instead of hanging
# the stall timeout where a test checks that a call is NOT failed: 20 heartbeats (BEAT_S) of
# margin, so a loaded machine's scheduling delays cannot fail a healthy call
QUIET_STALL_S = 1.0
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CANCEL = object()


class _FakeCall:
    """The shared grpc call under a MuxClient, driven by the test: ``send`` a MuxDown as the
    worker would; ``cancel`` ends a pending ``read`` as grpc's does."""

    def __init__(self) -> None:
        self._q: asyncio.Queue = asyncio.Queue()
        self.written: list[pb.MuxUp] = []
        self.cancelled = False

    def send(self, down: pb.MuxDown) -> None:
        self._q.put_nowait(down)

    async def write(self, up: pb.MuxUp) -> None:
        self.written.append(up)

    async def read(self):
        item = await self._q.get()
        if item is _CANCEL:
            self._q.put_nowait(_CANCEL)
            raise asyncio.CancelledError()
        return item

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._q.put_nowait(_CANCEL)


def _chunk(rid: str, token: int) -> pb.MuxDown:
    return pb.MuxDown(
        chunks=[pb.GenerateChunk(request_id=rid, outputs=[pb.SeqDelta(index=0, token_ids=[token])])]
    )


def _ok(rid: str) -> pb.MuxDown:
    return pb.MuxDown(ends=[pb.MuxEnd(request_id=rid, code=grpc.StatusCode.OK.value[0])])


async def _other_tasks() -> set[asyncio.Task]:
    for _ in range(3):  # let cancelled tasks finish
        await asyncio.sleep(0)
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


def _call_factory() -> tuple[list[_FakeCall], Callable[[], _FakeCall]]:
    """A ``method`` for MuxClient that opens a new :class:`_FakeCall` each time, and the list
    of the calls it opened."""
    calls: list[_FakeCall] = []

    def method() -> _FakeCall:
        calls.append(_FakeCall())
        return calls[-1]

    return calls, method


async def _stalled_read(call) -> tuple[grpc.aio.AioRpcError, float]:
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await asyncio.wait_for(call.read(), WAIT_S)
    return ei.value, time.monotonic() - t0


# ---- router side, over a fake call ----------------------------------------------------------


@pytest.mark.unit
def test_a_worker_silent_after_its_hello_fails_the_call_and_the_next_call_is_watched_at_once():
    async def scenario():
        calls, method = _call_factory()
        client = MuxClient(method, "d:1", stall_timeout_s=STALL_S)
        m = client.start(pb.GenerateRequest(request_id="r1"))
        calls[0].send(pb.MuxDown())  # the hello, then nothing: the worker's loop is stuck
        err, took = await _stalled_read(m)
        # the same worker, still stuck, never runs the new call's handler (no hello): watched
        # from its start
        m2 = client.start(pb.GenerateRequest(request_id="r2"))
        err2, took2 = await _stalled_read(m2)
        inflight = client.inflight
        await client.close()
        return err, took, err2, took2, calls, client.generation, inflight, await _other_tasks()

    err, took, err2, took2, calls, generation, inflight, left = asyncio.run(scenario())
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "no message from the worker at d:1" in err.details()
    # marked as the router's own stall verdict: not a call a pause of the router broke
    assert (FAILURE_KEY, FAILURE_STALL) in tuple(err.trailing_metadata())
    assert "event loop is stuck" in err.details()
    assert STALL_S * 0.9 <= took < WAIT_S / 2, took
    assert calls[0].cancelled  # the shared call is cancelled (the worker aborts them all)
    assert err2.code() == grpc.StatusCode.UNAVAILABLE and STALL_S * 0.9 <= took2 < WAIT_S / 2
    assert generation == 2 and len(calls) == 2 and calls[1].cancelled
    assert inflight == 0
    assert not left  # no watchdog, reader or writer left behind


@pytest.mark.unit
def test_a_worker_without_hello_is_never_timed_out():
    async def scenario():
        call = _FakeCall()
        client = MuxClient(lambda: call, "d:1", stall_timeout_s=STALL_S)
        m = client.start(pb.GenerateRequest(request_id="r1"))
        await asyncio.sleep(STALL_S * 4)  # an older build: no hello, no heartbeat
        alive = not m.done() and not call.cancelled
        call.send(_chunk("r1", 7))
        call.send(_ok("r1"))
        first = await asyncio.wait_for(m.read(), WAIT_S)
        end = await asyncio.wait_for(m.read(), WAIT_S)
        watchdog = client._watchdog
        await client.close()
        return alive, list(first.outputs[0].token_ids), end, watchdog, await _other_tasks()

    alive, tokens, end, watchdog, left = asyncio.run(scenario())
    assert alive and tokens == [7] and end is grpc.aio.EOF
    assert watchdog is None  # never started for it
    assert not left


@pytest.mark.unit
def test_an_older_build_answering_a_watched_call_turns_the_watchdog_off():
    """After a stall the next call is watched from its start; if an older build answers it
    (its first message is not a hello: the worker was replaced), the watchdog is off again."""

    async def scenario():
        calls, method = _call_factory()
        client = MuxClient(method, "d:1", stall_timeout_s=STALL_S)
        m = client.start(pb.GenerateRequest(request_id="r1"))
        calls[0].send(pb.MuxDown())
        await _stalled_read(m)
        m2 = client.start(pb.GenerateRequest(request_id="r2"))
        calls[1].send(_chunk("r2", 1))  # no hello first: an older build
        first = await asyncio.wait_for(m2.read(), WAIT_S)
        await asyncio.sleep(STALL_S * 3)
        alive = not m2.done() and not calls[1].cancelled
        await client.close()
        return list(first.outputs[0].token_ids), alive, await _other_tasks()

    tokens, alive, left = asyncio.run(scenario())
    assert tokens == [1] and alive and not left


@pytest.mark.unit
def test_an_idle_silent_call_is_not_failed_and_zero_turns_the_watchdog_off():
    async def scenario():
        idle_call = _FakeCall()
        idle = MuxClient(lambda: idle_call, "d:1", stall_timeout_s=STALL_S)
        m = idle.start(pb.GenerateRequest(request_id="r1"))
        idle_call.send(pb.MuxDown())
        idle_call.send(_ok("r1"))
        assert await asyncio.wait_for(m.read(), WAIT_S) is grpc.aio.EOF
        await asyncio.sleep(STALL_S * 3)  # silent, but nothing waits on the call
        idle_alive = not idle_call.cancelled
        off_call = _FakeCall()
        off = MuxClient(lambda: off_call, "d:2", stall_timeout_s=0)
        m2 = off.start(pb.GenerateRequest(request_id="r2"))
        off_call.send(pb.MuxDown())
        await asyncio.sleep(STALL_S * 3)
        off_alive = not m2.done() and not off_call.cancelled
        await idle.close()
        await off.close()
        return idle_alive, off_alive, await _other_tasks()

    idle_alive, off_alive, left = asyncio.run(scenario())
    assert idle_alive and off_alive and not left


@pytest.mark.unit
def test_heartbeats_keep_a_call_with_a_quiet_request_open():
    async def scenario():
        call = _FakeCall()
        client = MuxClient(lambda: call, "d:1", stall_timeout_s=QUIET_STALL_S)
        m = client.start(pb.GenerateRequest(request_id="r1"))
        call.send(pb.MuxDown())
        for _ in range(int(QUIET_STALL_S * 4 / BEAT_S)):  # a long prefill: heartbeats only
            await asyncio.sleep(BEAT_S)
            call.send(pb.MuxDown())
        call.send(_chunk("r1", 3))
        call.send(_ok("r1"))
        first = await asyncio.wait_for(m.read(), WAIT_S)
        end = await asyncio.wait_for(m.read(), WAIT_S)
        await client.close()
        return list(first.outputs[0].token_ids), end, call.cancelled, await _other_tasks()

    tokens, end, cancelled, left = asyncio.run(scenario())
    assert tokens == [3] and end is grpc.aio.EOF
    assert cancelled  # by close() only
    assert not left


def _pause_loop(seconds: float) -> None:
    """This process's event loop does not run for ``seconds`` and it uses no CPU meanwhile:
    what a SIGSTOP or a paused VM looks like from inside."""
    time.sleep(seconds)


@pytest.mark.unit
@pytest.mark.parametrize("knows_pauses", [True, False], ids=["pause-log", "no-pause-log"])
def test_a_pause_of_the_router_itself_is_not_the_workers_silence(knows_pauses):
    """The router paused longer than the stall timeout, its worker's chunk waiting meanwhile:
    on resume the stall timer (due first) used to fail the call before the reader got the
    chunk, failing every request on it and cooling a healthy worker down. With the router's
    ``PauseLog`` the paused time is not counted; without one (``knows_pauses`` False) the
    old behaviour is kept, which shows this scenario does reach the timer first."""
    pause_s = QUIET_STALL_S * 1.5 + NOTICEABLE_S  # counted as a pause, past the chunk

    async def scenario():
        pauses = PauseLog(period_s=0.05) if knows_pauses else None
        ticker = asyncio.ensure_future(pauses.run()) if pauses else None
        call = _FakeCall()
        client = MuxClient(lambda: call, "d:1", stall_timeout_s=QUIET_STALL_S, pauses=pauses)
        m = client.start(pb.GenerateRequest(request_id="r1"))
        call.send(pb.MuxDown())  # the hello: the call is watched
        await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        # the chunk "arrives" during the pause, after the stall timer fell due
        loop.call_later(
            QUIET_STALL_S * 1.5, lambda: (call.send(_chunk("r1", 7)), call.send(_ok("r1")))
        )
        loop.call_soon(_pause_loop, pause_s)
        try:
            first = await asyncio.wait_for(m.read(), WAIT_S)
        except grpc.aio.AioRpcError as e:
            first = e
        if ticker:
            ticker.cancel()
        await client.close()
        return first, call.cancelled

    first, cancelled = asyncio.run(scenario())
    if knows_pauses:
        assert not isinstance(first, grpc.aio.AioRpcError), first
        assert list(first.outputs[0].token_ids) == [7]
    else:
        assert isinstance(first, grpc.aio.AioRpcError)
        assert first.code() == grpc.StatusCode.UNAVAILABLE and "no message" in first.details()


# ---- worker side: serve_mux's hello and heartbeats -------------------------------------------


@pytest.mark.unit
def test_serve_mux_sends_a_hello_then_heartbeats_only_when_silent(monkeypatch):
    beat_s = 0.3  # 60 chunk gaps: a loaded machine's scheduling delays stay far below it
    monkeypatch.setattr(mux_mod, "HEARTBEAT_S", beat_s)

    async def handler(req, ctx):
        for _ in range(20):  # a chunk every 5 ms: no heartbeat is due meanwhile
            await asyncio.sleep(0.005)
            yield pb.GenerateChunk(request_id=req.request_id)

    async def scenario():
        ups = _Ups()
        stream = serve_mux(handler, ups)
        hello = await asyncio.wait_for(stream.__anext__(), WAIT_S)  # before any request
        ups.send(pb.MuxUp(start=[pb.GenerateRequest(request_id="a")]))
        busy: list[pb.MuxDown] = []
        while not (busy and busy[-1].ends):
            busy.append(await asyncio.wait_for(stream.__anext__(), WAIT_S))
        idle: list[float] = []  # when each heartbeat came, once the request ended
        while len(idle) < 4:
            down = await asyncio.wait_for(stream.__anext__(), WAIT_S)
            assert not down.chunks and not down.ends
            idle.append(time.monotonic())
        ups.close()
        rest = [d async for d in stream]
        return hello, busy, idle, rest, await _other_tasks()

    hello, busy, idle, rest, left = asyncio.run(scenario())
    assert not hello.chunks and not hello.ends  # the hello
    assert all(d.chunks or d.ends for d in busy)  # no heartbeat while outputs flow
    assert sum(len(d.chunks) for d in busy) == 20
    gaps = [b - a for a, b in zip(idle, idle[1:])]
    assert min(gaps) >= beat_s * 0.8, gaps  # one per HEARTBEAT_S of silence, no more
    assert all(not d.chunks and not d.ends for d in rest)
    assert not left  # the call ended: its heartbeat task too


@pytest.mark.unit
def test_serve_mux_sends_no_hello_on_a_call_opened_while_closing():
    async def scenario():
        ups = _Ups()
        closing = asyncio.Event()
        closing.set()
        ups.send(pb.MuxUp(start=[pb.GenerateRequest(request_id="late")]))

        async def collect():
            return [d async for d in serve_mux(Scripted().Generate, ups, closing)]

        downs = await asyncio.wait_for(collect(), WAIT_S)
        return downs, await _other_tasks()

    downs, left = asyncio.run(scenario())
    assert downs == [] and not left


# ---- both sides, over real gRPC calls ---------------------------------------------------------


class _OldBuild(Scripted):
    """A worker built before heartbeats: its GenerateMux sends no empty MuxDown."""

    async def GenerateMux(self, request_iterator, context):
        async for down in serve_mux(self.Generate, request_iterator):
            if down.chunks or down.ends:
                yield down


class _Slow(Scripted):
    """``slow-S``: one chunk after S seconds of nothing (a long prefill, a long engine turn)."""

    async def Generate(self, request, context):
        rid = request.request_id
        if rid.startswith("slow"):
            self.started.add(rid)
            await asyncio.sleep(float(rid.split("-")[1]))
            yield pb.GenerateChunk(request_id=rid, outputs=[pb.SeqDelta(index=0, token_ids=[9])])
            return
        async for chunk in super().Generate(request, context):
            yield chunk


async def _grpc_pair(svc, stall_s: float):
    port = free_port()
    server = await _server(svc, port)
    ch, client = _client(port)
    client.stall_timeout_s = stall_s
    return server, ch, client


@pytest.mark.integration
def test_a_healthy_worker_with_a_quiet_request_is_not_failed(monkeypatch):
    monkeypatch.setattr(mux_mod, "HEARTBEAT_S", BEAT_S)

    async def scenario():
        server, ch, client = await _grpc_pair(_Slow(), QUIET_STALL_S)
        m = client.start(pb.GenerateRequest(request_id=f"slow-{QUIET_STALL_S * 4}"))
        tokens = await _drain(m)
        generation, watched = client.generation, client._watchdog is not None
        await client.close()
        await ch.close()
        await server.stop(0)
        return tokens, generation, watched, client._watchdog

    tokens, generation, watched, dog = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert tokens == [9] and generation == 1
    assert watched  # the watchdog ran all along (the worker's hello armed it)
    assert dog is None


@pytest.mark.integration
def test_an_older_worker_build_is_never_timed_out():
    async def scenario():
        server, ch, client = await _grpc_pair(_OldBuild(), STALL_S)
        svc_hang = client.start(pb.GenerateRequest(request_id="hang-1"))
        await asyncio.sleep(STALL_S * 4)
        alive = not svc_hang.done()
        svc_hang.cancel()
        watchdog = client._watchdog
        await client.close()
        await ch.close()
        await server.stop(0)
        return alive, watchdog, client.generation

    alive, watchdog, generation = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert alive and watchdog is None and generation == 1


_STUCK_WORKER = r"""
import asyncio, sys, time
import grpc
from shared.proto import mux, pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc
from shared.proto.mux import serve_mux

mux.HEARTBEAT_S = float(sys.argv[1])


class Worker(pb_grpc.DecodeWorkerServicer):
    async def Generate(self, request, context):
        rid = request.request_id
        if rid.startswith("block"):
            await asyncio.sleep(0.1)  # the hello and a heartbeat or two went out
            time.sleep(60)  # a bug blocks the event loop; gRPC's C core runs on
        if rid.startswith("wait"):
            await asyncio.sleep(60)
        yield pb.GenerateChunk(request_id=rid, outputs=[pb.SeqDelta(index=0, token_ids=[1])])

    async def GenerateMux(self, request_iterator, context):
        async for down in serve_mux(self.Generate, request_iterator):
            yield down


async def main():
    server = grpc.aio.server()
    pb_grpc.add_DecodeWorkerServicer_to_server(Worker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


asyncio.run(main())
"""


@pytest.mark.integration
def test_a_worker_whose_event_loop_is_blocked_fails_every_request_on_its_call():
    """A real worker process whose event loop blocks (``time.sleep`` in a handler) after its
    hello: both requests on the call fail with UNAVAILABLE within the stall timeout, and so
    does a request the router sends there again (on a new call, which the stuck worker never
    answers)."""

    async def scenario():
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _STUCK_WORKER,
            str(BEAT_S),
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None
            port = int(await asyncio.wait_for(proc.stdout.readline(), 30))
            ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")  # no keepalive here
            stub = pb_grpc.DecodeWorkerStub(ch)
            # the first request must NOT fail: a real process on a loaded machine needs the
            # quiet margin
            client = MuxClient(lambda: stub.GenerateMux(), f"127.0.0.1:{port}", QUIET_STALL_S)
            ok = client.start(pb.GenerateRequest(request_id="fine-1"))
            assert await _drain(ok) == [1]  # the call works; the worker heartbeats
            other = client.start(pb.GenerateRequest(request_id="wait-2"))
            block = client.start(pb.GenerateRequest(request_id="block-1"))
            errors = [await _stalled_read(c) for c in (other, block)]
            again = client.start(pb.GenerateRequest(request_id="fine-3"))
            errors.append(await _stalled_read(again))
            generation = client.generation
            await client.close()
            await ch.close()
            return errors, generation
        finally:
            proc.kill()
            await proc.wait()

    errors, generation = asyncio.run(asyncio.wait_for(scenario(), 60))
    for err, took in errors:
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert "event loop is stuck" in err.details()
        assert took < WAIT_S / 2, took
    assert generation == 2


# ---- configuration ----------------------------------------------------------------------------


def _parse(*argv: str) -> RouterConfig:
    parser = argparse.ArgumentParser()
    RouterConfig.add_cli_args(parser)
    return RouterConfig.from_cli_args(
        parser.parse_args(["--model", "m", "--decode-workers", "h:1", *argv])
    )


@pytest.mark.unit
def test_worker_stall_timeout_flag_reaches_the_mux_clients(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert _parse().worker_stall_timeout_s == 10.0
    assert _parse("--worker-stall-timeout", "0").worker_stall_timeout_s == 0.0
    assert _parse("--worker-stall-timeout=2.5").worker_stall_timeout_s == 2.5
    with pytest.raises(ValueError, match="--worker-stall-timeout"):
        _parse("--worker-stall-timeout=-1")

    async def scenario():
        pool = WorkerPool(model="m", reader=None, static_decode=["h:1"], mux_stall_timeout_s=2.5)
        try:
            return pool.decode_mux("h:1").stall_timeout_s
        finally:
            await pool.close()

    assert asyncio.run(scenario()) == 2.5


# ---- through the router -----------------------------------------------------------------------


@pytest.mark.integration
def test_the_router_resumes_a_stream_from_a_frozen_worker_within_the_stall_timeout(
    make_worker, make_router, router_config, tiny_model, caplog
):
    """A frozen worker (SIGSTOP: its event loop runs no more) sends no heartbeat: the router
    fails its shared call after ``--worker-stall-timeout`` (before keepalive's 3-6 s would)
    and resumes the stream on the other worker, nothing lost or repeated."""
    import signal
    from dataclasses import replace

    from router_harness import MODEL_NAME, load_fake_worker_module

    from router.tokenizer import RouterTokenizer

    fw = load_fake_worker_module()
    tok = RouterTokenizer.from_model_dir(tiny_model)
    doomed = make_worker("doomed", token_delay=0.05)
    backup = make_worker("backup", token_delay=0.01, report_waiting=3)
    r = make_router(replace(router_config, decode_stream="mux", worker_stall_timeout_s=1.5))
    r.wait_workers(2)
    r.wait_waiting("backup", 3)  # so the other one is picked first
    prompt = "a story told by a worker that freezes"
    stream = r.openai().completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=40,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = []
    try:
        for c in stream:
            chunks.append(c)
            if len(chunks) == 1:
                os.kill(doomed.proc.pid, signal.SIGSTOP)
    finally:
        os.kill(doomed.proc.pid, signal.SIGCONT)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    expected, _ = fw.expected_output(tok.encode(prompt), max_tokens=40, vocab=2048, ignore_eos=True)
    assert text == tok.decode(expected)  # nothing lost, nothing repeated
    assert r.metric("pdserve:router_retries_total") == 1
    assert backup.stats().prefix_cache_queries == 1  # the resumed attempt went there
    assert "event loop is stuck" in caplog.text  # the stall watchdog, not keepalive
