"""``shared/proto/mux.py``: many Generate streams over one ``GenerateMux`` call, over a real
in-process gRPC server whose ``Generate`` is scripted per request id. The router's own
behaviour over it (failover, slow readers, stop strings, deadlines) is what the rest of
``tests/router`` checks, with both ``--decode-stream`` modes where it matters."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from shared.proto import pdserve_pb2 as pb
from shared.proto import pdserve_pb2_grpc as pb_grpc
from shared.proto.failure import FAILURE_KEY, FAILURE_REQUEST
from shared.proto.mux import GenerateMuxMixin, MuxClient, serve_mux
from tests.ports import free_port

pytestmark = pytest.mark.integration


class Scripted(pb_grpc.DecodeWorkerServicer):
    """``Generate`` by request id prefix: ``tok-K``: K chunks, each once ``step`` is set
    (all streams waiting on one step become ready together, as one engine step's outputs do);
    ``bad``: aborts INVALID_ARGUMENT with the request-failure metadata; ``hang``: waits until
    cancelled; ``boom``: raises."""

    def __init__(self) -> None:
        self.step = asyncio.Event()
        self.cancelled: list[str] = []
        self.downs: list[int] = []  # chunks per MuxDown message sent
        self.started: set[str] = set()  # requests whose handler runs

    async def Generate(self, request, context):
        rid = request.request_id
        self.started.add(rid)
        try:
            if rid.startswith("bad"):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, "no", ((FAILURE_KEY, FAILURE_REQUEST),)
                )
            if rid.startswith("hang"):
                await asyncio.Event().wait()
            if rid.startswith("boom"):
                raise RuntimeError("handler bug")
            k = int(rid.split("-")[1])
            for i in range(k):
                await self.step.wait()
                yield pb.GenerateChunk(
                    request_id=rid, outputs=[pb.SeqDelta(index=0, token_ids=[i])]
                )
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise

    async def GenerateMux(self, request_iterator, context):
        async for down in serve_mux(self.Generate, request_iterator):
            if down.chunks or down.ends:  # not the hello or a heartbeat
                self.downs.append(len(down.chunks))
            yield down


async def _server(servicer: Scripted, port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    pb_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


def _client(port: int) -> tuple[grpc.aio.Channel, MuxClient]:
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.DecodeWorkerStub(ch)
    return ch, MuxClient(lambda: stub.GenerateMux(), f"127.0.0.1:{port}")


@contextlib.asynccontextmanager
async def _pair(svc: Scripted):
    """A server running ``svc`` and a MuxClient to it, closed at the end."""
    port = free_port()
    server = await _server(svc, port)
    ch, mux = _client(port)
    try:
        yield mux
    finally:
        await mux.close()
        await ch.close()
        await server.stop(0)


async def _all_started(svc: Scripted, n: int) -> None:
    while len(svc.started) < n:  # bounded by _run's timeout
        await asyncio.sleep(0.01)


async def _drain(call) -> list[int]:
    out = []
    while True:
        chunk = await asyncio.wait_for(call.read(), 5)
        if chunk is grpc.aio.EOF:
            return out
        out += chunk.outputs[0].token_ids


def _run(scenario):
    return asyncio.run(asyncio.wait_for(scenario(), 30))


def test_one_message_per_step_for_all_streams_and_each_stream_intact():
    async def scenario():
        svc = Scripted()
        async with _pair(svc) as mux:
            calls = [mux.start(pb.GenerateRequest(request_id=f"tok-3-{j}")) for j in range(8)]
            await _all_started(svc, 8)  # every handler waits for the step
            svc.step.set()  # every stream's chunks are ready together
            results = await asyncio.gather(*(_drain(c) for c in calls))
            return results, svc.downs, mux.generation

    results, downs, generation = _run(scenario)
    assert results == [[0, 1, 2]] * 8
    assert sum(downs) == 24
    # 24 chunks in far fewer messages than a Generate call each would take (24): the chunks
    # ready in one loop pass leave together
    assert len(downs) <= 6 and max(downs) >= 8, downs
    assert generation == 1  # one shared call for all of them


def test_statuses_reach_their_own_stream_only():
    async def scenario():
        svc = Scripted()
        svc.step.set()
        async with _pair(svc) as mux:
            bad = mux.start(pb.GenerateRequest(request_id="bad-1"))
            boom = mux.start(pb.GenerateRequest(request_id="boom-1"))
            good = mux.start(pb.GenerateRequest(request_id="tok-2-a"))
            errors = []
            for call in (bad, boom):
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await asyncio.wait_for(call.read(), 5)
                errors.append(ei.value)
            tokens = await _drain(good)
            # the same error again on a later read (a finished call stays finished)
            with pytest.raises(grpc.aio.AioRpcError):
                await asyncio.wait_for(bad.read(), 5)
            return errors, tokens

    errors, tokens = _run(scenario)
    assert errors[0].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert errors[0].details() == "no"
    assert (FAILURE_KEY, FAILURE_REQUEST) in list(errors[0].trailing_metadata())
    assert errors[1].code() == grpc.StatusCode.UNKNOWN
    assert "handler bug" in errors[1].details()
    assert tokens == [0, 1]


def test_cancel_ends_that_request_on_the_worker_and_no_other():
    async def scenario():
        svc = Scripted()
        async with _pair(svc) as mux:
            hang = mux.start(pb.GenerateRequest(request_id="hang-1"))
            other = mux.start(pb.GenerateRequest(request_id="tok-2-b"))
            pending = asyncio.ensure_future(hang.read())
            await _all_started(svc, 2)
            assert hang.cancel() and not hang.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(pending, 5)
            while not svc.cancelled:  # the worker's handler task is cancelled (its finally runs)
                await asyncio.sleep(0.01)  # bounded by _run's timeout
            svc.step.set()
            tokens = await _drain(other)
            return svc.cancelled, tokens, mux.inflight

    cancelled, tokens, inflight = _run(scenario)
    assert cancelled == ["hang-1"]
    assert tokens == [0, 1]
    assert inflight == 0


def test_a_stream_nobody_reads_holds_up_no_other():
    async def scenario():
        svc = Scripted()
        svc.step.set()
        async with _pair(svc) as mux:
            unread = mux.start(pb.GenerateRequest(request_id="tok-2000-slow"))
            read = mux.start(pb.GenerateRequest(request_id="tok-500-fast"))
            tokens = await _drain(read)
            first = await asyncio.wait_for(unread.read(), 5)  # all there, queued for it
            return tokens, list(first.outputs[0].token_ids)

    tokens, first = _run(scenario)
    assert tokens == list(range(500)) and first == [0]


def test_the_shared_call_failing_fails_every_request_on_it_and_the_next_opens_anew():
    async def scenario():
        port = free_port()
        svc = Scripted()
        server = await _server(svc, port)
        ch, mux = _client(port)
        calls = [mux.start(pb.GenerateRequest(request_id=f"hang-{j}")) for j in range(3)]
        await _all_started(svc, 3)  # every handler runs on the worker: stopping cancels them
        await server.stop(0)  # the worker goes away
        codes = []
        for c in calls:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await asyncio.wait_for(c.read(), 10)
            codes.append(ei.value.code())
        server = await _server(svc, port)  # back (a restart on the same address)
        svc.step.set()
        again = mux.start(pb.GenerateRequest(request_id="tok-1-again"))
        tokens = await _drain(again)
        await mux.close()
        await ch.close()
        await server.stop(0)
        return codes, tokens, mux.generation, sorted(svc.cancelled)

    codes, tokens, generation, cancelled = _run(scenario)
    # the router fails these over (UNAVAILABLE and CANCELLED are both retryable there)
    assert all(c in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) for c in codes)
    assert tokens == [0] and generation == 2
    # the worker side cancelled every handler of the call that went away
    assert cancelled == ["hang-0", "hang-1", "hang-2"]


class Stopping(GenerateMuxMixin, Scripted):
    """Scripted, with the worker's own ``GenerateMux`` (the mixin) and its close at stop."""


def test_a_stopping_worker_ends_the_shared_call_with_ok_after_its_requests():
    async def scenario():
        port = free_port()
        svc = Stopping()
        server = await _server(svc, port)
        ch, mux = _client(port)
        first = mux.start(pb.GenerateRequest(request_id="tok-2-first"))
        raw = mux._call  # the shared grpc call under the client
        await _all_started(svc, 1)
        closing = asyncio.ensure_future(svc.close_mux_calls(timeout_s=10))
        await asyncio.sleep(0.2)
        waited = not closing.done()  # the request on the call is still running
        svc.step.set()
        tokens = await _drain(first)  # it ends whole
        left = await closing
        code = await asyncio.wait_for(raw.code(), 5)
        # a request the router starts after the close: the call ends at once, unread
        late = mux.start(pb.GenerateRequest(request_id="tok-1-late"))
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await asyncio.wait_for(late.read(), 5)
        open_after = svc.open_mux_calls
        await mux.close()
        await ch.close()
        await server.stop(0)
        return waited, tokens, left, code, ei.value.code(), sorted(svc.started), open_after

    waited, tokens, left, code, late_code, started, open_after = _run(scenario)
    assert waited and tokens == [0, 1]
    # ended by the worker with OK before server.stop, not cancelled under grpc's handler
    assert left == 0 and code == grpc.StatusCode.OK
    # the router sends this one elsewhere (UNAVAILABLE is retryable there); never started here
    assert late_code == grpc.StatusCode.UNAVAILABLE and started == ["tok-2-first"]
    assert open_after == 0


def test_a_second_stream_with_an_id_in_flight_is_already_exists():
    async def scenario():
        port = free_port()
        svc = Scripted()
        server = await _server(svc, port)
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        call = pb_grpc.DecodeWorkerStub(ch).GenerateMux()
        req = pb.GenerateRequest(request_id="hang-dup")
        await call.write(pb.MuxUp(start=[req, req]))
        down = await asyncio.wait_for(call.read(), 5)
        while not (down.chunks or down.ends):  # the hello, heartbeats (empty MuxDowns)
            down = await asyncio.wait_for(call.read(), 5)
        call.cancel()
        await ch.close()
        await server.stop(0)
        return down

    down = _run(scenario)
    assert [(e.request_id, e.code) for e in down.ends] == [
        ("hang-dup", grpc.StatusCode.ALREADY_EXISTS.value[0])
    ]


def test_a_backlog_leaves_in_bounded_messages():
    from shared.proto import mux

    async def scenario():
        svc = Scripted()
        n = mux.MAX_CHUNKS_PER_MESSAGE + 100
        async with _pair(svc) as client:
            calls = [client.start(pb.GenerateRequest(request_id=f"tok-1-{j}")) for j in range(n)]
            await _all_started(svc, n)
            svc.step.set()  # every stream's chunk is ready in the same pass
            results = await asyncio.gather(*(_drain(c) for c in calls))
            return n, results, svc.downs

    n, results, downs = _run(scenario)
    assert results == [[0]] * n
    assert sum(downs) == n and max(downs) <= 1024 and len(downs) >= 2


def test_requests_started_together_are_merged_up_to_the_token_bound():
    from shared.proto.mux import MAX_UP_TOKENS, _merged

    big = pb.GenerateRequest(request_id="big", prompt_token_ids=[7] * (MAX_UP_TOKENS // 2 + 1))
    ups = [
        pb.MuxUp(start=[pb.GenerateRequest(request_id="a", prompt_token_ids=[1, 2])]),
        pb.MuxUp(cancel=["old"]),
        pb.MuxUp(start=[big]),
        pb.MuxUp(
            start=[pb.GenerateRequest(request_id="big2", prompt_token_ids=big.prompt_token_ids)]
        ),
        pb.MuxUp(start=[pb.GenerateRequest(request_id="b")]),
    ]
    out = _merged(ups)
    assert [[r.request_id for r in u.start] for u in out] == [["a", "big"], ["big2", "b"]]
    assert [list(u.cancel) for u in out] == [["old"], []]
    assert _merged(ups[:1]) == ups[:1]


class _SendFailsCall:
    """A shared call whose worker ended it as the router sent: ``write`` fails as grpc's C core
    fails a send on an ended call, and ``read`` has not seen the end yet."""

    def __init__(self) -> None:
        self.ended = asyncio.Event()
        self.cancelled = False

    async def write(self, up: pb.MuxUp) -> None:
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.INTERNAL,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            "Internal error from Core",
        )

    async def read(self):
        await self.ended.wait()
        return grpc.aio.EOF

    def cancel(self) -> None:
        self.cancelled = True
        self.ended.set()


@pytest.mark.unit
def test_a_send_on_a_call_the_worker_ended_fails_its_requests_as_the_end_does():
    """A worker closing its calls (a drain) ends a call the router has just opened; the
    router's send then fails in grpc's core (INTERNAL "Internal error from Core") before its
    reader sees the end (EOF, UNAVAILABLE). Which of the two came first decided the code the
    requests got: the test above failed now and then under load with INTERNAL."""

    async def scenario():
        call = _SendFailsCall()
        mux = MuxClient(lambda: call, "d:1")
        m = mux.start(pb.GenerateRequest(request_id="r1"))
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await asyncio.wait_for(m.read(), 5)
        await mux.close()
        return ei.value, call.cancelled

    err, cancelled = _run(scenario)
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert "ended" in err.details() and "a send failed" in err.details()
    assert cancelled
