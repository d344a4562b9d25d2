"""The decode worker: ``DecodeWorker.Generate`` (server stream) over a paged-KV engine.

Lifecycle of a request (docs/architecture.md, steps 4-7): admit; reuse the local prefix cache;
reserve blocks for the rest of the prompt (``WAITING_FOR_REMOTE_KV``); post UCX receives into
those blocks; ask the named prefill worker to fill them; once every block and the first token
arrived, decode and stream. With no prefill worker named, or when it fails (unreachable, error,
timeout, checksum), the engine prefills the missing blocks itself and the request completes.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import itertools
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvtransfer.errors import ChecksumMismatchError, KVTransferError, TransferTimeoutError
from shared.config import env_flag
from shared.engine import DuplicateRequestError, EngineCore, InvalidRequestError
from shared.engine.connector import RemotePrefillParams
from shared.engine.outputs import EngineCoreOutput, FailureKind, RequestFailure
from shared.engine.sampling_params import SamplingParamsError
from shared.engine.scheduler_output import SampledToken
from shared.proto import pdserve_pb2 as pb
from shared.proto import pdserve_pb2_grpc as pb_grpc
from shared.proto.mux import GenerateMuxMixin, mux_outbox
from shared.worker.engine_loop import AsyncOutputs, EngineDeadError
from shared.worker.service import (
    CLIENT_GRPC_OPTIONS,
    FALLBACK_SETTLE_S,
    QueueFullError,
    WorkerRuntime,
    abort_hung,
    add_worker_cli_args,
    admission,
    cancel_transfer,
    compile_grammar,
    failure_metadata,
    kv_transport_options,
    run_worker,
    serve_worker,
    unpin_when_terminal,
    wait_transfer,
    worker_stats,
)
from shared.worker.wire import (
    FAILURE_DRAINING,
    FAILURE_ENGINE,
    FAILURE_REQUEST,
    MAX_CACHE_SALT_CHARS,
    MAX_ID_CHARS,
    WireError,
    check_deadline,
    check_text,
    first_token_from_proto,
    logprob_to_proto,
    resume_from_proto,
    sampling_from_proto,
)

logger = logging.getLogger(__name__)
ROLE = "decode"
# PDSERVE_DIRECT_STREAM=0: every output through its request's coroutine (``_direct`` off)
DIRECT_STREAM = env_flag("PDSERVE_DIRECT_STREAM", default=True)


@dataclass
class _Flight:
    """A request in flight on this worker (asyncio side). ``engine_id`` is the id the engine
    knows it by: unique per flight, so a late callback for an earlier request that had the same
    ``request_id`` can never act on this one."""

    request: pb.GenerateRequest
    engine_id: str
    n: int
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)
    aborting: bool = False  # set first thing when the flight ends without finishing
    # set when the engine is declared hung: ends a wait for admission behind the stuck step
    hang: asyncio.Event = field(default_factory=asyncio.Event)
    done_before: frozenset[int] = frozenset()  # samples that finished on an earlier worker
    path: str = "local"
    remote_task: asyncio.Task | None = None
    recv_handle: Any = None  # the remote prefill's KV receive, once posted
    transfer_s: float = 0.0
    transfer_bytes: int = 0
    blocks_transferred: int = 0
    remote_prefill_s: float = 0.0
    remote_cached_tokens: int = 0
    # the stream's state (``_stream``, and ``_direct`` for the plain tokens it sends itself)
    counts: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    # per sample: when its last output came (as estimated: ``_add_tokens``), for the ITL
    last_token_times: dict[int, float] = field(default_factory=dict)
    heard: float = 0.0  # when the stream last took outputs (0: not yet; the arrival counts)
    prompt_tokens: int = 0
    cached: int = 0
    # its request metrics: the samples counted in request_success here, the samples the
    # router ended by a stop string (Abort with indices), how the stream ended, whether e2e
    # was observed (``_count_end`` counts the rest once the flight ends)
    ended: set[int] = field(default_factory=set)
    stopped: set[int] = field(default_factory=set)
    failed: bool = False
    e2e_done: bool = False
    outbox: asyncio.Queue | None = None  # the mux call's, where ``_direct`` may put chunks
    task: asyncio.Task | None = None  # the handler's task (a cancel stops ``_direct``)
    direct_ok: bool = False  # set while ``_stream`` reads this flight's queue


class DecodeServicer(GenerateMuxMixin, pb_grpc.DecodeWorkerServicer):
    """``Generate`` per request; ``GenerateMux`` (the mixin) runs it for each request started
    on a router's shared call (``shared/proto/mux.py``)."""

    abort_wait_s = 10.0  # how long an ending request waits for the engine's abort

    def __init__(self, runtime: WorkerRuntime, receiver, prefill_timeout_s: float) -> None:
        self.rt = runtime
        self.receiver = receiver
        self.prefill_timeout_s = prefill_timeout_s
        self.flights: dict[str, _Flight] = {}  # by the caller's request_id
        self.by_engine_id: dict[str, _Flight] = {}
        self._serial = itertools.count()
        self.aloop: asyncio.AbstractEventLoop | None = None
        self.outputs: AsyncOutputs | None = None
        self.channels: dict[str, tuple[grpc.aio.Channel, pb_grpc.PrefillWorkerStub]] = {}
        self.fallbacks = 0
        self.direct_tokens = 0  # tokens ``_direct`` streamed
        self.remote_prefills_noted = 0  # remote prefills taken from the transfer's note
        self._replies: set[asyncio.Future] = set()  # Prefill calls left to end on their own
        # Prefill calls in flight per channel, and the channels dropped from ``channels`` that
        # close once their calls end (or when their grace timer fires): closing a channel
        # cancels every call still on it, other requests' calls included
        self._channel_calls: dict[grpc.aio.Channel, int] = {}
        self._dropped_channels: dict[grpc.aio.Channel, asyncio.TimerHandle] = {}
        self._closing: set[asyncio.Future] = set()
        runtime.role_hook = self._on_step
        runtime.on_hang.append(self._fail_inflight)

    # ---- engine thread -----------------------------------------------------------------
    def _on_step(self, engine: EngineCore, outputs: list[EngineCoreOutput]) -> None:
        for job in engine.take_remote_prefills():
            if self.aloop is None:  # cannot happen (Generate set it); never leak the pin
                engine.unpin(job.pin_id)
                continue
            self.aloop.call_soon_threadsafe(
                self._start_remote,
                job.request_id,
                job.first_block_index,
                list(job.block_ids),
                job.pin_id,
            )

    def _fail_inflight(self, why: str) -> None:
        """The engine is hung: end every stream with UNAVAILABLE (engine failure) so the router
        resumes it on another decode worker now; the engine aborts them if it ever steps again."""
        failure = RequestFailure(FailureKind.ENGINE, why)
        for flight in list(self.flights.values()):
            flight.queue.put_nowait(
                EngineCoreOutput(flight.engine_id, 0, [], [], "error", failure=failure)
            )
            flight.hang.set()  # those still waiting for admission: their add is queued behind

    # ---- Generate ----------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        arrived = time.monotonic()  # deadline_s counts from here: compile and admission too
        rt = self.rt
        if self.outputs is None:
            self.aloop = asyncio.get_running_loop()
            self.outputs = AsyncOutputs(self.aloop, self._direct if DIRECT_STREAM else None)
            rt.loop.add_batch_sink(self.outputs)
        rid = request.request_id
        if rt.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "worker is draining",
                failure_metadata(FAILURE_DRAINING),
            )
        if rt.hung:  # it would wait behind the stuck step: the router resumes it elsewhere
            await abort_hung(context, rt)
        try:
            check_text(rid, "request_id", MAX_ID_CHARS, required=True)
            check_text(request.cache_salt, "cache_salt", MAX_CACHE_SALT_CHARS)
            check_text(request.prefill_address, "prefill_address", MAX_ID_CHARS)
            check_deadline(request.deadline_s)
            deadline = arrived + request.deadline_s if request.deadline_s > 0 else None
            params = sampling_from_proto(request.sampling, rt.engine.args.max_logprobs)
            resume, resume_finished = resume_from_proto(request.resume, params.n)
            # the engine's own checks (add_request's), here before the admission check: with
            # requests waiting it refused an invalid prompt RESOURCE_EXHAUSTED (and before
            # that the call waited its turn on the engine thread)
            rt.engine.validate_prompt(request.prompt_token_ids, params)
            # compiled here, not on the engine thread (past the deadline or the compile bound
            # a running compile goes on in its thread, for nobody)
            grammar = None
            if (
                params.structured_outputs is not None
                and (grammar := await compile_grammar(rt.engine, params, deadline)) is None
            ):
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"request {rid} exceeded its deadline of {request.deadline_s}s "
                    "while its grammar compiled",
                )
        except (WireError, SamplingParamsError, InvalidRequestError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFullError as e:  # the grammar threads' queue
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        if rid in self.flights:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already in flight"
            )
        prompt = request.prompt_token_ids  # validated above, and again (copied) by add_request
        # prompt logprobs need the prompt's logits: computed here, whatever the router said
        remote = bool(request.prefill_address) and resume is None and params.prompt_logprobs is None
        eid = f"{rid}@{next(self._serial)}"
        flight = _Flight(request, eid, params.n, self.outputs.register(eid))
        flight.arrival = arrived  # its times count from arrival here, as its deadline does
        flight.done_before = resume_finished
        flight.counts = [0] * params.n
        flight.outbox = mux_outbox(context) if params.n == 1 else None
        flight.task = asyncio.current_task()
        flight.path = "disagg" if remote else "local"
        self.flights[rid] = flight
        self.by_engine_id[eid] = flight
        rt.inflight += 1
        finished = False
        counted = False
        timer: asyncio.TimerHandle | None = None
        added: concurrent.futures.Future | None = None
        try:
            try:

                def add(e: EngineCore) -> None:
                    rt.admit(e, len(prompt) * params.n)
                    e.add_request(
                        eid,
                        prompt,
                        params,
                        cache_salt=request.cache_salt or None,
                        kv_transfer=RemotePrefillParams() if remote else None,
                        resume=resume,
                        resume_finished=resume_finished,
                        arrival_time=flight.arrival,
                        grammar=grammar,
                    )

                if rt.hung:  # declared while the call was validated
                    await abort_hung(context, rt)
                added = rt.loop.submit(add)
                # a long engine turn: bounded by the deadline, and by a hang's declaration
                # (an add not run yet never runs; one running is ended by the abort below)
                ended = await admission(added, flight.hang, deadline)
                if ended == "hung":
                    await abort_hung(context, rt)
                if ended == "deadline":
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"request {rid} exceeded its deadline of {request.deadline_s}s "
                        "waiting for admission",
                    )
            except QueueFullError as e:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except DuplicateRequestError as e:
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
            except InvalidRequestError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except EngineDeadError as e:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE, str(e), failure_metadata(FAILURE_ENGINE)
                )
            counted = True  # its path, once known: in the ``finally`` (a fallback changes it)
            if deadline is not None:  # one timer, not a wait_for per message (~23 us each)
                timer = asyncio.get_running_loop().call_later(
                    max(0.0, deadline - time.monotonic()), flight.queue.put_nowait, _DEADLINE
                )
            try:
                async for chunk in self._stream(flight, request):
                    if chunk.finished:
                        finished = True
                    yield chunk
            except _DeadlineExceeded:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"request {rid} exceeded its deadline of {request.deadline_s}s",
                )
            except _Failed as e:
                if e.kind is FailureKind.ENGINE:
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE, e.message, failure_metadata(FAILURE_ENGINE)
                    )
                await context.abort(
                    grpc.StatusCode.INTERNAL, e.message, failure_metadata(FAILURE_REQUEST)
                )
        finally:
            ended_at = time.monotonic()
            try:
                if timer is not None:
                    timer.cancel()
                if not finished:  # client cancelled, deadline, or error: abort everywhere
                    flight.aborting = True
                    # Shielded: a second cancel while it waits (the router's cancel after a
                    # deadline, the mux call ending) cancelled the engine's abort command
                    # before it ran and skipped what follows: the request went on generating
                    # for nobody and the worker never drained.
                    # Not admitted yet (the engine is busy: the deadline passed, or the client
                    # left): the abort is queued behind the add and ends the request right
                    # after it, before any step; waiting for it would wait out the engine.
                    wait = added is not None and added.done() and not added.cancelled()
                    await asyncio.shield(self._abort(eid, flight, wait))
            finally:
                if counted:
                    rt.metrics.path(flight.path)
                    self._count_end(flight, ended_at)
                if self.flights.get(rid) is flight:
                    del self.flights[rid]
                self.by_engine_id.pop(eid, None)
                self.outputs.unregister(eid)
                rt.inflight -= 1

    async def _stream(self, flight: _Flight, request: pb.GenerateRequest):
        rt = self.rt
        rid = request.request_id
        done: set[int] = set(flight.done_before)
        timing_src: EngineCoreOutput | None = None
        while len(done) < flight.n:
            flight.direct_ok = True
            try:
                batch = [await flight.queue.get()]
            finally:
                flight.direct_ok = False
            while not flight.queue.empty():
                batch.append(flight.queue.get_nowait())
            if any(o is _CLIENT_LEFT for o in batch):  # Abort(whole): end here, normally
                return
            if any(o is _DEADLINE for o in batch):  # queued by Generate's deadline timer
                raise _DeadlineExceeded(rid)
            deltas: dict[int, pb.SeqDelta] = {}
            now = time.monotonic()
            # several outputs of one sample: the stream was behind by as many engine steps
            pending = Counter(o.index for o in batch if o.new_token_ids) if len(batch) > 1 else None
            prompt_lps = None
            first = flight.first_token_time is None
            for o in batch:
                if o.failure is not None:  # this request, or the whole engine, failed
                    flight.failed = True
                    raise _Failed(o.failure.kind, o.failure.message)
                if o.prompt_logprobs is not None:
                    prompt_lps = o.prompt_logprobs
                d = deltas.get(o.index)
                if d is None:
                    d = deltas[o.index] = pb.SeqDelta(index=o.index)
                self._add_tokens(flight, o, d, now, pending)
                if o.finished:
                    d.finish_reason = o.finish_reason
                    if o.stop_token_id is not None:
                        d.stop_token_id = o.stop_token_id
                    done.add(o.index)
                    self._count_finished(flight, o.index, o.finish_reason)
                    timing_src = o
            flight.heard = now
            chunk = pb.GenerateChunk(
                request_id=rid, outputs=list(deltas.values()), worker_id=rt.worker_id
            )
            if first and flight.first_token_time is not None and len(done) < flight.n:
                # the first tokens' chunk also says how much of the prompt was cached: a router
                # that ends the request itself (a stop string) does not wait for the last chunk
                chunk.usage.CopyFrom(
                    pb.Usage(
                        prompt_tokens=flight.prompt_tokens,
                        cached_tokens=max(flight.cached, flight.remote_cached_tokens),
                    )
                )
            if prompt_lps is not None:
                chunk.prompt_logprobs.extend(logprob_to_proto(lp) for lp in prompt_lps)
            if len(done) == flight.n:
                chunk.finished = True
                completion = sum(flight.counts)
                chunk.usage.CopyFrom(
                    pb.Usage(
                        prompt_tokens=flight.prompt_tokens,
                        completion_tokens=completion,
                        cached_tokens=max(flight.cached, flight.remote_cached_tokens),
                    )
                )
                chunk.timings.CopyFrom(
                    self._timings(flight, timing_src, flight.first_token_time, now)
                )
                if not flight.request.resume:  # (as TTFT: it arrived on the worker that failed)
                    rt.metrics.e2e.observe(now - flight.arrival)
                flight.e2e_done = True
            yield chunk

    def _count_finished(self, flight: _Flight, index: int, reason: str) -> None:
        """Sample ``index`` ended here with ``reason``: once into request_success. An abort
        the router asked for because a stop string matched (``Abort`` with indices) is a
        ``stop``, as vLLM counts a stop string."""
        if index in flight.ended:
            return
        flight.ended.add(index)
        if reason == "abort" and index in flight.stopped:
            reason = "stop"
        self.rt.metrics.finished(reason)

    def _count_end(self, flight: _Flight, ended_at: float) -> None:
        """The flight of an admitted request ended: each sample that did not finish here (and
        not on an earlier worker) counts once in request_success, ``error`` when the engine
        failed it, else ``abort`` (the client left, the router cancelled the call after a
        stop string, a deadline); e2e is observed for a request that ended early, unless it
        was resumed here."""
        reason = "error" if flight.failed else "abort"
        for i in range(flight.n):
            if i not in flight.done_before and i not in flight.ended:
                self._count_finished(flight, i, reason)
        if not flight.e2e_done:
            flight.e2e_done = True
            if not flight.request.resume:
                self.rt.metrics.e2e.observe(ended_at - flight.arrival)

    def _add_tokens(
        self,
        flight: _Flight,
        o: EngineCoreOutput,
        d: pb.SeqDelta,
        now: float,
        pending: Counter[int] | None = None,
    ) -> None:
        """``o``'s tokens (and logprobs) into ``d``, and into the stream's counts, the token
        metrics and token timings: generation tokens as they come; prompt tokens, queue time
        and TTFT once per request (its first tokens, whichever sample); and one ITL gap
        per sample per engine step (one output, however many tokens it carries) after that
        sample's first, since the sample's previous output. ``pending``: how many outputs
        with tokens each sample still has in the batch ``o`` came in (``None``: this one
        only). When the stream fell behind and takes several steps' outputs of a sample at
        once, their times are not known apart: they are counted evenly spaced from the
        sample's previous output (for its first tokens, from when the stream last took
        outputs) to ``now``, so the gaps still sum to the time that passed, with no zeros."""
        d.token_ids.extend(o.new_token_ids)
        if o.new_logprobs:
            d.logprobs.extend(logprob_to_proto(lp) for lp in o.new_logprobs)
        if o.new_token_ids:
            i = o.index
            flight.counts[i] += len(o.new_token_ids)
            metrics = self.rt.metrics
            metrics.generation_tokens.inc(len(o.new_token_ids))
            if flight.first_token_time is None:
                flight.first_token_time = now
                # a resumed request's prompt too: it is prefilled again here
                metrics.prompt_tokens.inc(o.num_prompt_tokens)
                if o.first_scheduled_time is not None:
                    metrics.queue.observe(max(0.0, o.first_scheduled_time - flight.arrival))
                if not flight.request.resume:  # a resumed request's first token came earlier,
                    metrics.ttft.observe(now - flight.arrival)  # on the worker that failed
            ahead = 1  # this output and the sample's later ones in the batch
            if pending is not None:
                ahead = pending[i] or 1
                pending[i] = ahead - 1
            last = flight.last_token_times.get(i)
            base = last if last is not None else (flight.heard or flight.arrival)
            at = now if ahead == 1 else base + (now - base) / ahead
            if last is not None:
                metrics.itl.observe(at - last)
            flight.last_token_times[i] = at
        flight.prompt_tokens = o.num_prompt_tokens
        flight.cached = max(flight.cached, o.num_cached_tokens)

    def _direct(self, o: EngineCoreOutput) -> bool:
        """Event loop, once per output of a step: stream a token of a one-sample request on a
        mux call as its coroutine would (the same chunk, on the same outbox), without waking
        it. At batch 64 that coroutine's turn per token was most of this loop's per-token cost,
        on the core the engine steps on. Only while the coroutine waits on an empty queue
        (``direct_ok``); the last output, a failure, an abort, a cancelled handler, or anything
        already queued (a deadline, a client gone) go to the queue, and from there the
        coroutine takes every output in order."""
        flight = self.by_engine_id.get(o.request_id)
        if (
            flight is None
            or not flight.direct_ok
            or flight.outbox is None
            or not flight.queue.empty()
            or o.finished
            or o.failure is not None
            or o.prompt_logprobs is not None
            or flight.first_token_time is None  # the first tokens' chunk carries usage
            or flight.aborting
            or (flight.task is not None and flight.task.cancelling())
        ):
            return False
        d = pb.SeqDelta(index=o.index)
        now = time.monotonic()
        self._add_tokens(flight, o, d, now)
        flight.heard = now
        self.direct_tokens += len(o.new_token_ids)
        flight.outbox.put_nowait(
            pb.GenerateChunk(
                request_id=flight.request.request_id, outputs=[d], worker_id=self.rt.worker_id
            )
        )
        return True

    def _timings(
        self, flight: _Flight, o: EngineCoreOutput | None, first_token: float | None, now: float
    ) -> pb.Timings:
        t = pb.Timings(
            path=flight.path,
            transfer_s=flight.transfer_s,
            transfer_bytes=flight.transfer_bytes,
            blocks_transferred=flight.blocks_transferred,
        )
        if o is not None and o.first_scheduled_time is not None:
            t.queue_s = max(0.0, o.first_scheduled_time - flight.arrival)
        if first_token is not None:
            t.first_token_s = first_token - flight.arrival
            t.decode_s = now - first_token
            t.prefill_s = (
                flight.remote_prefill_s
                if flight.path == "disagg"
                else max(0.0, t.first_token_s - t.queue_s)
            )
        return t

    async def _abort(self, eid: str, flight: _Flight, wait: bool = True) -> None:
        task = flight.remote_task
        if task is not None and not task.done():
            task.cancel()  # cancels the Prefill RPC and the posted receives
            try:
                await task
            except BaseException:  # noqa: BLE001 - its outcome no longer matters
                pass
        aborted = self.rt.loop.submit(lambda e: e.abort_request([eid]))
        if self.rt.hung or not wait:  # queued: the engine aborts it when (if) it gets to it
            return
        # asyncio.wait, not wait_for: a wait that times out must not cancel the command (the
        # request would then generate on for nobody); it stays queued and runs when the
        # engine gets to it
        waiter = asyncio.wrap_future(aborted)
        waiter.add_done_callback(_consume)
        done, _ = await asyncio.wait([waiter], timeout=self.abort_wait_s)
        if not done:
            logger.warning(
                "abort of %s still queued after %.0f s (a long engine turn); it runs when the "
                "engine gets to it",
                eid,
                self.abort_wait_s,
            )
            return
        try:
            waiter.result()
        except EngineDeadError:
            pass  # nothing left to abort
        except Exception:
            logger.exception("abort of %s failed", eid)

    # ---- remote prefill ----------------------------------------------------------------
    def _start_remote(
        self, eid: str, first_block: int, block_ids: list[int], pin_id: int | None
    ) -> None:
        """Event loop, right after the engine step that reserved the blocks. The pin keeps
        them out of the free queue until the receive is terminal, whatever happens to the
        request meanwhile; a flight that is gone or ending never posts a receive."""
        flight = self.by_engine_id.get(eid)
        if flight is None or flight.aborting:
            self._unpin(pin_id)
            return
        task = asyncio.ensure_future(self._remote_prefill(flight, first_block, block_ids))
        # The pin is released by the task's end, not inside its coroutine: a task cancelled
        # before its first step never enters the coroutine (no finally runs there).
        task.add_done_callback(
            lambda _t: unpin_when_terminal(self.rt.loop, flight.recv_handle, pin_id)
        )
        flight.remote_task = task

    def _unpin(self, pin_id: int | None) -> None:
        if pin_id is not None:
            self.rt.loop.submit(lambda e: e.unpin(pin_id))

    def _drop_channel(self, address: str) -> None:
        """Connect to ``address`` afresh from now on. The old channel leaves the cache now but
        closes only once the Prefill calls still on it have ended (another request's call to a
        draining P may still succeed, or fail on its own and fall back): ``close()`` would
        cancel them all. Their own timeout (``prefill_timeout_s``) bounds the wait; the grace
        timer closes the channel in any case a second after it."""
        entry = self.channels.pop(address, None)
        if entry is None:
            return
        channel = entry[0]
        if not self._channel_calls.get(channel):
            self._close_channel(channel)
        elif channel not in self._dropped_channels:
            self._dropped_channels[channel] = asyncio.get_running_loop().call_later(
                self.prefill_timeout_s + 1.0, self._close_channel, channel
            )

    def _track_call(self, address: str, reply: asyncio.Future) -> None:
        """Count ``reply`` (a Prefill call) on the channel it runs on until it ends."""
        entry = self.channels.get(address)
        if entry is None:  # (a stub that is not one of ours)
            return
        channel = entry[0]
        self._channel_calls[channel] = self._channel_calls.get(channel, 0) + 1
        reply.add_done_callback(lambda _r: self._call_ended(channel))

    def _call_ended(self, channel: grpc.aio.Channel) -> None:
        left = self._channel_calls.pop(channel, 1) - 1
        if left > 0:
            self._channel_calls[channel] = left
        elif channel in self._dropped_channels:
            self._close_channel(channel)

    def _close_channel(self, channel: grpc.aio.Channel) -> None:
        timer = self._dropped_channels.pop(channel, None)
        if timer is not None:
            timer.cancel()
        self._channel_calls.pop(channel, None)
        closing = asyncio.ensure_future(channel.close())
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    async def close_channels(self) -> None:
        """At shutdown: close every channel, the dropped ones still open included."""
        channels = [c for c, _ in self.channels.values()] + list(self._dropped_channels)
        self.channels.clear()
        for timer in self._dropped_channels.values():
            timer.cancel()
        self._dropped_channels.clear()
        for channel in channels:
            await channel.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def _stub(self, address: str) -> pb_grpc.PrefillWorkerStub:
        entry = self.channels.pop(address, None)
        if entry is None:
            channel = self.rt.security.aio_channel(address, CLIENT_GRPC_OPTIONS)
            entry = (channel, pb_grpc.PrefillWorkerStub(channel))
            # the least recently used beyond the bound go (closed once their calls end):
            # prefill workers that left after a call that did not fail as unreachable (a
            # restart on a new port, a pod replaced) were kept for the worker's lifetime
            for old in list(self.channels)[: max(0, len(self.channels) + 1 - MAX_CHANNELS)]:
                self._drop_channel(old)
        self.channels[address] = entry  # (re)inserted last: the dict's order is recency
        return entry[1]

    async def _remote_prefill(
        self, flight: _Flight, first_block: int, block_ids: list[int]
    ) -> None:
        """Prefill on P into ``block_ids``; on any failure but its own cancellation, locally. The
        blocks' pin is dropped by the caller once this ends and the receive is terminal."""
        req = flight.request
        eid = flight.engine_id
        transfer_id = f"{req.request_id}:{uuid.uuid4().hex[:8]}"
        t0 = time.monotonic()
        handle = None
        reply: asyncio.Future | None = None
        try:
            handle = self.receiver.expect(transfer_id, block_ids, timeout_s=self.prefill_timeout_s)
            flight.recv_handle = handle
            call = self._stub(req.prefill_address).Prefill(
                pb.PrefillRequest(
                    request_id=req.request_id,
                    prompt_token_ids=req.prompt_token_ids,
                    sampling=req.sampling,
                    cache_salt=req.cache_salt,
                    decode_kv_address=self.receiver.address,
                    decode_worker_id=self.rt.worker_id,
                    first_block_index=first_block,
                    dst_block_ids=block_ids,
                    transfer_id=transfer_id,
                ),
                timeout=self.prefill_timeout_s,
                metadata=self.rt.security.call_metadata,
            )
            reply = asyncio.ensure_future(call)
            self._track_call(req.prefill_address, reply)
            result = await self._prefill_result(handle, reply, t0)
            first = checked_first_tokens(result, flight.n, self.rt.engine.model_config.vocab_size)
            flight.transfer_s = time.monotonic() - t0
            flight.transfer_bytes = handle.bytes_received
            flight.blocks_transferred = len(block_ids)
            flight.remote_prefill_s = result.prefill_s
            flight.remote_cached_tokens = result.num_cached_tokens
            loop = self.rt.loop
            await asyncio.wrap_future(
                loop.submit(lambda e: loop.deliver(e.finish_remote_prefill(eid, first, block_ids)))
            )
        except asyncio.CancelledError as e:
            task = asyncio.current_task()
            if task is None or task.cancelling():  # this request's own cancellation
                if reply is not None:
                    reply.cancel()  # the Prefill call
                if handle is not None:
                    await cancel_transfer(handle)
                raise
            # Not ours: the Prefill call was cancelled under the request (its channel
            # closed). A failure of P like any other: prefill locally.
            await self._fall_back(flight, handle, reply, e)
        except EngineDeadError:
            return
        except Exception as e:  # noqa: BLE001 - any failure of P: prefill locally
            await self._fall_back(flight, handle, reply, e)

    async def _fall_back(
        self, flight: _Flight, handle, reply: asyncio.Future | None, exc: BaseException
    ) -> None:
        """The remote prefill of ``flight`` failed with ``exc``: prefill it locally, into the
        blocks reserved for the transfer, or into new ones when its KV receive did not stop
        (the reserved ones stay pinned until the receive ends)."""
        req = flight.request
        eid = flight.engine_id
        if reply is not None:
            reply.cancel()
        reason = _fallback_reason(exc)
        logger.warning(
            "remote prefill of %s via %s failed (%s: %s); prefilling locally",
            req.request_id,
            req.prefill_address,
            reason,
            exc if str(exc) else type(exc).__name__,
        )
        # A receive still outstanding could land in the reserved blocks under the local
        # prefill's KV: then the request leaves them to the transfer's pin and is admitted
        # again on new blocks (its client sees a slower first token, nothing else).
        fresh = handle is not None and not await cancel_transfer(handle, FALLBACK_SETTLE_S)
        if fresh:
            logger.warning(
                "%s: its KV receive did not stop; prefilling it locally on new blocks",
                req.request_id,
            )
        if reason == "unreachable" and not isinstance(exc, asyncio.CancelledError):
            self._drop_channel(req.prefill_address)  # a restarted P: connect afresh
        self.fallbacks += 1
        self.rt.metrics.fallback(reason)
        flight.path = "fallback"
        loop = self.rt.loop
        try:
            await asyncio.wrap_future(
                loop.submit(
                    lambda e: loop.deliver(e.finish_remote_prefill(eid, None, fresh_blocks=fresh))
                )
            )
        except EngineDeadError:
            pass

    async def _prefill_result(self, handle, reply: asyncio.Future, t0: float) -> pb.PrefillResult:
        """P's result once every block is here and verified: from the transfer's ``fin`` note
        when it carries one (P sends it behind the last block, so the request goes on without
        waiting for the call's reply), else from the reply. Both waits are bounded by the
        receive's and the call's own timeouts. An early result leaves the call to finish on
        its own (kept in ``_replies``); cancelling it would make P count a cancelled send."""
        received = asyncio.ensure_future(handle)  # (cancelling it leaves the handle alone)
        try:
            await asyncio.wait((received, reply), return_when=asyncio.FIRST_COMPLETED)
        finally:
            received.cancel()
        if handle.done:
            handle.raise_for_state()
            if handle.note:
                try:
                    result = pb.PrefillResult.FromString(handle.note)
                except DecodeError as e:
                    raise _BadPrefillResult(f"prefill worker's note does not parse: {e}") from e
                self.remote_prefills_noted += 1
                self._replies.add(reply)
                reply.add_done_callback(self._reply_done)
                return result
        result = await reply  # (a P without notes, or the reply came first)
        remaining = max(0.1, self.prefill_timeout_s - (time.monotonic() - t0))
        await wait_transfer(handle, remaining)
        return result

    def _reply_done(self, reply: asyncio.Future) -> None:
        self._replies.discard(reply)
        if not reply.cancelled() and reply.exception() is not None:
            logger.debug("a Prefill call ended after its transfer's note: %s", reply.exception())

    # ---- Stats -------------------------------------------------------------------------
    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortReply:
        """End some samples of an ``n > 1`` request (the router matched their stop strings);
        the stream goes on for the others. Unknown ids and finished samples are ignored.
        With ``whole`` (the client left) the stream ends at once with status OK, and the
        request is aborted in the engine as for a cancelled call."""
        flight = self.flights.get(request.request_id)
        if flight is not None and request.whole:
            # the stream returns (status OK); its clean-up aborts the request in the engine
            running = flight.n - len(flight.done_before)
            flight.queue.put_nowait(_CLIENT_LEFT)
            return pb.AbortReply(aborted=running)
        if flight is None or not request.indices:
            return pb.AbortReply(aborted=0)
        # distinct, and only this request's samples: the engine sees at most n indices,
        # however long the list (set() first: a million repeats cost one C pass, not n)
        indices = sorted(i for i in set(request.indices) if 0 <= i < flight.n)
        if not indices:
            return pb.AbortReply(aborted=0)
        flight.stopped.update(indices)  # a stop string ended them: request_success's "stop"
        eid = flight.engine_id
        loop = self.rt.loop
        try:
            outs = await asyncio.wrap_future(
                loop.submit(lambda e: _deliver(loop, e.abort_samples(eid, indices)))
            )
        except EngineDeadError:
            return pb.AbortReply(aborted=0)
        return pb.AbortReply(aborted=outs)

    async def Stats(self, request: pb.StatsRequest, context) -> pb.WorkerStats:
        return await worker_stats(
            self.rt,
            request,
            fallbacks=self.fallbacks,
            transfer=self.receiver.stats,
            remote_prefills_noted=self.remote_prefills_noted,
        )


