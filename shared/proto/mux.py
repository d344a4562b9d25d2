"""``DecodeWorker.GenerateMux``: many ``Generate`` streams over one gRPC call.

grpc.aio costs tens of microseconds of Python and C-core work per message on each side, and a
decode step produces one message per running request: at batch 16 that is as much CPU as a
tenth of the step itself, taken from the core the engine runs on. vLLM's engine process sends
one message per step with every request's outputs to its API server; this module does the same
for the router and a decode worker, without changing what a request's stream means.

- **Worker** (:func:`serve_mux`): each ``GenerateRequest`` in a ``MuxUp.start`` runs the
  worker's own ``Generate`` handler, as a task, with a context whose ``write`` and ``abort``
  feed one outbox. The outbox is sent as one ``MuxDown`` per wake-up of the writer, so every
  chunk an engine step produced goes in one message. A handler's status (OK, or what it
  aborted with, trailing metadata included) ends its request as a ``MuxEnd``. A ``cancel``
  cancels that request's task, as gRPC cancels a ``Generate`` handler, and sends no end (the
  router stopped waiting for one), even for a task cancelled before it ran; when the whole call
  ends, every task is cancelled and awaited, so the engine aborts them.
- **Router** (:class:`MuxClient`): one call per decode worker, opened on first use. ``start``
  returns a :class:`MuxCall` with the parts of ``grpc.aio.UnaryStreamCall`` the dispatcher uses
  (``read``, ``cancel``, ``done``): a chunk, ``grpc.aio.EOF`` after an OK end, a real
  ``grpc.aio.AioRpcError`` after any other (same code, details and trailing metadata as a
  ``Generate`` call would have had), ``asyncio.CancelledError`` after ``cancel``. One reader
  task hands each chunk to its call without waiting for any consumer: a client that stops
  reading holds only its own call's queue (bounded by its ``max_tokens``), never the others'.
  If the shared call fails (the worker died, froze past keepalive, or restarted), every request
  on it gets that error and fails over; the next ``start`` opens a new call.
- **Heartbeats**: the worker's call sends an empty ``MuxDown`` when it opens (the hello) and
  after every :data:`HEARTBEAT_S` without another message, from its event loop (never waiting
  on the engine thread, so a long engine step does not stop them). A worker whose event loop
  is stuck still answers keepalive pings (gRPC's C core does), so only these show it: once a
  call sent its hello, a router that gets no message on it for ``stall_timeout_s``
  (``--worker-stall-timeout``) while requests are on it fails the call with ``UNAVAILABLE``,
  and those requests fail over; the call that replaces it is watched from its start (a stuck
  worker never runs its handler, so it sends no hello). A worker that sends no hello (an
  older build) is never timed out.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeGuard

import grpc

from shared.pauses import PauseLog
from shared.proto import pdserve_pb2 as pb
from shared.proto.failure import FAILURE_STALL, failure_metadata

logger = logging.getLogger(__name__)

_CODES = {c.value[0]: c for c in grpc.StatusCode}
# Bounds on one message, far below gRPC's limit (64 MiB, shared/proto/channel_options.py): a
# worker whose router fell behind sends its backlog of chunks (each one step of one request, a
# few hundred bytes with logprobs) in several messages; a router merges requests started
# together up to this many prompt tokens (a 32k-token prompt is ~160 KB on the wire).
MAX_CHUNKS_PER_MESSAGE = 1024
MAX_UP_TOKENS = 1 << 20
# A worker's call sends an empty ``MuxDown`` when it opens (the hello) and whenever it sent
# nothing else for this long: sent by the event loop, so they show the router that loop runs
# (a long engine step does not stop them: the engine has its own thread). A router that saw
# them fails the call after ``stall_timeout_s`` without any message (MuxClient).
HEARTBEAT_S = 1.0
DEFAULT_STALL_TIMEOUT_S = 10.0


def status_code(value: int) -> grpc.StatusCode:
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


# ---- worker side ----------------------------------------------------------------------------


class MuxAbort(Exception):
    """Raised by :meth:`_MuxContext.abort`: the request's stream ends with this status."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        trailing_metadata: tuple[tuple[str, Any], ...] = (),
    ) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailing_metadata = trailing_metadata


