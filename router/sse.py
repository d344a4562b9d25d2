"""Server-sent events for the OpenAI streaming responses: the lean ``SSEResponse``, one
client-disconnect watcher per request, and the event formatting helpers.

Nothing here knows about generation: an ``SSEResponse`` sends the strings an async iterator
yields (``data: [DONE]`` ends the body) and always closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextvars import ContextVar
from typing import Any, TypeVar, cast

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive

T = TypeVar("T")

logger = logging.getLogger(__name__)

# how long a task whose gRPC streams are being ended (client gone) may take to end on its own
_ON_GONE_GRACE_S = 2.0
# past the request's deadline, a stream that could send nothing for this long is dropped
_STALLED_PAST_DEADLINE_S = 1.0

#: The deadline (``time.monotonic()``) of the request whose work runs in this task, set by that
#: work (``router/generation.py``): an :class:`SSEResponse` sent from the same task drops a
#: client that stopped reading past it. Unset: the body's sends are not bounded.
REQUEST_DEADLINE: ContextVar[float | None] = ContextVar("pdserve_request_deadline", default=None)


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


RAW_SEND = "pdserve.raw_send"  # scope key: the server's own ``send``, under every middleware
SSE_DONE = "data: [DONE]\n\n"  # the last event of every stream


class DisconnectWatch:
    """One watcher task on the ASGI ``receive`` for a whole request: when the client
    disconnects it sets ``gone`` and cancels the task attached at that moment, if any.

    :meth:`guard` attaches the current task while it awaits some work (routing and the first
    token) and turns the cancellation into :class:`ClientDisconnected`; a streaming response
    then attaches itself (:meth:`attach`) for the body. Between the two nothing is attached,
    so a disconnect there only sets ``gone`` (which the response checks first) and never
    cancels the handover in the web framework. :meth:`stop` (idempotent) ends the watcher.
    """

    __slots__ = ("_on_gone", "_target", "_watcher", "gone")

    def __init__(self, receive: Receive, on_gone: Callable[[], bool] | None = None) -> None:
        self.gone = False
        self._target: asyncio.Task[Any] | None = None
        self._on_gone = on_gone
        self._watcher: asyncio.Task[None] | None = asyncio.get_running_loop().create_task(
            self._watch(receive)
        )

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        target = self._target
        if target is None:
            return
        # ``on_gone`` ends the request's gRPC streams from the worker's side (True when any was
        # running): a task awaiting a read then ends on its own, whereas cancelling it there
        # leaks native memory in grpcio (grpc/grpc#43360). Cancel it only if it still runs.
        if self._on_gone is not None and self._on_gone():
            await asyncio.wait([target], timeout=_ON_GONE_GRACE_S)
            if target.done() or self._target is not target:
                return
        target.cancel()

    def attach(self) -> asyncio.Task[Any]:
        """Cancel the current task on disconnect from now on; returns it."""
        # current_task() is never None here: called from a coroutine run by a task
        self._target = cast("asyncio.Task[Any]", asyncio.current_task())
        return self._target

    async def guard(self, work: Awaitable[T]) -> T:
        """Await ``work`` unless the client disconnects first (then cancel it and raise
        :class:`ClientDisconnected`)."""
        task = self.attach()
        try:
            return await work
        except asyncio.CancelledError:
            if not self.gone:
                raise
            task.uncancel()
            raise ClientDisconnected() from None
        finally:
            self._target = None

    def stop(self) -> None:
        # the cancelled watcher keeps its CancelledError, whose traceback holds the watcher's
        # frame and so this object: dropping both references here leaves no cycle. The cycle
        # (through ``on_gone``, the whole generation: 128 prompts' streams, token lists,
        # tasks) used to wait for a full collection, 70-90 ms on the event loop
        self._target = None
        self._on_gone = None
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()


class SSEResponse(StreamingResponse):
    """A lean server-sent-events response.

    Sends each string of ``events`` as it comes; a client disconnect cancels the stream at
    once (``watch``, the request's :class:`DisconnectWatch`, or a new one), and the iterator
    is always closed and ``on_close`` always awaited, even when the client left before the
    first byte. The ``data: [DONE]`` event ends the body (in the same write).

    Per-token costs kept down: the headers go through the middleware stack's ``send`` (so the
    middlewares know that the response started), the body chunks straight to the server's
    ``send`` when the app put it in the scope under :data:`RAW_SEND` (no middleware here looks
    at response bodies, and each wrapper costs a coroutine call per chunk); and after the
    first event the body is sent from a task of its own, whose stack is a few frames deep.

    The sends are bounded by the request's deadline (:data:`REQUEST_DEADLINE`): a client that
    stops reading holds its request (backpressure, down to its gRPC stream) up to there; once
    past it no event could be sent for ``_STALLED_PAST_DEADLINE_S``, the client is dropped (the
    body is cut, the iterator closed and ``on_close`` awaited: the request's admission ticket
    is released), instead of holding the request for as long as the connection lives.
    """

    body_iterator: AsyncGenerator[str, None]  # ``events``, as given

    def __init__(
        self,
        events: AsyncGenerator[str, None],
        on_close: Callable[[], Awaitable[None]],
        headers: dict[str, str],
        watch: DisconnectWatch | None = None,
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._on_close = on_close
        self._watch = watch
        self._sent = 0  # events sent so far
        self._dropped = False  # stalled past the deadline (``_past_deadline``)
        self._expiry: asyncio.TimerHandle | None = None
        self._sender: asyncio.Task[Any] | None = None  # the task that sends the body now

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        watch = self._watch if self._watch is not None else DisconnectWatch(receive)
        task = self._sender = watch.attach()
        pump: asyncio.Task[None] | None = None
        deadline = REQUEST_DEADLINE.get()
        if deadline is not None:
            self._expiry = asyncio.get_running_loop().call_later(
                max(0.0, deadline - time.monotonic()), self._past_deadline, watch, -1
            )
        try:
            if watch.gone:  # left while the response was being handed over
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            send_body = scope.get(RAW_SEND, send)
            # The first event is normally ready (the first output came before the response):
            # send it from here, right after the headers. The rest runs in a task of its own:
            # this coroutine sits under the whole middleware stack, and resuming it once per
            # token would walk all of it.
            first = await anext(self.body_iterator, None)
            if first is None:
                await send_body({"type": "http.response.body", "body": b"", "more_body": False})
                return
            if await self._send(send_body, first):
                return
            pump = self._sender = asyncio.get_running_loop().create_task(
                self._pump(send_body, watch)
            )
            await pump
        except asyncio.CancelledError:
            if not (watch.gone or self._dropped):
                raise
            task.uncancel()
        except OSError:  # the connection broke under a send
            pass
        finally:
            if self._expiry is not None:
                self._expiry.cancel()
                self._expiry = None
            self._sender = None
            watch.stop()
            if pump is not None and not pump.done():
                pump.cancel()
                await asyncio.wait([pump])
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()
            await self._on_close()

    async def _send(self, send: Any, event: str) -> bool:
        """Send one event; True when it was the last (``data: [DONE]``): then the iterator is
        closed first (the request is released) and the body ends in the same write."""
        if event.endswith(SSE_DONE):
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()
            await send({"type": "http.response.body", "body": event.encode(), "more_body": False})
            return True
        await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        self._sent += 1
        return False

    def _past_deadline(self, watch: DisconnectWatch, seen: int) -> None:
        """A timer from the request's deadline on: drop the client when no event could be sent
        since the last look (``seen`` events sent then; -1 at the deadline), a second ago."""
        sender = self._sender
        if sender is None or sender.done() or watch.gone:
            return
        if seen < 0 or self._sent != seen:  # still sending (the deadline's error event, or
            # output the worker had sent before it, to a slow reader): look again
            self._expiry = asyncio.get_running_loop().call_later(
                _STALLED_PAST_DEADLINE_S, self._past_deadline, watch, self._sent
            )
            return
        logger.warning(
            "dropping a client that stopped reading: nothing could be sent for %g s past "
            "the request's deadline",
            _STALLED_PAST_DEADLINE_S,
        )
        self._dropped = True
        self._expiry = None
        sender.cancel()

    async def _pump(self, send: Any, watch: DisconnectWatch) -> None:
        """Send the remaining events, then end the body; ends quietly when the client left."""
        watch.attach()
        try:
            async for event in self.body_iterator:
                if await self._send(send, event):
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not (watch.gone or self._dropped):
                raise
        except OSError:  # the connection broke under a send
            pass


async def until_disconnected(
    raw: Request, work: Awaitable[T], on_gone: Callable[[], bool] | None = None
) -> T:
    """Await ``work`` unless the client disconnects first (then cancel it and raise
    :class:`ClientDisconnected`; ``on_gone`` as for :class:`DisconnectWatch`)."""
    watch = DisconnectWatch(raw.receive, on_gone)
    try:
        return await watch.guard(work)
    finally:
        watch.stop()


# ``json.dumps(s, ensure_ascii=False)`` for a str ``s``, without building an encoder per call
json_str: Callable[[str], str] = json.encoder.encode_basestring


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
