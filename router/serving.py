"""The serving layer shared by ``/v1/completions`` and ``/v1/chat/completions``.

:class:`ServingContext` holds what a request needs (tokenizer, dispatcher, limits, metrics,
admission); :class:`Generation` drives one HTTP request: one or more prompts times ``n``
samples. ``start()`` routes every prompt and waits for its first output, so a failure before
any token becomes a proper HTTP status; ``steps()`` then yields the per-sample deltas as they
come; ``aclose()`` cancels everything still running (client gone). The request's TTFT, ITL and
e2e latency go to the metrics here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from router.dashboard import LiveStats, PhaseTimings, RequestRecord
from router.dispatch import Dispatcher, GenerationInput, GenerationStream, SeqOutput, StreamEnd
from router.errors import InvalidRequestError, ModelNotFoundError, OverloadedError, RouterError
from router.metrics import RouterMetrics
from router.output import OutputParams, SampleDelta, SampleOutput, TokenEntry
from router.protocol import PromptTokensDetails, SamplingFields, UsageInfo
from router.sampling import Limits, build_params, resolve_max_tokens
from router.tokenizer import RouterTokenizer
from shared.directory import ROLE_DECODE
from shared.proto import pdserve_pb2 as pb

logger = logging.getLogger(__name__)
T = TypeVar("T")
_LONG_TEXT = 8192  # characters; longer prompts are tokenized off the event loop
_MAX_LABEL = 128  # characters of a client's X-Request-Id kept as a label


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


@dataclass
class ServingContext:
    model_name: str
    tokenizer: RouterTokenizer
    dispatcher: Dispatcher
    limits: Limits
    metrics: RouterMetrics
    request_timeout_s: float
    max_inflight: int = 0  # 0 = unlimited
    inflight: int = 0
    live: LiveStats | None = None  # the dashboard's sliding windows and recent requests

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(f"The model `{model}` does not exist.", param="model")

    def admit(self) -> Ticket:
        """Count one in-flight generation request; 429 beyond ``max_inflight``.
        The returned ticket's ``release()`` (idempotent) ends it."""
        if self.max_inflight and self.inflight >= self.max_inflight:
            raise OverloadedError(f"the router already has {self.inflight} requests in flight "
                                  f"(--max-inflight-requests {self.max_inflight}); retry later")
        self.inflight += 1
        self.metrics.c_inflight.inc()
        return Ticket(self)

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) > _LONG_TEXT:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens)

    async def encode_many(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Encode several prompts in one batch, off the event loop once they are long
        together (``tokenizers`` releases the GIL, so the loop keeps serving meanwhile)."""
        if sum(map(len, texts)) > _LONG_TEXT:
            return await asyncio.to_thread(self.tokenizer.encode_many, texts, add_special_tokens)
        return self.tokenizer.encode_many(texts, add_special_tokens)

    def request_limits(self) -> Limits:
        """``limits``, with ``max_model_len`` lowered to the smallest one that the live decode
        workers advertise (workers may run with a shorter ``--max-model-len``)."""
        advertised = [r.info.max_model_len for r in self.dispatcher.pool.records(ROLE_DECODE)
                      if r.info.max_model_len > 0]
        if advertised and min(advertised) < self.limits.max_model_len:
            return replace(self.limits, max_model_len=min(advertised))
        return self.limits

    def check_token_ids(self, ids: list[int]) -> None:
        vocab = self.limits.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})",
                                      param="prompt")


class Ticket:
    """One admitted request; ``release()`` may be called any number of times."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx: ServingContext) -> None:
        self._ctx: ServingContext | None = ctx

    def release(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.inflight -= 1
            ctx.metrics.c_inflight.dec()


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

    __slots__ = ("_target", "_watcher", "gone")

    def __init__(self, receive: Callable[[], Awaitable[dict]]) -> None:
        self.gone = False
        self._target: asyncio.Task | None = None
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Callable[[], Awaitable[dict]]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if self._target is not None:
            self._target.cancel()

    def attach(self) -> asyncio.Task:
        """Cancel the current task on disconnect from now on; returns it."""
        self._target = asyncio.current_task()
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
        self._target = None
        self._watcher.cancel()


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
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str], watch: DisconnectWatch | None = None) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._on_close = on_close
        self._watch = watch

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        watch = self._watch if self._watch is not None else DisconnectWatch(receive)
        task = watch.attach()
        pump: asyncio.Task | None = None
        try:
            if watch.gone:  # left while the response was being handed over
                return
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
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
            pump = asyncio.get_running_loop().create_task(self._pump(send_body, watch))
            await pump
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            task.uncancel()
        except OSError:  # the connection broke under a send
            pass
        finally:
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
        return False

    async def _pump(self, send: Any, watch: DisconnectWatch) -> None:
        """Send the remaining events, then end the body; ends quietly when the client left."""
        watch.attach()
        try:
            async for event in self.body_iterator:
                if await self._send(send, event):
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watch.gone:
                raise
        except OSError:  # the connection broke under a send
            pass