class _MuxContext:
    """What a ``Generate`` handler uses of ``grpc.aio.ServicerContext``, for one request of a
    mux call: ``write`` queues a chunk, ``abort`` ends the request with a status."""

    __slots__ = ("_outbox",)

    def __init__(self, outbox: asyncio.Queue[Any]) -> None:
        self._outbox = outbox

    async def write(self, chunk: pb.GenerateChunk) -> None:
        self._outbox.put_nowait(chunk)

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: tuple[tuple[str, Any], ...] = (),
    ) -> None:
        raise MuxAbort(code, details, tuple(trailing_metadata or ()))


def mux_outbox(context: Any) -> asyncio.Queue[Any] | None:
    """The queue a ``Generate`` handler run on a mux call (``context`` its
    :class:`_MuxContext`) may put its chunks on directly, in order with what it yields, to
    stream without a turn of its own coroutine; ``None`` for a plain grpc call."""
    return context._outbox if isinstance(context, _MuxContext) else None


def _end(
    rid: str, code: grpc.StatusCode, details: str = "", md: tuple[tuple[str, Any], ...] = ()
) -> pb.MuxEnd:
    end = pb.MuxEnd(request_id=rid, code=code.value[0], details=details)
    for key, value in md:
        end.trailing_metadata[key] = value if isinstance(value, str) else value.decode()
    return end