MAX_CHANNELS = 64  # cached channels to prefill workers (least recently used dropped first)


def _deliver(loop, outs: list[EngineCoreOutput]) -> int:
    """Engine thread: hand ``outs`` to the sinks; returns how many there were."""
    loop.deliver(outs)
    return len(outs)


# queued to a flight by Abort(whole=True): its stream ends at once, with status OK
_CLIENT_LEFT = EngineCoreOutput("", -1, [], [])
# queued to a flight when its request's deadline passes: the stream ends DEADLINE_EXCEEDED
_DEADLINE = EngineCoreOutput("", -1, [], [])


class _DeadlineExceeded(Exception):
    pass


class _Failed(Exception):
    """The engine ended this request with a failure (``kind``: the request or the engine)."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class _BadPrefillResult(Exception):
    """The prefill worker's reply does not fit the request."""


def checked_first_tokens(result: pb.PrefillResult, n: int, vocab_size: int) -> list[SampledToken]:
    """The prefill worker's first tokens, one per sample in order, each inside the vocabulary;
    else :class:`_BadPrefillResult` (the request is prefilled locally). A token id out of range
    would have failed the engine's next step, every request in it."""
    tokens = sorted(result.first_tokens, key=lambda f: f.index)
    if [f.index for f in tokens] != list(range(n)):
        raise _BadPrefillResult(
            f"prefill worker returned first tokens for samples {[f.index for f in tokens]} of n={n}"
        )
    for f in tokens:
        if not 0 <= f.token_id < vocab_size:
            raise _BadPrefillResult(
                f"prefill worker returned token id {f.token_id} outside the vocabulary "
                f"({vocab_size} tokens)"
            )
    return [first_token_from_proto(f) for f in tokens]


