"""One HTTP request's generation: one or more prompts times ``n`` samples, fanned in.

:class:`Generation` routes every prompt (``router/dispatch.py``), and ``start()`` waits for
each prompt's first output, so a failure before any token becomes a proper HTTP status;
``steps()`` then yields the per-sample deltas (``router/output.py``) as they come; ``aclose()``
cancels everything still running (client gone). The request's TTFT, ITL and e2e latency go to
the metrics here, and to a :class:`RequestObserver` (the dashboard) when there is one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Protocol, cast

from router.context import ServingContext
from router.dispatch import GenerationInput, GenerationStream, SeqOutput, StreamEnd
from router.errors import RouterError
from router.output import OutputParams, SampleDelta, SampleOutput
from router.protocol import PromptTokensDetails, UsageInfo
from router.records import PhaseTimings, RequestRecord
from router.sse import REQUEST_DEADLINE
from shared.proto import pdserve_pb2 as pb

logger = logging.getLogger(__name__)

# how long a pump whose attempt is being ended (client_left) may take before its task is cancelled
_CALL_CANCEL_GRACE_S = 2.0


class RequestObserver(Protocol):
    """Who watches requests go by (the dashboard's ``LiveStats``)."""

    def output(
        self, tokens: int, ttft_s: float | None = None, itl_s: float | None = None
    ) -> None: ...

    def request_finished(self, record: RequestRecord) -> None: ...


class Generation:
    """One HTTP request's generation over ``prompts`` x ``n`` samples (choice index
    ``prompt_index * n + sample``)."""

    def __init__(
        self,
        ctx: ServingContext,
        request_id: str,
        prompts: list[list[int]],
        samplings: list[pb.SamplingParams],
        params: OutputParams,
        cache_salt: str,
        arrival: float,
    ) -> None:
        self.ctx = ctx
        self.n = params.n
        self.prompts = prompts
        self.arrival = arrival
        deadline = arrival + ctx.request_timeout_s
        # a streaming response of this request drops a client still not reading past it
        REQUEST_DEADLINE.set(deadline)
        self.streams: list[GenerationStream] = [
            ctx.dispatcher.stream(
                GenerationInput(
                    request_id if len(prompts) == 1 else f"{request_id}-{i}",
                    p,
                    sp,
                    deadline,
                    cache_salt,
                )
            )
            for i, (p, sp) in enumerate(zip(prompts, samplings, strict=True))
        ]
        tails = [ctx.tokenizer.prompt_tail(p) for p in prompts]
        self.samples = [
            SampleOutput(i, ctx.tokenizer, params, tails[i // self.n])
            for i in range(len(prompts) * self.n)
        ]
        self.ends: list[StreamEnd | None] = [None] * len(prompts)
        self._iters: list[AsyncGenerator[list[SeqOutput] | StreamEnd, None]] = []
        # (prompt index, event or None, the error that ended the stream or None: a RouterError,
        # or a CancelledError when the client left, which the consumer raises as it would
        # with one prompt)
        self._queue: asyncio.Queue[tuple[int, Any, BaseException | None]] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._first: list[tuple[int, Any]] = []
        # per prompt: with several prompts in one request their events interleave, and one
        # shared time read ~1/k of each sequence's gap as its inter-token latency
        self._last_token_time: list[float | None] = [None] * len(prompts)
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
        # bounded: a slow client holds the prompts' streams (backpressure on the request,
        # which the stall watchdog does not count against the workers) instead of buffering
        self._queue = asyncio.Queue(maxsize=8 * len(self.streams))
        for i in range(len(self.streams)):
            self._tasks.append(asyncio.create_task(self._pump(i)))
            # one prompt's routing and gRPC call per loop turn: started all at once, 128
            # prompts held the loop for ~100 ms (other clients and /health waited)
            await asyncio.sleep(0)
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
        except asyncio.CancelledError:
            # current_task() is never None here: a coroutine run by a task
            if cast("asyncio.Task[None]", asyncio.current_task()).cancelling():
                raise  # aclose() cancelled this pump
            # the attempt stopped because the client left (client_left): the consumer waits
            # on the queue, which nothing else wakes (it used to wait out the grace period
            # after which the disconnect watcher cancels it); it ends as with one prompt.
            # After aclose() (its own client_left) nobody reads the queue: just end
            if not self._closed:
                await self._queue.put((i, None, asyncio.CancelledError()))
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
        if self.ctx.live is not None:
            self._record(self.ctx.live, now - self.arrival)

    def _record(self, live: RequestObserver, e2e: float) -> None:
        """Each prompt's outcome and the decode worker's phase timings, for the dashboard."""
        finished_at = time.time()
        for i, (stream, end) in enumerate(zip(self.streams, self.ends, strict=True)):
            if end is None:
                continue
            d = stream.decision
            live.request_finished(
                RequestRecord(
                    request_id=stream.inp.request_id,
                    finished_at=finished_at,
                    path=end.path,
                    decode_worker=end.worker_id,
                    prefill_worker=d.prefill.worker_id
                    if d is not None and d.prefill is not None
                    else "",
                    prompt_tokens=len(self.prompts[i]),
                    completion_tokens=sum(
                        len(s.token_ids) for s in self.samples[i * self.n : (i + 1) * self.n]
                    ),
                    cached_tokens=end.cached_tokens,
                    ttft_s=self._ttft,
                    e2e_s=e2e,
                    attempts=stream.attempts + 1,
                    timings=None if end.timings is None else PhaseTimings.from_proto(end.timings),
                )
            )

    def _process(self, prompt_index: int, ev: list[SeqOutput] | StreamEnd) -> list[SampleDelta]:
        """One event of prompt ``prompt_index``'s stream -> the samples' new deltas. Runs once
        per decode-worker message: keep it lean."""
        base = prompt_index * self.n
        out: list[SampleDelta] = []
        if ev.__class__ is StreamEnd:
            self.ends[prompt_index] = ev
            for s in self.samples[base : base + self.n]:
                if not s.finished:  # the worker ended without saying why: report the cut
                    s.add((), (), "abort")
                if (d := s.take()) is not None:
                    out.append(d)
            return out
        now = time.monotonic()
        metrics = self.ctx.metrics
        last = self._last_token_time[prompt_index]
        self._last_token_time[prompt_index] = now
        first = self._ttft is None  # the request's first token (TTFT is the request's)
        itl = None
        if first:
            self._ttft = now - self.arrival
            metrics.c_ttft.observe(self._ttft)
        elif last is not None:
            itl = now - last
            metrics.c_itl.observe(itl)
        samples = self.samples
        tokens = kept = 0
        for sd in cast("list[SeqOutput]", ev):  # not a StreamEnd (returned above)
            ids = sd.token_ids
            tokens += len(ids)
            s = samples[base + sd.index]
            if s.finish_reason is not None:
                continue  # ended here by a stop string; the worker had sent more already
            had = len(s.token_ids)
            s.add(ids, sd.logprobs, sd.finish_reason, sd.stop_token_id)
            kept += len(s.token_ids) - had
            if s.finish_reason is not None and not sd.finish_reason:
                self.streams[prompt_index].finish(sd.index)  # a stop string matched: stop it
            if (d := s.take()) is not None:
                out.append(d)
        # as they come (a request's end alone made bursts, and a client that left counted none)
        metrics.c_gen.inc(kept)
        if self.ctx.live is not None:
            self.ctx.live.output(tokens, self._ttft if first else None, itl)
        return out

    def client_left(self) -> bool:
        """The client left: end every stream's running attempt without cancelling a pending
        read (see :meth:`GenerationStream.client_left`). True when any was running."""
        running = False
        for s in self.streams:
            running |= s.client_left()
        return running

    async def aclose(self) -> None:
        """Cancel whatever still runs (idempotent): the gRPC calls first, so that the pumps'
        reads end on their own, then any pump that has not ended within a moment."""
        if self._closed:
            return
        self._closed = True
        if self._tasks:
            if self.client_left():
                await asyncio.wait(self._tasks, timeout=_CALL_CANCEL_GRACE_S)
            for t in self._tasks:
                t.cancel()
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
            details = PromptTokensDetails(cached_tokens=sum(cast("list[int]", cached)))
        p, c = self.prompt_tokens, self.completion_tokens
        return UsageInfo(
            prompt_tokens=p, completion_tokens=c, total_tokens=p + c, prompt_tokens_details=details
        )

    def choice_usage(self, index: int, completion_tokens: int | None = None) -> UsageInfo:
        """The running usage of choice ``index`` alone, as vLLM's continuous_usage_stats
        report it in each chunk: its prompt's tokens and its own output tokens so far
        (``completion_tokens`` overrides: 0 for the chunks sent before its output, the role
        and echo chunks). The cached count is the prompt's as its worker reported it with
        the first tokens, as in the final usage."""
        i = index // self.n
        p = len(self.prompts[i])
        c = len(self.samples[index].token_ids) if completion_tokens is None else completion_tokens
        cached = self.streams[i].cached_tokens
        return UsageInfo(
            prompt_tokens=p,
            completion_tokens=c,
            total_tokens=p + c,
            prompt_tokens_details=None
            if cached is None
            else PromptTokensDetails(cached_tokens=cached),
        )


async def run_generation(
    ctx: ServingContext, gen: Generation, on_step: Callable[[list[SampleDelta]], None] | None = None
) -> None:
    """Drive ``gen`` to the end (non-streaming responses)."""
    try:
        await gen.start()
        async for deltas in gen.steps():
            if on_step is not None:
                on_step(deltas)
    finally:
        await gen.aclose()
