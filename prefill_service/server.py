"""The prefill worker: ``PrefillWorker.Prefill`` over a paged-KV engine.

It schedules the prompt like any request (chunked prefill, its own prefix cache). After every
engine step the blocks of the range the decode worker asked for that became complete are
handed to the UCX sender straight from the pool (no staging copy), so the transfer overlaps the
rest of the prefill. At the end it samples the first token(s), waits for the sends to finish,
returns the token(s) with the per-block checksums, and releases its blocks into its prefix
cache. Cancelling the call aborts the prefill and cancels the pending sends.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

import grpc

from shared.engine import InvalidRequestError
from shared.outputs import EngineCoreOutput
from shared.proto import pdserve_pb2 as pb
from shared.proto import pdserve_pb2_grpc as pb_grpc
from shared.sampling_params import SamplingParamsError
from shared.service import (WorkerRuntime, add_worker_cli_args, cancel_transfer, configure_logging,
                            serve_worker, wait_transfer, worker_stats)
from shared.wire import logprob_to_proto, sampling_from_proto

logger = logging.getLogger(__name__)
ROLE = "prefill"


class PrefillServicer(pb_grpc.PrefillWorkerServicer):
    def __init__(self, runtime: WorkerRuntime, sender, transfer_timeout_s: float) -> None:
        self.rt = runtime
        self.sender = sender
        self.transfer_timeout_s = transfer_timeout_s
        self.pending_sends = 0

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext):
        rt = self.rt
        aloop = asyncio.get_running_loop()
        rid = request.request_id
        arrival = time.monotonic()
        if rt.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining")
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        prompt = list(request.prompt_token_ids)
        bs = rt.engine.block_size
        n_blocks = -(-len(prompt) // bs)
        first = request.first_block_index
        dst = list(request.dst_block_ids)
        if not prompt:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty")
        if first >= n_blocks or len(dst) != n_blocks - first:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"block range mismatch: prompt of {len(prompt)} tokens has {n_blocks} blocks of "
                f"{bs}; first_block_index {first} needs {max(0, n_blocks - first)} destination "
                f"blocks, got {len(dst)}")
        try:
            params = sampling_from_proto(request.sampling)
        except SamplingParamsError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        params.max_tokens = 1
        params.min_tokens = 0
        try:
            handle = self.sender.open(request.transfer_id or rid, bytes(request.decode_kv_address),
                                      dst, timeout_s=self.transfer_timeout_s)
        except Exception as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"cannot open a KV transfer to the decode worker: {e}")
        queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()

        def sink(out: EngineCoreOutput) -> None:  # engine thread: push ready blocks at once
            if out.kv_blocks_ready:
                src = [block_id for _, block_id in out.kv_blocks_ready]
                handle.send_blocks(src, out.kv_blocks_ready[0][0] - first)
            aloop.call_soon_threadsafe(queue.put_nowait, out)

        rt.loop.add_sink(rid, sink)
        rt.inflight += 1
        self.pending_sends += 1
        added = finished = False
        try:
            try:
                await asyncio.wrap_future(rt.loop.submit(lambda e: e.add_request(
                    rid, prompt, params, cache_salt=request.cache_salt or None,
                    prefill_only=True, kv_export_first_block=first, hold_blocks=True,
                    arrival_time=arrival)))
                added = True
            except InvalidRequestError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            firsts: dict[int, pb.FirstToken] = {}
            last: EngineCoreOutput | None = None
            cached = 0
            while len(firsts) < params.n:
                out = await asyncio.wait_for(queue.get(), self.transfer_timeout_s)
                if out.index < 0 or out.finish_reason == "abort":
                    await context.abort(grpc.StatusCode.ABORTED, f"prefill of {rid} was aborted")
                cached = max(cached, out.num_cached_tokens)
                if out.new_token_ids:
                    ft = pb.FirstToken(index=out.index, token_id=out.new_token_ids[0])
                    if out.new_logprobs:
                        ft.logprob.CopyFrom(logprob_to_proto(out.new_logprobs[0]))
                    firsts[out.index] = ft
                    last = out
            done_compute = time.monotonic()
            handle.finish()
            try:
                await wait_transfer(handle, self.transfer_timeout_s)
            except Exception as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {e}")
            finished = True
            res = pb.PrefillResult(
                request_id=rid, first_tokens=[firsts[i] for i in sorted(firsts)],
                block_checksums=list(handle.checksums or []), num_blocks_sent=len(dst),
                bytes_sent=handle.bytes_sent, num_cached_tokens=cached, worker_id=rt.worker_id,
                transfer_s=time.monotonic() - arrival)
            if last is not None and last.first_scheduled_time is not None:
                res.queue_s = max(0.0, last.first_scheduled_time - arrival)
                res.prefill_s = max(0.0, done_compute - last.first_scheduled_time)
            return res
        finally:
            if not finished:
                await cancel_transfer(handle)
                if added:
                    await asyncio.wrap_future(rt.loop.submit(lambda e: e.abort_request([rid])))
            if added:  # blocks were held for the sends; now they join the prefix cache
                await asyncio.wrap_future(rt.loop.submit(lambda e: e.release(rid)))
            rt.loop.remove_sink(rid)
            rt.inflight -= 1
            self.pending_sends -= 1

    async def Stats(self, request: pb.StatsRequest, context) -> pb.WorkerStats:
        return await worker_stats(self.rt, request, transfer=self.sender.stats,
                                  pending_sends=self.pending_sends)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_worker_cli_args(parser, ROLE)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    return asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    from kvtransfer import TransferMetrics, create_sender

    rt = WorkerRuntime(ROLE, args)
    sender = create_sender("ucx", rt.engine.runner.kv_cache, rt.kv_geometry(),
                           checksums=args.kv_checksums,
                           metrics=TransferMetrics(rt.metrics.registry))
    servicer = PrefillServicer(rt, sender, args.kv_transfer_timeout)

    async def shutdown() -> None:
        sender.close()

    await serve_worker(rt, lambda s: pb_grpc.add_PrefillWorkerServicer_to_server(servicer, s),
                       on_shutdown=shutdown)
    return 0