def _consume(f: asyncio.Future) -> None:
    """Retrieve a future's outcome (nobody may await it): no "never retrieved" warning."""
    if not f.cancelled():
        f.exception()


def _fallback_reason(e: BaseException) -> str:
    """The ``reason`` label of ``pdserve:prefill_fallbacks_total``."""
    if isinstance(e, grpc.aio.AioRpcError):
        code = e.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            return "unreachable"
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return "busy"  # P's queue is full: prefill here rather than wait
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "timeout"
        return "prefill_error"
    if isinstance(e, asyncio.CancelledError):
        return "unreachable"  # the call was cancelled under the request: its channel closed
    if isinstance(e, ChecksumMismatchError):
        return "checksum"
    if isinstance(e, (TransferTimeoutError, asyncio.TimeoutError)):
        return "timeout"
    if isinstance(e, KVTransferError):
        return "transfer_error"
    return "prefill_error"


# ---- entry points ----------------------------------------------------------------------


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_worker_cli_args(parser, ROLE)


def run(args: argparse.Namespace) -> int:
    return run_worker(ROLE, args, _main)


async def _main(args: argparse.Namespace) -> int:
    from kvtransfer import TransferMetrics, create_receiver

    transport = kv_transport_options(args)  # a bad transport flag fails before the model loads
    rt = WorkerRuntime(ROLE, args)
    receiver = create_receiver(
        args.kv_transport,
        rt.engine.runner.transfer_pool,
        rt.kv_geometry(),
        host=args.advertise_host or args.host,
        port=args.kv_port,
        bind_host=args.host,
        secret=rt.security.secret,
        verify_checksums=args.kv_checksums,
        metrics=TransferMetrics(rt.metrics.registry),
        **transport,
    )
    logger.info("KV transfer: %s receiver at %s", args.kv_transport, receiver.address_text)
    servicer = DecodeServicer(rt, receiver, args.kv_transfer_timeout)

    async def shutdown() -> None:
        # after the drain: the routers' shared GenerateMux calls end with OK, not cancelled
        # by server.stop under grpc's handler
        left = await servicer.close_mux_calls()
        if left:
            logger.warning("%d GenerateMux calls still open at stop", left)
        await servicer.close_channels()
        receiver.close()

    return await serve_worker(
        rt,
        lambda s: pb_grpc.add_DecodeWorkerServicer_to_server(servicer, s),
        extra_ready={"kv_address": receiver.address.hex()},
        on_shutdown=shutdown,
        ucx_address=receiver.address.hex(),
    )