def base_request_id(raw: Request) -> str:
    """The request's id on the workers: always the router's own, so two clients that send the
    same ``X-Request-Id`` never collide (the client's value is only a label, see
    :func:`client_label`)."""
    return uuid.uuid4().hex


def client_label(raw: Request) -> str | None:
    """The client's ``X-Request-Id`` (at most 128 printable ASCII characters), echoed back in
    the response header and written in the logs; never used as an id."""
    label = raw.headers.get("x-request-id")
    if not label:
        return None
    label = label[:_MAX_LABEL]
    return label if label.isascii() and label.isprintable() else None


def response_headers(raw: Request, request_id: str) -> dict[str, str]:
    label = client_label(raw)
    if label is not None and label != request_id:
        logger.debug("request %s carries client label %r", request_id, label)
    return {"x-request-id": label or request_id}


def warn_unknown_fields(req: SamplingFields) -> None:
    extra = req.unknown_fields()
    if extra:
        logger.warning("ignoring unknown request fields: %s", ", ".join(extra))


def truncate_prompt(ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep the last ``k`` tokens (-1 = max_model_len)."""
    if k is None:
        return ids
    if k == -1:
        k = max_model_len
    if k < 1:
        raise InvalidRequestError("truncate_prompt_tokens must be -1 or at least 1",
                                  param="truncate_prompt_tokens")
    return ids[-k:]


async def until_disconnected(raw: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first (then cancel it and raise
    :class:`ClientDisconnected`)."""
    watch = DisconnectWatch(raw.receive)
    try:
        return await watch.guard(work)
    finally:
        watch.stop()


def safe_logprob(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


class Generation:
    """One HTTP request's generation over ``prompts`` x ``n`` samples (choice index
    ``prompt_index * n + sample``)."""

    def __init__(self, ctx: ServingContext, request_id: str, prompts: list[list[int]],
                 samplings: list[pb.SamplingParams], params: OutputParams, cache_salt: str,
                 arrival: float) -> None:
        self.ctx = ctx
        self.n = params.n
        self.prompts = prompts
        self.arrival = arrival
        deadline = arrival + ctx.request_timeout_s
        self.streams: list[GenerationStream] = [
            ctx.dispatcher.stream(GenerationInput(
                request_id if len(prompts) == 1 else f"{request_id}-{i}", p, sp, deadline,
                cache_salt))
            for i, (p, sp) in enumerate(zip(prompts, samplings, strict=True))]
        self.samples = [SampleOutput(i, ctx.tokenizer, params)
                        for i in range(len(prompts) * self.n)]
        self.ends: list[StreamEnd | None] = [None] * len(prompts)
        self._iters: list[AsyncIterator] = []
        self._queue: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []
        self._first: list[tuple[int, Any]] = []
        self._last_token_time: float | None = None
        self._ttft: float | None = None
        self._closed = False

    # ---- driving the streams ----------------------------------------------------------
    async def start(self) -> None:
        """Route every prompt and wait for its first event; raises RouterError on failure."""
        if len(self.streams) == 1:
            it = self.streams[0].events()
            self._iters.append(it)
            try:
                self._first.append((0, await it.__anext__()))
            except StopAsyncIteration:
                raise RouterError("the decode stream ended without output") from None
            return
        self._queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._pump(i)) for i in range(len(self.streams))]
        seen: set[int] = set()
        while len(seen) < len(self.streams):
            i, ev, err = await self._queue.get()
            if err is not None:
                raise err
            seen.add(i)
            self._first.append((i, ev))

    async def _pump(self, i: int) -> None:
        assert self._queue is not None
        try:
            async with contextlib.aclosing(self.streams[i].events()) as it:
                async for ev in it:
                    await self._queue.put((i, ev, None))
        except RouterError as e:
            await self._queue.put((i, None, e))
        except Exception as e:  # keep the consumer from waiting forever
            logger.exception("stream %d failed", i)
            await self._queue.put((i, None, RouterError(f"internal error: {e!r}")))

    async def steps(self) -> AsyncIterator[list[SampleDelta]]:
        """Per-sample deltas, step by step, until every prompt's stream ended."""
        for i, ev in self._first:
            yield self._process(i, ev)
        self._first = []
        if self._queue is None:
            async for ev in self._iters[0]:
                yield self._process(0, ev)
        else:
            while any(e is None for e in self.ends):
                i, ev, err = await self._queue.get()
                if err is not None:
                    raise err
                yield self._process(i, ev)
        now = time.monotonic()
        self.ctx.metrics.c_e2e.observe(now - self.arrival)
        self.ctx.metrics.c_gen.inc(self.completion_tokens)
        if self.ctx.live is not None:
            self._record(self.ctx.live, now - self.arrival)

    def _record(self, live: LiveStats, e2e: float) -> None:
        """Each prompt's outcome and the decode worker's phase timings, for the dashboard."""
        finished_at = time.time()
        for i, (stream, end) in enumerate(zip(self.streams, self.ends, strict=True)):
            if end is None:
                continue
            d = stream.decision
            live.request_finished(RequestRecord(
                request_id=stream.inp.request_id, finished_at=finished_at, path=end.path,
                decode_worker=end.worker_id,
                prefill_worker=d.prefill.worker_id if d is not None and d.prefill is not None else "",
                prompt_tokens=len(self.prompts[i]),
                completion_tokens=sum(len(s.token_ids)
                                      for s in self.samples[i * self.n:(i + 1) * self.n]),
                cached_tokens=end.cached_tokens, ttft_s=self._ttft, e2e_s=e2e,
                attempts=stream.attempts + 1,
                timings=None if end.timings is None else PhaseTimings.from_proto(end.timings)))

    def _process(self, prompt_index: int, ev: list[SeqOutput] | StreamEnd) -> list[SampleDelta]:
        """One event of prompt ``prompt_index``'s stream -> the samples' new deltas. Runs once
        per decode-worker message: keep it lean."""
        base = prompt_index * self.n
        out: list[SampleDelta] = []
        if ev.__class__ is StreamEnd:
            self.ends[prompt_index] = ev
            for s in self.samples[base:base + self.n]:
                if not s.finished:  # the worker ended without saying why: report the cut
                    s.add((), (), "abort")
                if (d := s.take()) is not None:
                    out.append(d)
            return out
        now = time.monotonic()
        metrics = self.ctx.metrics
        last = self._last_token_time
        self._last_token_time = now
        if last is None:
            itl = None
            self._ttft = now - self.arrival
            metrics.c_ttft.observe(self._ttft)
        else:
            itl = now - last
            metrics.c_itl.observe(itl)
        samples = self.samples
        tokens = 0
        for sd in ev:
            ids = sd.token_ids
            tokens += len(ids)
            s = samples[base + sd.index]
            if s.finish_reason is not None:
                continue  # ended here by a stop string; the worker had sent more already
            s.add(ids, sd.logprobs, sd.finish_reason, sd.stop_token_id)
            if s.finish_reason is not None and not sd.finish_reason:
                self.streams[prompt_index].finish(sd.index)  # a stop string matched: stop it
            if (d := s.take()) is not None:
                out.append(d)
        if self.ctx.live is not None:
            self.ctx.live.output(tokens, self._ttft if itl is None else None, itl)
        return out

    async def aclose(self) -> None:
        """Cancel whatever still runs (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for it in self._iters:
            with contextlib.suppress(Exception):
                await it.aclose()

    # ---- accounting ---------------------------------------------------------------------
    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    def usage(self) -> UsageInfo:
        cached = [e.cached_tokens for e in self.ends if e is not None]
        details = None
        if cached and len(cached) == len(self.ends) and all(c is not None for c in cached):
            details = PromptTokensDetails(cached_tokens=sum(cached))
        p, c = self.prompt_tokens, self.completion_tokens
        return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                         prompt_tokens_details=details)


async def run_generation(ctx: ServingContext, gen: Generation,
                         on_step: Callable[[list[SampleDelta]], None] | None = None) -> None:
    """Drive ``gen`` to the end (non-streaming responses)."""
    try:
        await gen.start()
        async for deltas in gen.steps():
            if on_step is not None:
                on_step(deltas)
    finally:
        await gen.aclose()


def token_text(ctx: ServingContext, params: OutputParams, token_id: int) -> str:
    if params.return_tokens_as_token_ids:
        return f"token_id:{token_id}"
    return ctx.tokenizer.token_str(token_id)


def completion_logprobs(ctx: ServingContext, params: OutputParams, entries: list[TokenEntry],
                        offset_base: int = 0) -> dict:
    """OpenAI completions ``logprobs`` object for ``entries``."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(token_text(ctx, params, e.token_id))
        offsets.append(offset_base + e.text_offset)
        lp = e.logprob
        if lp is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(safe_logprob(lp.logprob))
        top = {token_text(ctx, params, t.token_id): safe_logprob(t.logprob) for t in lp.top}
        top.setdefault(tokens[-1], safe_logprob(lp.logprob))  # the sampled token is always there
        tops.append(top)
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}