async def serve_mux(
    handler: Callable[[pb.GenerateRequest, Any], Any],
    request_iterator: AsyncIterator[pb.MuxUp],
    closing: asyncio.Event | None = None,
) -> AsyncIterator[pb.MuxDown]:
    """The body of a ``GenerateMux`` servicer method: runs ``handler`` (the servicer's own
    ``Generate``: an async generator of chunks, or a coroutine that writes them through its
    context) for every request started on this call and yields the batched outputs.

    Once ``closing`` is set the call ends with OK as soon as the requests already started on
    it have ended; requests the router starts after that are not read (the router sees the
    call end and sends them elsewhere)."""
    outbox: asyncio.Queue[Any] = asyncio.Queue()
    tasks: dict[str, asyncio.Task[None]] = {}  # by id: the requests a cancel can still end
    live: set[asyncio.Task[None]] = set()  # every handler task not done yet, cancelled ones too
    reading = True
    if closing is None:
        closing = asyncio.Event()

    async def run(req: pb.GenerateRequest) -> None:
        rid = req.request_id
        ctx = _MuxContext(outbox)
        try:
            result = handler(req, ctx)
            if inspect.isasyncgen(result):
                async for chunk in result:
                    outbox.put_nowait(chunk)
            else:
                await result
            outbox.put_nowait(_end(rid, grpc.StatusCode.OK))
        except MuxAbort as a:
            outbox.put_nowait(_end(rid, a.code, a.details, a.trailing_metadata))
        except asyncio.CancelledError:
            pass  # cancelled by the router (it no longer waits for an end) or the call ended
        except Exception as e:  # a handler bug fails its request only, as grpc would
            logger.exception("GenerateMux: request %s failed", rid)
            outbox.put_nowait(_end(rid, grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}"))
        finally:
            if tasks.get(rid) is asyncio.current_task():
                del tasks[rid]  # at once: the router may start this id again after the end

    def start(req: pb.GenerateRequest) -> None:
        rid = req.request_id
        task = tasks[rid] = asyncio.ensure_future(run(req))
        live.add(task)

        def done(t: asyncio.Task[None]) -> None:
            # also for a task cancelled before its first step, whose coroutine (and its
            # ``finally``) never runs: a start and a cancel read in one go
            live.discard(t)
            if tasks.get(rid) is t:
                del tasks[rid]
            outbox.put_nowait(None)  # wakes the writer to check whether the call is done

        task.add_done_callback(done)

    async def read() -> None:
        nonlocal reading
        try:
            async for up in request_iterator:
                for req in up.start:
                    rid = req.request_id
                    if rid in tasks:  # as Generate would for a second stream of one id
                        outbox.put_nowait(
                            _end(
                                rid,
                                grpc.StatusCode.ALREADY_EXISTS,
                                f"request {rid!r} is already in flight",
                            )
                        )
                        continue
                    start(req)
                for rid in up.cancel:  # after the starts (the router puts no id in both)
                    task = tasks.pop(rid, None)
                    if task is not None:  # no end: the router no longer waits for one
                        task.cancel()
        finally:
            reading = False
            outbox.put_nowait(None)

    async def close() -> None:
        await closing.wait()
        outbox.put_nowait(None)  # wakes the writer to end the call

    sent_at = time.monotonic()  # when the writer last sent a message
    beat_due = False  # nothing sent for HEARTBEAT_S: the writer sends an empty message

    async def beat() -> None:
        nonlocal beat_due
        while True:
            delay = sent_at + HEARTBEAT_S - time.monotonic()
            if delay <= 0:
                beat_due = True
                outbox.put_nowait(None)  # wakes the writer
                delay = HEARTBEAT_S
            await asyncio.sleep(delay)

    reader = asyncio.ensure_future(read())
    closer = asyncio.ensure_future(close())
    beater: asyncio.Task[None] | None = None
    try:
        if not closing.is_set():  # (a call opened while closing ends at once, unread)
            yield pb.MuxDown()  # the hello: this worker sends heartbeats
            sent_at = time.monotonic()
        beater = asyncio.ensure_future(beat())
        while (reading and not closing.is_set()) or live or not outbox.empty():
            items = [await outbox.get()]
            while not outbox.empty():
                items.append(outbox.get_nowait())
            down = pb.MuxDown()
            for it in items:
                if it is None:
                    continue
                if isinstance(it, pb.MuxEnd):
                    down.ends.append(it)
                    continue
                down.chunks.append(it)
                if len(down.chunks) >= MAX_CHUNKS_PER_MESSAGE:  # a backlog: a few messages
                    yield down
                    down = pb.MuxDown()
            if down.chunks or down.ends or beat_due:  # empty: a heartbeat
                yield down
                sent_at = time.monotonic()
                beat_due = False
    finally:
        reader.cancel()
        pending = [reader, closer, *live]
        if beater is not None:
            pending.append(beater)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


class GenerateMuxMixin:
    """``GenerateMux`` for a ``DecodeWorker`` servicer that has ``Generate``: list it before
    the generated servicer base (whose ``GenerateMux`` answers UNIMPLEMENTED).

    A worker that stops calls :meth:`close_mux_calls` before ``server.stop``: the routers'
    shared calls then end with OK instead of being cancelled by the server under grpc's
    handler (which logs "Exception not handled" for a call that is open at stop)."""

    _mux_closing: asyncio.Event | None = None
    _mux_open = 0

    def _mux_close_event(self) -> asyncio.Event:
        if self._mux_closing is None:
            self._mux_closing = asyncio.Event()
        return self._mux_closing

    async def GenerateMux(
        self, request_iterator: AsyncIterator[pb.MuxUp], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.MuxDown]:
        self._mux_open += 1
        try:
            async for down in serve_mux(
                self.Generate,  # type: ignore[attr-defined]
                request_iterator,
                self._mux_close_event(),
            ):
                yield down
        finally:
            self._mux_open -= 1

    @property
    def open_mux_calls(self) -> int:
        return self._mux_open

    async def close_mux_calls(self, timeout_s: float = 1.0) -> int:
        """End every open ``GenerateMux`` call once the requests on it have ended, and every
        call opened from now on at once; waits up to ``timeout_s`` for them to end and returns
        how many are still open (``server.stop`` then cancels those)."""
        self._mux_close_event().set()
        deadline = time.monotonic() + timeout_s
        while self._mux_open and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self._mux_open


# ---- router side ----------------------------------------------------------------------------

_CANCELLED = object()
_EOF = object()


class MuxCall:
    """One request's stream on a :class:`MuxClient` (the ``Generate`` call it stands for)."""

    __slots__ = ("_callbacks", "_client", "_done", "_items", "_waiter", "opened_at", "request_id")

    def __init__(self, client: MuxClient, request_id: str) -> None:
        self._client = client
        self.opened_at = client.opened_at  # time.monotonic() when the shared call it rides opened
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        self._callbacks: list[Callable[[MuxCall], None]] = []
        self.request_id = request_id

    def add_done_callback(self, callback: Callable[[MuxCall], None]) -> None:
        """``callback(call)`` once the call has ended (at once if it has), as on a
        ``grpc.aio.Call``: its end from the worker (the chunks before it may still wait to be
        read), a failure of the shared call, or a cancel. The router gives a request's worker
        counts back then, not when its consumer reads the end (a stalled client may never)."""
        if self._done:
            callback(self)
        else:
            self._callbacks.append(callback)

    async def read(self) -> Any:
        items = self._items
        while not items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        item = items[0]
        if isinstance(item, pb.GenerateChunk):
            items.popleft()
            return item
        # a terminal item stays: later reads see it again
        if item is _EOF:
            return grpc.aio.EOF
        if item is _CANCELLED:
            raise asyncio.CancelledError()
        raise item  # AioRpcError

    def cancel(self) -> bool:
        """End this request on the worker (its engine aborts it); a pending or later
        ``read`` raises ``asyncio.CancelledError``, as after ``grpc.aio.Call.cancel`` (chunks
        not read yet are dropped). False when it had already ended."""
        if self._done:
            return False
        self._done = True
        self._items.clear()
        self._push(_CANCELLED)
        self._client._cancel(self.request_id)
        self._ended()
        return True

    def done(self) -> bool:
        return self._done

    def _push(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # the client's reader
    def _chunk(self, chunk: pb.GenerateChunk) -> None:
        if not self._done:
            self._push(chunk)

    def _finish(self, item: Any) -> None:
        """The stream ended (after the chunks already queued, which are still read first)."""
        if not self._done:
            self._done = True
            self._push(item)
            self._ended()

    def _ended(self) -> None:
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb(self)
            except Exception:  # as grpc.aio: one callback's failure does not stop the others
                logger.exception("done callback of %s failed", self.request_id)


def _merged(ups: list[pb.MuxUp]) -> list[pb.MuxUp]:
    """``ups`` as few messages as :data:`MAX_UP_TOKENS` allows, in order.

    A worker applies a message's starts before its cancels, so a merged message never holds a
    start and a cancel of one id: "start r, cancel r" (a client that left at once) and
    "cancel r, start r" (an id reused) stay in two messages, in their order. Starts and
    cancels of different ids commute and are merged."""
    if len(ups) <= 1:
        return ups
    out = [pb.MuxUp()]
    tokens = 0
    starts: set[str] = set()
    cancels: set[str] = set()
    for u in ups:
        size = sum(len(r.prompt_token_ids) for r in u.start)
        ids = {r.request_id for r in u.start}
        if (
            (tokens and tokens + size > MAX_UP_TOKENS)
            or not cancels.isdisjoint(ids)
            or not starts.isdisjoint(u.cancel)
        ):
            out.append(pb.MuxUp())
            tokens = 0
            starts.clear()
            cancels.clear()
        out[-1].start.extend(u.start)
        out[-1].cancel.extend(u.cancel)
        starts |= ids
        cancels.update(u.cancel)
        tokens += size
    return out


def _send_after_end(e: BaseException) -> TypeGuard[grpc.aio.AioRpcError]:
    """Whether ``e`` is grpc's error for a message sent on a call the other side had already
    ended (a worker closing its calls, or gone): its C core fails the send before the call's
    own status is read, and grpc reports INTERNAL "Internal error from Core". The reader sees
    the same end as EOF; both must end the requests alike (UNAVAILABLE), whichever is first."""
    return (
        isinstance(e, grpc.aio.AioRpcError)
        and e.code() == grpc.StatusCode.INTERNAL
        and e.details() == "Internal error from Core"
    )


class MuxClient:
    """The router's ``GenerateMux`` call to one decode worker, shared by its requests.

    ``method`` is the stub's ``GenerateMux`` multi-callable with the call's metadata bound
    (the cluster token). The call opens on the first ``start`` and again after it failed.

    ``stall_timeout_s`` (0: off): once the worker showed it sends heartbeats (an empty
    ``MuxDown``; an older build never sends one, and the watchdog stays off for it), a call
    that has requests on it and got no message for this long fails with ``UNAVAILABLE``, as
    if the worker had died: its event loop is stuck (keepalive pings are answered by gRPC's C
    core, which goes on without it). The call that replaces a call failed that way is watched
    from its start (a stuck worker never runs the new call's handler, so it sends no hello)."""

    def __init__(
        self,
        method: Callable[..., Any],
        address: str,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        pauses: PauseLog | None = None,
    ) -> None:
        self._method = method
        self._pauses = pauses  # this process's own pauses: silence then is not the worker's
        self.address = address
        self.stall_timeout_s = stall_timeout_s
        self._call: Any = None
        self._calls: dict[str, MuxCall] = {}
        self._up: list[pb.MuxUp] = []
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._last_read = 0.0  # time.monotonic() of the current call's latest message
        self._beats = False  # the current call is watched (the worker sends heartbeats)
        self._expect_beats = False  # the previous call was failed by the watchdog
        self._watchdog: asyncio.Task[None] | None = None
        self.generation = 0  # calls opened so far (for tests and logs)
        self.opened_at = 0.0  # time.monotonic() when the current call opened

    @property
    def inflight(self) -> int:
        return len(self._calls)

    def start(self, request: pb.GenerateRequest) -> MuxCall:
        rid = request.request_id
        if rid in self._calls:  # a router never reuses an id while its stream runs
            raise ValueError(f"request {rid!r} is already in flight on {self.address}")
        if self._call is None:
            self._open()
        call = self._calls[rid] = MuxCall(self, rid)
        self._send(pb.MuxUp(start=[request]))
        return call

    def _cancel(self, rid: str) -> None:
        if self._calls.pop(rid, None) is not None and self._call is not None:
            self._send(pb.MuxUp(cancel=[rid]))

    def _send(self, up: pb.MuxUp) -> None:
        self._up.append(up)
        assert self._wake is not None  # opened
        self._wake.set()

    def _open(self) -> None:
        self.generation += 1
        self.opened_at = time.monotonic()
        self._call = call = self._method()
        self._wake = asyncio.Event()
        self._up = []
        self._last_read = time.monotonic()
        self._beats = False
        self._tasks = [
            asyncio.ensure_future(self._write(call, self._wake)),
            asyncio.ensure_future(self._read(call)),
        ]
        if self._expect_beats:
            self._watch(call)

    async def _write(self, call: Any, wake: asyncio.Event) -> None:
        try:
            while True:
                await wake.wait()
                wake.clear()
                if call is not self._call:
                    return
                ups, self._up = self._up, []
                for up in _merged(ups):
                    await call.write(up)
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - any write failure ends the shared call
            if _send_after_end(e):  # the worker ended the call: what the reader sees as EOF
                self._fail(call, ConnectionError(f"a send failed: {e.details()}"))
            else:
                self._fail(call, e)  # the reader sees the same failure; whichever comes first

    async def _read(self, call: Any) -> None:
        first = True
        try:
            while True:
                down = await call.read()
                if call is not self._call:  # failed meanwhile (the watchdog, a write)
                    return
                if down is grpc.aio.EOF:
                    self._fail(call, None)
                    return
                self._last_read = time.monotonic()
                if not down.chunks and not down.ends:  # a heartbeat (the first: the hello)
                    first = False
                    if not self._beats:
                        self._watch(call)
                    continue
                if first:  # no hello: an older build, which sends no heartbeats
                    first = False
                    self._unwatch()
                calls = self._calls
                for chunk in down.chunks:
                    c = calls.get(chunk.request_id)
                    if c is not None:
                        c._chunk(chunk)
                for end in down.ends:
                    c = calls.pop(end.request_id, None)
                    if c is None:
                        continue
                    if end.code == 0:
                        c._finish(_EOF)
                    else:
                        c._finish(
                            grpc.aio.AioRpcError(
                                status_code(end.code),
                                grpc.aio.Metadata(),
                                grpc.aio.Metadata(*end.trailing_metadata.items()),
                                end.details,
                            )
                        )
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - the call's error, or a bad message: end it all
            self._fail(call, e)

    def _watch(self, call: Any) -> None:
        """Watch ``call`` for a stall (the worker sends heartbeats)."""
        self._beats = True
        if self.stall_timeout_s > 0 and self._watchdog is None:
            self._watchdog = dog = asyncio.ensure_future(self._stall_watchdog(call))
            self._tasks.append(dog)

    def _unwatch(self) -> None:
        self._beats = False
        self._expect_beats = False
        dog, self._watchdog = self._watchdog, None
        if dog is not None and dog is not asyncio.current_task():
            dog.cancel()

    async def _stall_watchdog(self, call: Any) -> None:
        """One per watched call: wakes once per ``stall_timeout_s`` while messages come."""
        stall = self.stall_timeout_s
        try:
            while call is self._call and self._beats:
                now = time.monotonic()
                silent = now - self._last_read
                if silent >= stall and self._pauses is not None:
                    # on resume from a pause the worker's messages wait in the socket, and
                    # this timer may fire before they are read: the pause is not its silence
                    silent -= self._pauses.paused_since(self._last_read)
                if silent < stall:
                    await asyncio.sleep(stall - silent)
                elif not self._calls:  # nothing waits on it: look again later
                    await asyncio.sleep(stall)
                else:
                    self._fail(
                        call,
                        grpc.aio.AioRpcError(
                            grpc.StatusCode.UNAVAILABLE,
                            grpc.aio.Metadata(),
                            grpc.aio.Metadata(*failure_metadata(FAILURE_STALL)),
                            f"no message from the worker at {self.address} for {silent:.1f} s "
                            "(its event loop is stuck?)",
                        ),
                        stalled=True,
                    )
                    return
        except asyncio.CancelledError:
            pass

    def _fail(self, call: Any, error: BaseException | None, stalled: bool = False) -> None:
        """The shared call ended: every request on it ends with its error (UNAVAILABLE when
        the worker closed it without one); the next ``start`` opens a new call (watched from
        its start when this one ``stalled``: the same worker, still stuck, sends no hello)."""
        if call is not self._call:
            return
        self._call = None
        self._unwatch()
        self._expect_beats = stalled
        if isinstance(error, grpc.aio.AioRpcError):
            e = error
        else:
            e = grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                f"the GenerateMux call to {self.address} ended"
                + (f" ({type(error).__name__}: {error})" if error is not None else ""),
            )
        calls, self._calls = self._calls, {}
        if calls:
            logger.warning(
                "GenerateMux call to %s failed (%s: %s) with %d requests on it",
                self.address,
                e.code().name,
                e.details(),
                len(calls),
            )
        for c in calls.values():
            c._finish(e)
        assert self._wake is not None
        self._wake.set()  # the writer sees the call is gone and returns
        call.cancel()

    async def close(self) -> None:
        call = self._call
        if call is not None:
            self._fail(call, None)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
