"""Route one prompt to a (prefill, decode) pair and stream its tokens, with failover.

Steps 1-3 of the request lifecycle: hash the prompt's full blocks (``shared/hashing.py``, one
block size per worker group), read the directory (one Redis pipeline, bounded by
``directory_timeout_s``; without it routing falls back to load only), let
``router/policy.py`` pick the pair, and start the request on D: on the router's shared
``DecodeWorker.GenerateMux`` call to D (``shared/proto/mux.py``; one message per engine step
for all of this router's requests there), or as its own ``Generate`` call with
``--decode-stream per-request``. Both end a request's stream with the same statuses.

Failure rules:

- D fails before any token: re-route to another pair (D excluded, and cooling down).
- D fails after tokens: re-issue the prompt with ``resume`` = every token received so far per
  sample to another D (local prefill, since P has no resume semantics); the new D continues
  from there, so nothing is sent twice or lost.
- ``RESOURCE_EXHAUSTED`` tries the next D, then ends in 429; ``INVALID_ARGUMENT`` ends in 400
  without a retry; a failure the worker marks as the request's own (trailing metadata
  ``pdserve-failure: request``, see ``shared/proto/failure.py``) ends in 500 without a retry and
  without blaming the worker; retries are capped by ``max_retries``; no output for
  ``stall_timeout_s`` counts as a failure; the request deadline bounds everything (504).
- Closing the event generator (client gone, stop string) cancels the request's stream, which
  aborts the request on D.
- A call to D that broke with no word from D on why (no ``pdserve-failure``), in an attempt
  that began (or rode a mux call opened) before a noticeable pause of this router itself
  (SIGSTOP, a paused VM: ``shared/pauses.py``), or within ``RESUME_SETTLE_S`` after it, while
  that pause was noticed less than ``RESUME_GRACE_S`` ago, does not cool D down nor count
  against ``max_retries`` (once per D and request): keepalive gave the silent router up, D
  was healthy. The retry prefers another healthy D and comes back to this one when it is
  the last. The stall timers do not count the pause either.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import grpc

from router.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    NoWorkerError,
    OverloadedError,
    RequestFailedError,
    UpstreamError,
)
from router.metrics import RouterMetrics
from router.policy import Candidate, PolicyConfig, RouteDecision, choose_route
from router.workers import WorkerPool
from shared.directory import ROLE_DECODE, ROLE_PREFILL, DirectoryReader, WorkerRecord
from shared.directory.mirror import DirectoryMirror
from shared.hashing import block_hashes, hash_seed
from shared.pauses import PauseLog
from shared.proto import pdserve_pb2 as pb
from shared.proto.failure import FAILURE_KEY, FAILURE_REQUEST
from shared.proto.mux import MuxCall

logger = logging.getLogger(__name__)

#: A call broken this soon after the router's own noticeable pause may be the pause's doing:
#: keepalive (3 s pings, 3 s timeouts; the worker's own 10 + 5 s) surfaces a connection the
#: pause broke within a few seconds of the resume.
RESUME_GRACE_S = 10.0
#: An attempt begun this soon after a pause was noticed counts as begun before it: requests
#: that waited in the sockets meanwhile start on connections the pause may have broken.
RESUME_SETTLE_S = 1.0

_SC = grpc.StatusCode
_RETRYABLE = {_SC.UNAVAILABLE, _SC.INTERNAL, _SC.UNKNOWN, _SC.ABORTED, _SC.DATA_LOSS, _SC.CANCELLED}
_BAD_INPUT = {_SC.INVALID_ARGUMENT, _SC.OUT_OF_RANGE, _SC.FAILED_PRECONDITION}
# the worker refuses this router (another cluster secret, a build without GenerateMux): no
# request will do better there; another worker may serve it, and this one cools down
_REFUSES_US = {_SC.UNAUTHENTICATED, _SC.PERMISSION_DENIED, _SC.UNIMPLEMENTED}


@dataclass(frozen=True, slots=True)
class DispatchConfig:
    max_retries: int = 2
    stall_timeout_s: float = 60.0
    mux: bool = True  # stream from decode workers over their shared GenerateMux calls
    directory_timeout_s: float = 0.1
    max_waiting_per_worker: int = 0  # 0 = no bound; else 429 when every D has this many waiting
    policy: PolicyConfig = field(default_factory=PolicyConfig)


@dataclass(frozen=True, slots=True)
class GenerationInput:
    request_id: str
    prompt_token_ids: list[int]
    sampling: pb.SamplingParams
    deadline: float  # time.monotonic() value
    cache_salt: str = ""


@dataclass(slots=True)
class SeqOutput:
    """One sample's new output from one decode-worker message: ``pb.SeqDelta`` as plain Python
    values, read once (protobuf field access is slower than attribute access)."""

    index: int
    token_ids: list[int]
    finish_reason: str = ""  # "" while the sample goes on
    stop_token_id: int | None = None  # with finish_reason "stop", when a stop token id ended it
    logprobs: Sequence[pb.TokenLogprob] = ()  # only when the request asked for logprobs


@dataclass(slots=True)
class StreamEnd:
    """Last event of a stream. ``cached_tokens`` is None when D did not report usage."""

    path: str
    worker_id: str
    cached_tokens: int | None = None
    timings: pb.Timings | None = None  # D's phase timings (None when its final chunk never came)


class _Retryable(Exception):
    """This D failed in a way another D may not. ``transport``: the call broke with no word
    from the worker on why (no ``pdserve-failure``; not this router's stall timers): what a
    pause of the router itself can cause."""

    def __init__(self, reason: str, overloaded: bool = False, transport: bool = False) -> None:
        super().__init__(reason)
        self.overloaded = overloaded
        self.transport = transport


class _Watchdog:
    """Cancels one Generate ``call`` at the request ``deadline`` (``time.monotonic()``), or once
    ``stall_s`` passed without output after the first output (a long prefill is not a stall);
    ``why`` then says which. A timer on the event loop, re-armed only when it fires (and once
    at the first output), so the per-token cost is a few attribute writes.

    Only time spent waiting on the worker counts: while the consumer holds the stream
    (``paused``: a client that stops reading, whose backpressure stops the router reading the
    worker) there is no stall, so a slow client never makes a healthy worker look failed."""

    __slots__ = ("_handle", "call", "deadline", "last", "pauses", "paused", "stall_s", "why")

    def __init__(
        self,
        call: grpc.aio.Call | MuxCall,
        deadline: float,
        stall_s: float,
        pauses: PauseLog | None = None,
    ) -> None:
        self.call = call
        self.pauses = pauses  # the router's own pauses: not the worker's silence
        self.deadline = deadline
        self.stall_s = stall_s
        self.last = 0.0  # time.monotonic() of the latest output; 0 before the first
        self.paused = False  # the consumer holds the latest output (not the worker's time)
        self.why = ""  # "deadline" | "stall" once it fired
        self._handle: asyncio.TimerHandle | None = None
        self._arm(deadline - time.monotonic())

    def _arm(self, delay: float) -> None:
        self._handle = asyncio.get_running_loop().call_later(max(0.0, delay), self._check)

    def _check(self) -> None:
        now = time.monotonic()
        paused = 0.0  # the router's own paused time since the latest output
        if now >= self.deadline:
            self.why = "deadline"
        elif self.last and not self.paused and now - self.last >= self.stall_s:
            if self.pauses is not None:
                paused = self.pauses.paused_since(self.last)
            if now - self.last - paused >= self.stall_s:
                self.why = "stall"
        if self.why:
            self.call.cancel()
            return
        if self.last:
            wake = min(self.deadline, (now if self.paused else self.last + paused) + self.stall_s)
        else:
            wake = self.deadline
        self._arm(wake - now)

    def first_output(self) -> None:
        self.last = time.monotonic()
        assert self._handle is not None  # armed in __init__
        self._handle.cancel()
        self._arm(min(self.deadline, self.last + self.stall_s) - self.last)

    def error(self) -> Exception:
        if self.why == "deadline":
            return DeadlineExceededError("the request timed out before it finished")
        return _Retryable(f"no output for {self.stall_s:g} s")

    def stop(self) -> None:
        assert self._handle is not None  # armed in __init__
        self._handle.cancel()


class _Held:
    """What one attempt holds in the pool's counts: the request in flight on D; until its
    first output its prompt in the prefill backlog (of P, or of D prefilling it itself), then
    one of D's decoding streams. :meth:`release` gives it all back, once: when the worker's
    stream ends (the call's done callback), or when the attempt ends, whichever comes first.
    A stream that ended is no more work on the worker, even while a client that stopped
    reading holds its last outputs; counted until then, it steered every other request away
    from an idle worker for as long as that client did not read."""

    __slots__ = ("decoding", "pool", "prefiller", "record", "released", "tokens")

    def __init__(self, pool: WorkerPool, record: WorkerRecord, decision: RouteDecision) -> None:
        self.pool = pool
        self.record = record
        # until its first token this request is prefill work queued on P (or on D, locally)
        self.prefiller = decision.prefill.worker_id if decision.prefill else record.worker_id
        self.tokens = decision.uncached_tokens
        self.decoding = False
        self.released = False
        pool.acquire(record)
        pool.add_backlog(self.prefiller, self.tokens)

    def first_output(self) -> None:
        """The prompt was prefilled: D decodes it from now on (unless it already ended)."""
        if self.released or self.decoding:
            return
        self.decoding = True
        self.pool.add_backlog(self.prefiller, -self.tokens)
        self.pool.add_decoding(self.record.worker_id, 1)

    def release(self, _call: object = None) -> None:
        """Idempotent (also a call's done callback, which passes the call)."""
        if self.released:
            return
        self.released = True
        self.pool.release(self.record)
        if self.decoding:
            self.pool.add_decoding(self.record.worker_id, -1)
        else:
            self.pool.add_backlog(self.prefiller, -self.tokens)


class Dispatcher:
    """Owns routing decisions; one per app."""

    def __init__(
        self,
        pool: WorkerPool,
        reader: DirectoryReader | None,
        model: str,
        cfg: DispatchConfig,
        metrics: RouterMetrics,
        rng: random.Random | None = None,
        mirror: DirectoryMirror | None = None,
    ) -> None:
        self.pool = pool
        self.reader = reader
        self.mirror = mirror
        self.model = model
        self.cfg = cfg
        self.metrics = metrics
        self.rng = rng or random.Random()
        self._cleanup: asyncio.Task[None] | None = None
        self._lookup_failing = False

    async def close(self) -> None:
        if self._cleanup is not None and not self._cleanup.done():
            self._cleanup.cancel()
            await asyncio.gather(self._cleanup, return_exceptions=True)

    def stream(self, inp: GenerationInput) -> GenerationStream:
        return GenerationStream(self, inp)

    async def route(
        self,
        prompt: Sequence[int],
        cache_salt: str = "",
        exclude: set[str] | frozenset[str] = frozenset(),
        allow_prefill: bool = True,
    ) -> tuple[RouteDecision, WorkerRecord]:
        """Choose the pair for ``prompt``; raises NoWorkerError / OverloadedError."""
        decode = self.pool.healthy(ROLE_DECODE, exclude)
        if not decode:
            raise NoWorkerError(
                f"no healthy decode worker is serving model {self.model!r}"
                + (f" ({len(exclude)} failed during this request)" if exclude else "")
            )
        bound = self.cfg.max_waiting_per_worker
        if bound and all(r.load.waiting >= bound for r in decode):
            raise OverloadedError(
                f"every decode worker has at least {bound} requests waiting; retry later"
            )
        prefill = self.pool.healthy(ROLE_PREFILL) if allow_prefill else []
        # with one decode worker and no prefill worker there is nothing to choose: skip Redis
        cached = (
            await self._cached_tokens(prompt, cache_salt, decode + prefill)
            if len(decode) > 1 or prefill
            else {}
        )

        def cand(r: WorkerRecord) -> Candidate:
            running, waiting = self.pool.reported_queue(r)
            return Candidate(
                r.worker_id,
                r.info.grpc,
                cached.get(r.worker_id, 0),
                running,
                waiting,
                r.load.free_blocks,
                r.info.block_size,
                self.pool.inflight(r.worker_id),
                self.pool.prefill_backlog(r.worker_id),
                self.pool.decoding(r.worker_id),
                r.info.quantization,
            )

        decision = choose_route(
            len(prompt),
            [cand(r) for r in decode],
            [cand(r) for r in prefill],
            self.cfg.policy,
            self.rng,
        )
        assert decision is not None  # decode is non-empty
        record = next(r for r in decode if r.worker_id == decision.decode.worker_id)
        return decision, record

    async def _cached_tokens(
        self, prompt: Sequence[int], cache_salt: str, workers: list[WorkerRecord]
    ) -> dict[str, int]:
        """Leading prompt tokens each worker holds, from the directory ({} when unknown)."""
        if self.reader is None:
            return {}
        groups: dict[int, dict[str, str]] = {}
        for r in workers:
            if r.generation:  # registry-backed (static workers polled over gRPC are not)
                groups.setdefault(r.info.block_size, {})[r.worker_id] = r.generation
        out: dict[str, int] = {}
        seed = hash_seed(self.model, cache_salt or None)
        for bs, live in groups.items():
            hashes = block_hashes(prompt, bs, seed)
            if not hashes:
                continue
            t0 = time.perf_counter()
            # the router's own copy when it is in sync: no round trip to Redis
            m = self.mirror.prefix_match(hashes, live) if self.mirror is not None else None
            if m is not None:
                self.metrics.c_lookup_local.observe(time.perf_counter() - t0)
            else:
                try:
                    async with asyncio.timeout(self.cfg.directory_timeout_s):
                        m = await self.reader.prefix_match(self.model, hashes, live)
                except Exception as e:  # noqa: BLE001 - any directory failure: route on load
                    if not self._lookup_failing:
                        logger.warning("prefix directory lookup failed (%r); routing on load", e)
                    self._lookup_failing = True
                    continue
                self._lookup_failing = False
                self.metrics.c_lookup.observe(time.perf_counter() - t0)
            for wid, n in m.blocks.items():
                out[wid] = n * bs
            if m.stale and (self._cleanup is None or self._cleanup.done()):
                self._cleanup = asyncio.create_task(self._remove_stale(m.stale[:1000]))
        return out

    async def _remove_stale(self, pairs: list[tuple[str, str]]) -> None:
        try:
            assert self.reader is not None  # stale members come from the reader's lookups
            n = await self.reader.remove_stale(pairs)
            logger.debug("removed %d stale directory members", n)
        except Exception as e:  # noqa: BLE001 - best effort; the sweeper retries later
            logger.debug("stale member cleanup failed: %r", e)


class GenerationStream:
    """One prompt's generation across attempts. Iterate :meth:`events` once.

    Yields lists of :class:`SeqOutput` (only for samples not finished yet) and finally one
    :class:`StreamEnd`; raises a :class:`RouterError` on failure. The consumer calls
    :meth:`finish` when it ends a sample itself (stop string); once every sample is finished
    the call is cancelled and the stream ends.
    """

    def __init__(self, dispatcher: Dispatcher, inp: GenerationInput) -> None:
        self.d = dispatcher
        self.inp = inp
        self.n = max(1, inp.sampling.n)
        self.tokens: list[list[int]] = [[] for _ in range(self.n)]
        self.finished: set[int] = set()
        self._finished_here: set[int] = set()
        self.path: str | None = None
        self.worker_id = ""
        self.attempts = 0
        self.decision: RouteDecision | None = None
        self._want_logprobs = inp.sampling.HasField("logprobs")
        # vLLM's prompt_logprobs: D computes the prompt itself and sends them with the first
        # token; kept here for the response (a resumed attempt does not ask again)
        self._want_prompt_logprobs = inp.sampling.HasField("prompt_logprobs")
        self.prompt_logprobs: list[pb.TokenLogprob] | None = None
        self._live: tuple[Any, str] | None = None  # (decode stub, request id) of the attempt
        self._aborts: set[asyncio.Task[Any]] = set()
        self._call: grpc.aio.Call | MuxCall | None = None  # the attempt's stream, while it runs
        self._leaving = False  # the client left: stop at the next message (client_left)
        # prompt tokens served from a prefix cache, as the worker that processed the prompt
        # reported them; a resumed attempt's count covers the prompt plus the tokens it was
        # resumed with (its engine's prompt), so it is not the request's
        self.cached_tokens: int | None = None
        # decode workers whose failure came right after this router's own pause, retried once
        # each; those retries are not counted against --max-retries
        self._forgiven: set[str] = set()
        self._attempt_started = 0.0  # time.monotonic() when the running attempt began

    def _after_own_pause(self, worker_id: str, e: _Retryable) -> bool:
        """Whether a failure of ``worker_id`` is this router's pause's doing: the call broke
        with no word from the worker (``transport``), a noticeable pause of the router was
        noticed less than ``RESUME_GRACE_S`` ago and after the attempt (or the mux call it
        rode) began, or at most ``RESUME_SETTLE_S`` before it, and it is the first such for
        this request on that worker (a second one is the worker's)."""
        pauses = getattr(self.d.pool, "pauses", None)
        if not e.transport or worker_id in self._forgiven or pauses is None:
            return False
        if not pauses.resumed_within(RESUME_GRACE_S):
            return False
        if pauses.paused_since(self._attempt_started - RESUME_SETTLE_S) <= 0.0:
            return False  # the attempt and the call it rode began after the pause
        self._forgiven.add(worker_id)
        return True

    def finish(self, index: int) -> None:
        """The consumer ended sample ``index`` (a stop string matched). With other samples
        still running, the decode worker is told to stop that one (``DecodeWorker.Abort``)."""
        self.finished.add(index)
        self._finished_here.add(index)
        if self._live is not None and len(self.finished) < self.n:
            stub, rid = self._live
            task = asyncio.ensure_future(self._abort_sample(stub, rid, index))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)

    def client_left(self) -> bool:
        """The client left: end the running attempt without cancelling a pending read.
        grpcio's aio leaks native memory (a few KiB) for every call cancelled, or task
        cancelled, while a read is in flight (grpc/grpc#43360), which a server whose clients
        often leave mid-stream would pile up without bound. So the decode worker is asked to
        end the stream (``Abort(whole=True)``): the pending read completes normally and the
        attempt stops there. If the worker does not know the request or does not answer, the
        call is cancelled. True when an attempt was running (its task then ends on its own)."""
        call, live = self._call, self._live
        if call is None or live is None or call.done() or self._leaving:
            return False
        self._leaving = True
        if isinstance(call, MuxCall):  # no gRPC call of its own to leak: end it on the worker
            call.cancel()
            return True
        stub, rid = live
        task = asyncio.ensure_future(self._end_on_worker(stub, rid, call))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)
        return True

    @staticmethod
    async def _end_on_worker(stub: Any, rid: str, call: grpc.aio.Call) -> None:
        try:
            reply = await stub.Abort(pb.AbortRequest(request_id=rid, whole=True), timeout=1.0)
            if reply.aborted:
                return
        except grpc.aio.AioRpcError as e:
            logger.debug("ending %s on its worker failed: %s", rid, e.code().name)
        call.cancel()

    @staticmethod
    async def _abort_sample(stub: Any, rid: str, index: int) -> None:
        try:
            await stub.Abort(pb.AbortRequest(request_id=rid, indices=[index]), timeout=2.0)
        except grpc.aio.AioRpcError as e:  # best effort: its tokens are ignored anyway
            logger.debug("abort of sample %d of %s failed: %s", index, rid, e.code().name)

    def _remaining(self) -> float:
        return self.inp.deadline - time.monotonic()

    async def events(self) -> AsyncGenerator[list[SeqOutput] | StreamEnd, None]:
        exclude: set[str] = set()
        overloaded = False
        last_error = ""
        try:
            while True:
                if self._remaining() <= 0:
                    raise DeadlineExceededError("the request timed out before it finished")
                resumed = any(self.tokens)
                prompt = self.inp.prompt_token_ids
                if resumed and self.n == 1:
                    prompt = prompt + self.tokens[0]
                try:
                    decision, record = await self.d.route(
                        prompt,
                        self.inp.cache_salt,
                        exclude,
                        allow_prefill=not resumed and not self._want_prompt_logprobs,
                    )
                except NoWorkerError as e:
                    if overloaded:
                        raise OverloadedError(
                            "every decode worker is at capacity; retry later"
                        ) from e
                    if exclude or self._forgiven:
                        raise UpstreamError(f"{e.message}; last failure: {last_error}") from e
                    raise
                self.decision, self.path, self.worker_id = decision, decision.path, record.worker_id
                if self.attempts:  # a retry that reached a worker (not one that found none)
                    self.d.metrics.c_retries.inc()
                try:
                    async with contextlib.aclosing(self._attempt(decision, record)) as attempt:
                        async for ev in attempt:
                            yield ev
                    return
                except _Retryable as e:
                    last_error = f"{record.worker_id}: {e}"
                    overloaded = overloaded or e.overloaded
                    excused = self._after_own_pause(record.worker_id, e)
                    if excused:
                        # not blamed, not cooled down: the retry still prefers another decode
                        # worker (this one may have died meanwhile) and comes back to it
                        # only when it is the last
                        if self.d.pool.healthy(ROLE_DECODE, exclude | {record.worker_id}):
                            exclude.add(record.worker_id)
                    else:
                        exclude.add(record.worker_id)
                        if not e.overloaded:
                            self.d.pool.mark_failed(
                                record.worker_id, str(e), generation=record.generation
                            )
                    if len(self.finished) >= self.n:  # every sample had ended; only the final
                        yield StreamEnd(
                            self.path, record.worker_id, self.cached_tokens
                        )  # chunk lost
                        return
                    self.attempts += 1
                    if self.attempts - len(self._forgiven) > self.d.cfg.max_retries:
                        if overloaded and not any(self.tokens):
                            raise OverloadedError(
                                "decode workers are at capacity; retry later"
                            ) from None
                        raise UpstreamError(
                            f"generation failed after {self.attempts} attempts; "
                            f"last failure: {last_error}"
                        ) from None
                    sent = sum(map(len, self.tokens))
                    logger.warning(
                        "request %s: %s; retrying (%s%s)",
                        self.inp.request_id,
                        last_error,
                        f"resuming after {sent} tokens" if sent else "no token sent yet",
                        "; right after this router was paused: that worker not blamed"
                        if excused
                        else "",
                    )
        finally:
            if self.path is not None:
                self.d.metrics.routed(self.path)

    def _request(self, decision: RouteDecision) -> pb.GenerateRequest:
        rid = (
            self.inp.request_id if self.attempts == 0 else f"{self.inp.request_id}.{self.attempts}"
        )
        req = pb.GenerateRequest(
            request_id=rid,
            prompt_token_ids=self.inp.prompt_token_ids,
            sampling=self.inp.sampling,
            cache_salt=self.inp.cache_salt,
            deadline_s=max(0.001, self._remaining()),
        )
        if self.prompt_logprobs is not None:  # a resume: they came with the first token
            req.sampling.ClearField("prompt_logprobs")
        if decision.prefill is not None:
            req.prefill_address = decision.prefill.address
            req.prefill_worker_id = decision.prefill.worker_id
        for i, toks in enumerate(self.tokens):
            if toks:  # a sample that already ended is not continued on the next worker
                req.resume.append(
                    pb.ResumeTokens(index=i, token_ids=toks, finished=i in self.finished)
                )
        return req

    async def _attempt(
        self, decision: RouteDecision, record: WorkerRecord
    ) -> AsyncGenerator[list[SeqOutput] | StreamEnd, None]:
        """One Generate call on D, bounded by a :class:`_Watchdog` timer instead of per-chunk
        timers (this loop runs once per token; a gRPC-level deadline alone costs ~0.4 ms per
        call here). D also gets the deadline in ``deadline_s``."""
        pool = self.d.pool
        self._attempt_started = time.monotonic()
        # the prefix hit of the prompt's stream, counted with the attempt that produced its
        # first output (a retry before it does not count it again; a resume never does)
        count_hit = not any(self.tokens)
        held = _Held(pool, record, decision)
        stub = pool.decode_stub(record.info.grpc)
        request = self._request(decision)
        try:
            call = (
                pool.decode_mux(record.info.grpc).start(request)
                if self.d.cfg.mux
                else stub.Generate(request)
            )
        except BaseException:
            held.release()
            raise
        if isinstance(call, MuxCall):  # it rides a shared call: one the pause may have broken
            self._attempt_started = min(self._attempt_started, call.opened_at)
        # the worker's stream ending (its last message, a failure, a cancel) gives the counts
        # back at once, even while the consumer holds this generator (a client that stopped
        # reading); the finally below is the fallback
        call.add_done_callback(held.release)
        self._live = (stub, request.request_id)
        self._call = call
        done = False
        got_output = False
        dog = _Watchdog(
            call,
            self.inp.deadline,
            self.d.cfg.stall_timeout_s,
            getattr(self.d.pool, "pauses", None),
        )
        n, finished, tokens, want_lp = self.n, self.finished, self.tokens, self._want_logprobs
        try:
            while True:
                try:
                    chunk = await call.read()
                except asyncio.CancelledError:
                    # current_task() is never None here: a coroutine run by a task
                    if (
                        dog.why
                        and not cast("asyncio.Task[Any]", asyncio.current_task()).cancelling()
                    ):
                        raise dog.error() from None
                    raise
                except grpc.aio.AioRpcError as e:
                    if dog.why:
                        raise dog.error() from None
                    raise self._classify(e, got_output) from None
                if self._leaving:  # the client left (client_left): stop here, read done
                    raise asyncio.CancelledError()
                if chunk is grpc.aio.EOF:
                    if dog.why:
                        raise dog.error()
                    raise _Retryable("the stream ended before the request finished")
                if chunk.HasField("usage") and count_hit:  # the first tokens' chunk, the last
                    self.cached_tokens = min(
                        chunk.usage.cached_tokens, len(self.inp.prompt_token_ids)
                    )
                if (
                    self._want_prompt_logprobs
                    and self.prompt_logprobs is None
                    and (chunk.prompt_logprobs or any(sd.token_ids for sd in chunk.outputs))
                ):
                    self.prompt_logprobs = list(chunk.prompt_logprobs)
                outputs = []
                for sd in chunk.outputs:
                    i = sd.index
                    if i >= n or i in finished:
                        continue
                    ids = sd.token_ids[:]  # a list
                    tokens[i] += ids
                    lps = sd.logprobs if want_lp else ()
                    if fr := sd.finish_reason:
                        finished.add(i)
                        outputs.append(
                            SeqOutput(
                                i,
                                ids,
                                fr,
                                sd.stop_token_id if sd.HasField("stop_token_id") else None,
                                lps,
                            )
                        )
                    else:
                        outputs.append(SeqOutput(i, ids, "", None, lps))
                if outputs:
                    if not got_output:
                        got_output = True
                        dog.first_output()  # from now on it also watches for stalls
                        held.first_output()
                        if count_hit:
                            self.d.metrics.c_hit.inc(decision.decode.cached_tokens)
                    dog.paused = True  # the consumer's time from here: not a stall
                    yield outputs
                    dog.paused = False
                    dog.last = time.monotonic()
                if chunk.finished:
                    done = True
                    self.path = chunk.timings.path or decision.path
                    timings = chunk.timings if chunk.HasField("timings") else None
                    yield StreamEnd(
                        self.path, chunk.worker_id or record.worker_id, self.cached_tokens, timings
                    )
                    return
                if self._finished_here and len(self.finished) >= self.n:
                    yield StreamEnd(
                        self.path or decision.path, record.worker_id, self.cached_tokens
                    )
                    return
        finally:
            self._live = None
            self._call = None
            dog.stop()
            if not done:
                call.cancel()
            held.release()

    def _classify(self, e: grpc.aio.AioRpcError, got_output: bool) -> Exception:
        code, details = e.code(), e.details() or ""
        if _failure_kind(e) == FAILURE_REQUEST:
            return RequestFailedError(f"the request failed on the decode worker: {details}")
        if code == _SC.DEADLINE_EXCEEDED:
            return DeadlineExceededError("the request timed out before it finished")
        if code == _SC.RESOURCE_EXHAUSTED:
            return _Retryable(f"worker at capacity: {details}", overloaded=True)
        if code in _RETRYABLE:
            return _Retryable(f"{code.name}: {details}", transport=not _failure_kind(e))
        if code in _REFUSES_US and not got_output:
            return _Retryable(
                f"{code.name}: {details} (the worker refuses this router: check "
                "--cluster-secret-file and that both run the same pdserve)"
            )
        if code in _BAD_INPUT and not got_output and not any(self.tokens):
            return InvalidRequestError(f"the decode worker rejected the request: {details}")
        return UpstreamError(f"the decode worker failed: {code.name}: {details}")


def _failure_kind(e: grpc.aio.AioRpcError) -> str:
    """The worker's ``pdserve-failure`` trailing metadata ("" when absent)."""
    try:
        for key, value in e.trailing_metadata() or ():
            if key == FAILURE_KEY:
                return value if isinstance(value, str) else value.decode()
    except Exception:  # noqa: BLE001 - metadata of a broken call
        pass
    return ""