def chat_logprobs(ctx: ServingContext, params: OutputParams, entries: list[TokenEntry]) -> dict:
    """OpenAI chat ``logprobs`` object (``{"content": [...]}``) for ``entries``."""
    content = []
    for e in entries:
        lp = e.logprob
        tok = token_text(ctx, params, e.token_id)
        item = {"token": tok,
                "logprob": safe_logprob(lp.logprob) if lp is not None else -9999.0,
                "bytes": list(ctx.tokenizer.token_bytes(e.token_id)),
                "top_logprobs": []}
        if lp is not None:
            item["top_logprobs"] = [
                {"token": token_text(ctx, params, t.token_id), "logprob": safe_logprob(t.logprob),
                 "bytes": list(ctx.tokenizer.token_bytes(t.token_id))}
                for t in lp.top[: params.logprobs or 0]]
        content.append(item)
    return {"content": content}


# ``json.dumps(s, ensure_ascii=False)`` for a str ``s``, without building an encoder per call
json_str: Callable[[str], str] = json.encoder.encode_basestring  # type: ignore[attr-defined]


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def prepare_prompt_runs(ctx: ServingContext, req: SamplingFields, prompts: list[list[int]],
                              ) -> tuple[list[pb.SamplingParams], OutputParams]:
    """Per-prompt engine params (the max_tokens default depends on each prompt's length)."""
    samplings: list[pb.SamplingParams] = []
    params: OutputParams | None = None
    limits = ctx.request_limits()
    for p in prompts:
        if not p:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        max_tokens = resolve_max_tokens(req, len(p), limits)
        sp, params = build_params(req, max_tokens, limits)
        samplings.append(sp)
    assert params is not None
    ctx.metrics.c_prompt.inc(sum(map(len, prompts)))
    return samplings, params
