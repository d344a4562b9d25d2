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
import logging
import time
import uuid
from dataclasses import dataclass, field

import grpc

from shared.engine import EngineCore, InvalidRequestError, PromptTooLongError
from shared.engine_loop import AsyncOutputs
from shared.outputs import EngineCoreOutput
from shared.proto import pdserve_pb2 as pb
from shared.proto import pdserve_pb2_grpc as pb_grpc
from shared.request import Request
from shared.sampling_params import SamplingParamsError
from shared.service import (GRPC_OPTIONS, WorkerRuntime, add_worker_cli_args, cancel_transfer,
                            configure_logging, serve_worker, wait_transfer, worker_stats)
from shared.wire import first_token_from_proto, logprob_to_proto, sampling_from_proto

logger = logging.getLogger(__name__)
ROLE = "decode"


@dataclass
class _Flight:
    """A request in flight on this worker (asyncio side)."""

    request: pb.GenerateRequest
    n: int
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)
    path: str = "local"
    remote_task: asyncio.Task | None = None
    transfer_s: float = 0.0
    transfer_bytes: int = 0
    blocks_transferred: int = 0
    remote_prefill_s: float = 0.0
    remote_cached_tokens: int = 0


class DecodeServicer(pb_grpc.DecodeWorkerServicer):
    def __init__(self, runtime: WorkerRuntime, receiver, prefill_timeout_s: float) -> None:
        self.rt = runtime
        self.receiver = receiver
        self.prefill_timeout_s = prefill_timeout_s
        self.flights: dict[str, _Flight] = {}
        self.aloop: asyncio.AbstractEventLoop | None = None
        self.outputs: AsyncOutputs | None = None
        self.channels: dict[str, tuple[grpc.aio.Channel, pb_grpc.PrefillWorkerStub]] = {}
        self.fallbacks = 0
        runtime.role_hook = self._on_step

    # ---- engine thread -----------------------------------------------------------------
    def _on_step(self, engine: EngineCore, outputs: list[EngineCoreOutput]) -> None:
        remote = engine.take_remote_prefills()
        if remote and self.aloop is not None:
            for req in remote:
                self.aloop.call_soon_threadsafe(self._start_remote, req.parent_id,
                                                req.remote_prefill.first_block_index,
                                                list(req.remote_prefill.block_ids))

    # ---- Generate ----------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        rt = self.rt
        if self.outputs is None:
            self.aloop = asyncio.get_running_loop()
            self.outputs = AsyncOutputs(self.aloop)
            rt.loop.add_batch_sink(self.outputs)
        rid = request.request_id
        if rt.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining")
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        if rid in self.flights:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already in flight")
        try:
            params = sampling_from_proto(request.sampling)
        except SamplingParamsError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        prompt = list(request.prompt_token_ids)
        resume = None
        if request.resume:
            by_index = {r.index: list(r.token_ids) for r in request.resume}
            resume = [by_index.get(i, []) for i in range(params.n)]
            if not any(resume):
                resume = None
        remote = bool(request.prefill_address) and resume is None
        flight = _Flight(request, params.n, self.outputs.register(rid))
        flight.path = "disagg" if remote else "local"
        self.flights[rid] = flight
        rt.inflight += 1
        finished = False
        try:
            try:
                await asyncio.wrap_future(rt.loop.submit(lambda e: e.add_request(
                    rid, prompt, params, cache_salt=request.cache_salt or None,
                    remote_prefill=remote, resume=resume, arrival_time=flight.arrival)))
            except PromptTooLongError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except InvalidRequestError as e:
                code = (grpc.StatusCode.ALREADY_EXISTS if "already in flight" in str(e)
                        else grpc.StatusCode.INVALID_ARGUMENT)
                await context.abort(code, str(e))
            rt.metrics.path(flight.path)
            try:
                async for chunk in self._stream(flight, request):
                    if chunk.finished:
                        finished = True
                    yield chunk
            except _DeadlineExceeded:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"request {rid} exceeded its deadline of {request.deadline_s}s")
            except RuntimeError as e:
                await context.abort(grpc.StatusCode.INTERNAL, str(e))
        finally:
            if not finished:  # client cancelled, deadline, or error: abort everywhere
                await self._abort(rid, flight)
            self.flights.pop(rid, None)
            self.outputs.unregister(rid)
            rt.inflight -= 1

    async def _stream(self, flight: _Flight, request: pb.GenerateRequest):
        rt = self.rt
        rid = request.request_id
        deadline = time.monotonic() + request.deadline_s if request.deadline_s > 0 else None
        done: set[int] = set()
        counts = [0] * flight.n
        last_token_time: float | None = None
        first_token_time: float | None = None
        prompt_tokens = cached = 0
        timing_src: EngineCoreOutput | None = None
        while len(done) < flight.n:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                out = await asyncio.wait_for(flight.queue.get(), timeout)
            except asyncio.TimeoutError:
                raise _DeadlineExceeded(rid) from None
            batch = [out]
            while not flight.queue.empty():
                batch.append(flight.queue.get_nowait())
            deltas: dict[int, pb.SeqDelta] = {}
            now = time.monotonic()
            for o in batch:
                if o.index < 0:  # engine loop died
                    raise RuntimeError(f"engine failed: {rt.loop.error!r}")
                d = deltas.setdefault(o.index, pb.SeqDelta(index=o.index))
                d.token_ids.extend(o.new_token_ids)
                d.logprobs.extend(logprob_to_proto(lp) for lp in o.new_logprobs)
                if o.new_token_ids:
                    counts[o.index] += len(o.new_token_ids)
                    if first_token_time is None:
                        first_token_time = now
                        rt.metrics.ttft.observe(now - flight.arrival)
                    elif last_token_time is not None:
                        rt.metrics.itl.observe(now - last_token_time)
                    last_token_time = now
                prompt_tokens, cached = o.num_prompt_tokens, max(cached, o.num_cached_tokens)
                if o.finished:
                    d.finish_reason = o.finish_reason
                    if o.stop_token_id is not None:
                        d.stop_token_id = o.stop_token_id
                    done.add(o.index)
                    rt.metrics.finished(o.finish_reason)
                    timing_src = o
            chunk = pb.GenerateChunk(request_id=rid, outputs=list(deltas.values()),
                                     worker_id=rt.worker_id)
            if len(done) == flight.n:
                chunk.finished = True
                completion = sum(counts)
                chunk.usage.CopyFrom(pb.Usage(
                    prompt_tokens=prompt_tokens, completion_tokens=completion,
                    cached_tokens=max(cached, flight.remote_cached_tokens)))
                chunk.timings.CopyFrom(self._timings(flight, timing_src, first_token_time, now))
                if chunk.timings.queue_s:
                    rt.metrics.queue.observe(chunk.timings.queue_s)
                rt.metrics.e2e.observe(now - flight.arrival)
                rt.metrics.prompt_tokens.inc(prompt_tokens)
                rt.metrics.generation_tokens.inc(completion)
            yield chunk

    def _timings(self, flight: _Flight, o: EngineCoreOutput | None, first_token: float | None,
                 now: float) -> pb.Timings:
        t = pb.Timings(path=flight.path, transfer_s=flight.transfer_s,
                       transfer_bytes=flight.transfer_bytes,
                       blocks_transferred=flight.blocks_transferred)
        if o is not None and o.first_scheduled_time is not None:
            t.queue_s = max(0.0, o.first_scheduled_time - flight.arrival)
        if first_token is not None:
            t.first_token_s = first_token - flight.arrival
            t.decode_s = now - first_token
            t.prefill_s = (flight.remote_prefill_s if flight.path == "disagg"
                           else max(0.0, t.first_token_s - t.queue_s))
        return t

    async def _abort(self, rid: str, flight: _Flight) -> None:
        task = flight.remote_task
        if task is not None and not task.done():
            task.cancel()  # cancels the Prefill RPC and the posted receives
            try:
                await task
            except BaseException:
                pass
        try:
            await asyncio.wait_for(asyncio.wrap_future(
                self.rt.loop.submit(lambda e: e.abort_request([rid]))), 10.0)
        except Exception:
            logger.exception("abort of %s failed", rid)

    # ---- remote prefill ----------------------------------------------------------------
    def _start_remote(self, rid: str, first_block: int, block_ids: list[int]) -> None:
        flight = self.flights.get(rid)
        if flight is None:
            return
        flight.remote_task = asyncio.ensure_future(self._remote_prefill(flight, first_block, block_ids))

    def _stub(self, address: str) -> pb_grpc.PrefillWorkerStub:
        entry = self.channels.get(address)
        if entry is None:
            channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
            entry = self.channels[address] = (channel, pb_grpc.PrefillWorkerStub(channel))
        return entry[1]

    async def _remote_prefill(self, flight: _Flight, first_block: int, block_ids: list[int]) -> None:
        req = flight.request
        rid = req.request_id
        transfer_id = f"{rid}:{uuid.uuid4().hex[:8]}"
        t0 = time.monotonic()
        handle = None
        try:
            handle = self.receiver.expect(transfer_id, block_ids, timeout_s=self.prefill_timeout_s)
            result = await self._stub(req.prefill_address).Prefill(pb.PrefillRequest(
                request_id=rid, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling,
                cache_salt=req.cache_salt, decode_kv_address=self.receiver.address,
                decode_worker_id=self.rt.worker_id, first_block_index=first_block,
                dst_block_ids=block_ids, transfer_id=transfer_id), timeout=self.prefill_timeout_s)
            remaining = max(0.1, self.prefill_timeout_s - (time.monotonic() - t0))
            await wait_transfer(handle, remaining)
            tokens = sorted(result.first_tokens, key=lambda f: f.index)
            if len(tokens) != flight.n:
                raise RuntimeError(f"prefill worker returned {len(tokens)} first tokens for n={flight.n}")
            flight.transfer_s = time.monotonic() - t0
            flight.transfer_bytes = handle.bytes_received
            flight.blocks_transferred = len(block_ids)
            flight.remote_prefill_s = result.prefill_s
            flight.remote_cached_tokens = result.num_cached_tokens
            first = [first_token_from_proto(f) for f in tokens]
            loop = self.rt.loop
            await asyncio.wrap_future(loop.submit(
                lambda e: loop.deliver(e.finish_remote_prefill(rid, first))))
        except asyncio.CancelledError:
            if handle is not None:
                await cancel_transfer(handle)
            raise
        except Exception as e:
            reason = _fallback_reason(e)
            logger.warning("remote prefill of %s via %s failed (%s: %s); prefilling locally",
                           rid, req.prefill_address, reason, e)
            if handle is not None:
                await cancel_transfer(handle)
            self.fallbacks += 1
            self.rt.metrics.fallback(reason)
            flight.path = "fallback"
            loop = self.rt.loop
            await asyncio.wrap_future(loop.submit(
                lambda e: loop.deliver(e.finish_remote_prefill(rid, None))))

    # ---- Stats -------------------------------------------------------------------------
    async def Stats(self, request: pb.StatsRequest, context) -> pb.WorkerStats:
        return await worker_stats(self.rt, request, fallbacks=self.fallbacks,
                                  transfer=self.receiver.stats)


class _DeadlineExceeded(Exception):
    pass


def _fallback_reason(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        code = e.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            return "unreachable"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "timeout"
        return "prefill_error"
    name = type(e).__name__.lower()
    if "checksum" in name:
        return "checksum"
    if "timeout" in name:
        return "timeout"
    return "transfer_error"


# ---- entry points ----------------------------------------------------------------------

def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_worker_cli_args(parser, ROLE)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    return asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    from kvtransfer import TransferMetrics, create_receiver

    rt = WorkerRuntime(ROLE, args)
    receiver = create_receiver("ucx", rt.engine.runner.kv_cache, rt.kv_geometry(),
                               host=args.advertise_host or args.host, port=args.kv_port,
                               verify_checksums=args.kv_checksums,
                               metrics=TransferMetrics(rt.metrics.registry))
    servicer = DecodeServicer(rt, receiver, args.kv_transfer_timeout)

    async def shutdown() -> None:
        for channel, _ in servicer.channels.values():
            await channel.close()
        receiver.close()

    await serve_worker(rt, lambda s: pb_grpc.add_DecodeWorkerServicer_to_server(servicer, s),
                       extra_ready={"kv_address": receiver.address.hex()},
                       on_shutdown=shutdown, ucx_address=receiver.address.hex())
    return 0
