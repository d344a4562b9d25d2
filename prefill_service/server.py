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
import concurrent.futures
import itertools
import logging
import time

import grpc

from kvtransfer.handles import SendHandle
from shared.engine import EngineCore, InvalidRequestError
from shared.engine.connector import RemoteDecodeParams
from shared.engine.outputs import EngineCoreOutput, FailureKind, RequestFailure
from shared.engine.sampling_params import SamplingParams, SamplingParamsError
from shared.proto import pdserve_pb2 as pb
from shared.proto import pdserve_pb2_grpc as pb_grpc
from shared.worker.engine_loop import EngineDeadError
from shared.worker.service import (
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
    MAX_ADDRESS_BYTES,
    MAX_CACHE_SALT_CHARS,
    MAX_ID_CHARS,
    WireError,
    check_text,
    logprob_to_proto,
    sampling_from_proto,
)

logger = logging.getLogger(__name__)
ROLE = "prefill"


def first_token_only(params: SamplingParams) -> None:
    """Turn a request's sampling into the prefill worker's: its first token, drawn as the
    request's own first token would be. ``min_tokens`` (at least one token) keeps its ban on
    EOS and the stop ids for that token: with 0 the prefill worker could draw one of them and
    the decode worker would end the request on it, short of its ``min_tokens``."""
    params.max_tokens = 1
    params.min_tokens = min(params.min_tokens, 1)


class _EngineHungError(Exception):
    """The engine was declared hung before the call's request was admitted."""


class PrefillServicer(pb_grpc.PrefillWorkerServicer):
    # The longest a call that did not finish waits for the engine's abort (as decode_service's
    # _abort); its pins are released by the abort command whenever it runs, waited for or not.
    abort_wait_s = 10.0

    def __init__(self, runtime: WorkerRuntime, sender, transfer_timeout_s: float) -> None:
        self.rt = runtime
        self.sender = sender
        self.transfer_timeout_s = transfer_timeout_s
        self.pending_sends = 0
        self._serial = itertools.count()
        self.queues: dict[str, asyncio.Queue[EngineCoreOutput]] = {}  # in flight, by engine id
        self.hangs: dict[str, asyncio.Event] = {}  # by engine id: set when a hang is declared
        runtime.on_hang.append(self._fail_inflight)

    def _fail_inflight(self, why: str) -> None:
        """The engine is hung: fail every Prefill with UNAVAILABLE so decode workers prefill
        locally now instead of at their prefill timeout (those still waiting for admission
        too: their add command is queued behind the stuck step)."""
        failure = RequestFailure(FailureKind.ENGINE, why)
        for eid, q in list(self.queues.items()):
            q.put_nowait(EngineCoreOutput(eid, 0, [], [], "error", failure=failure))
        for hang in list(self.hangs.values()):
            hang.set()

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext):
        rt = self.rt
        aloop = asyncio.get_running_loop()
        rid = request.request_id
        arrival = time.monotonic()
        if rt.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "worker is draining",
                failure_metadata(FAILURE_DRAINING),
            )
        if rt.hung:  # it would wait behind the stuck step: D prefills locally now instead
            await abort_hung(context, rt)
        prompt = request.prompt_token_ids
        bs = rt.engine.block_size
        n_blocks = -(-len(prompt) // bs)
        first = request.first_block_index
        dst = list(request.dst_block_ids)
        try:
            check_text(rid, "request_id", MAX_ID_CHARS, required=True)
            check_text(request.transfer_id, "transfer_id", MAX_ID_CHARS)
            check_text(request.cache_salt, "cache_salt", MAX_CACHE_SALT_CHARS)
            check_text(request.decode_worker_id, "decode_worker_id", MAX_ID_CHARS)
            if len(request.decode_kv_address) > MAX_ADDRESS_BYTES:
                raise WireError(
                    f"decode_kv_address has {len(request.decode_kv_address)} bytes; "
                    f"at most {MAX_ADDRESS_BYTES} allowed",
                    "decode_kv_address",
                )
            if not prompt:
                raise WireError("the prompt is empty", "prompt_token_ids")
            params = sampling_from_proto(request.sampling, rt.engine.args.max_logprobs)
            # the engine's own checks (add_request's), here before the admission check, which
            # refused an invalid prompt RESOURCE_EXHAUSTED while requests waited
            rt.engine.validate_prompt(prompt, params)
            if first >= n_blocks or len(dst) != n_blocks - first:
                raise WireError(
                    f"block range mismatch: prompt of {len(prompt)} tokens has {n_blocks} blocks "
                    f"of {bs}; first_block_index {first} needs {max(0, n_blocks - first)} "
                    f"destination blocks, got {len(dst)}",
                    "dst_block_ids",
                )
            grammar = None
            if params.structured_outputs is not None:  # compiled here, not on the engine thread
                grammar = await compile_grammar(rt.engine, params)
        except (WireError, SamplingParamsError, InvalidRequestError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFullError as e:  # the grammar threads' queue
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        first_token_only(params)
        try:
            handle = self.sender.open(
                request.transfer_id or rid,
                bytes(request.decode_kv_address),
                dst,
                timeout_s=self.transfer_timeout_s,
            )
        except Exception as e:  # noqa: BLE001 - a bad address or a dead link: refused
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"cannot open a KV transfer to the decode worker: {e}",
            )
        queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
        pins: list[int] = []  # the engine's pin on the blocks handed to the sender (one at most)
        noted: dict[int, pb.FirstToken] = {}  # the first tokens, as the engine thread saw them
        noted_cached = 0
        result: pb.PrefillResult | None = None  # built by the sink with the last first token

        def sink(out: EngineCoreOutput) -> None:  # engine thread: push ready blocks at once
            nonlocal noted_cached, result
            if out.kv_blocks_ready:
                if out.kv_pin_id is not None and out.kv_pin_id not in pins:
                    pins.append(out.kv_pin_id)
                src = [block_id for _, block_id in out.kv_blocks_ready]
                handle.send_blocks(src, out.kv_blocks_ready[0][0] - first)
            if out.failure is None and out.finish_reason != "abort" and len(noted) < params.n:
                noted_cached = max(noted_cached, out.num_cached_tokens)
                if out.new_token_ids:
                    noted[out.index] = _first_token(out)
                    if len(noted) == params.n:
                        # The first token(s) go with the transfer's ``fin``, behind the last
                        # block, from this thread: the decode worker starts on them without
                        # waiting for this call's reply (its acknowledgement, this worker's
                        # event loop, a gRPC hop). The reply below is the same result with
                        # the transfer's figures added.
                        note = pb.PrefillResult(
                            request_id=rid,
                            first_tokens=[noted[i] for i in sorted(noted)],
                            num_cached_tokens=noted_cached,
                            worker_id=rt.worker_id,
                        )
                        if out.first_scheduled_time is not None:
                            note.queue_s = max(0.0, out.first_scheduled_time - arrival)
                            note.prefill_s = max(0.0, time.monotonic() - out.first_scheduled_time)
                            # once per request (the result is built once); a Histogram may be
                            # observed from this thread (its lock)
                            rt.metrics.queue.observe(note.queue_s)
                        result = note
                        try:
                            handle.finish(note.SerializeToString())
                        except Exception as e:  # noqa: BLE001 - the handler's finish() says it
                            logger.debug("early finish of %s's transfer: %s", rid, e)
            aloop.call_soon_threadsafe(queue.put_nowait, out)

        eid = f"{rid}@{next(self._serial)}"  # unique: a retried id never meets an old one
        hang = asyncio.Event()
        rt.loop.add_sink(eid, sink)
        self.queues[eid] = queue
        self.hangs[eid] = hang
        rt.inflight += 1
        self.pending_sends += 1
        # Set before the hand-over: a cancelled await cannot stop a command the engine thread
        # already runs, nor undo one it ran, so once submitted the request may be admitted.
        submitted = finished = False
        try:
            try:

                def add(e: EngineCore) -> None:
                    rt.admit(e, len(prompt))
                    e.add_request(
                        eid,
                        prompt,
                        params,
                        cache_salt=request.cache_salt or None,
                        kv_transfer=RemoteDecodeParams(first),
                        arrival_time=arrival,
                        grammar=grammar,
                    )

                if rt.hung:  # declared while the call was validated
                    raise _EngineHungError
                submitted = True
                added = rt.loop.submit(add)
                if await admission(added, hang) is not None:
                    # not admitted when the hang was declared: the add never runs if it had
                    # not begun, else the abort below ends the request it admitted
                    submitted = not added.cancelled()
                    raise _EngineHungError
            except _EngineHungError:
                await abort_hung(context, rt)
            except QueueFullError as e:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except InvalidRequestError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except EngineDeadError as e:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE, str(e), failure_metadata(FAILURE_ENGINE)
                )
            # the sink sees each output before this loop does: once it has built the result,
            # every first token is in
            while result is None:
                try:
                    out = await asyncio.wait_for(queue.get(), self.transfer_timeout_s)
                except TimeoutError:  # was UNKNOWN (the decode worker counted prefill_error)
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"prefill of {rid} produced nothing in {self.transfer_timeout_s:g} s",
                    )
                if out.failure is not None:
                    engine = out.failure.kind is FailureKind.ENGINE
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE if engine else grpc.StatusCode.INTERNAL,
                        f"prefill of {rid} failed: {out.failure.message}",
                        failure_metadata(FAILURE_ENGINE if engine else FAILURE_REQUEST),
                    )
                if out.finish_reason == "abort":
                    await context.abort(grpc.StatusCode.ABORTED, f"prefill of {rid} was aborted")
            handle.finish()  # (done by the sink already unless the blocks were late)
            try:
                await wait_transfer(handle, self.transfer_timeout_s)
            except Exception as e:  # noqa: BLE001 - any transfer failure: the status says it
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {e}")
            finished = True
            # (none with --no-kv-checksums: the handle then holds None for every block)
            result.block_checksums.extend(c for c in handle.checksums if c is not None)
            result.num_blocks_sent = len(dst)
            result.bytes_sent = handle.bytes_sent
            result.transfer_s = time.monotonic() - arrival
            return result
        finally:
            try:
                if finished:
                    # the request ended in the engine (its first tokens were its last): no
                    # output, no pin comes any more. The blocks handed to the sender join the
                    # prefix cache once the send is terminal.
                    for pin_id in pins:
                        unpin_when_terminal(rt.loop, handle, pin_id)
                    rt.loop.remove_sink(eid)
                else:
                    # Shielded: the decode worker cancels this call as soon as it sees the
                    # transfer fail, which landed here and skipped the clean-up (the blocks
                    # stayed pinned for good). The pins are released by the abort command on
                    # the engine thread, whatever happens to this task.
                    await asyncio.shield(self._end_unfinished(handle, eid, submitted, pins, hang))
            finally:
                self.queues.pop(eid, None)
                self.hangs.pop(eid, None)
                rt.inflight -= 1
                self.pending_sends -= 1

    async def _end_unfinished(
        self, handle: SendHandle, eid: str, submitted: bool, pins: list[int], hang: asyncio.Event
    ) -> None:
        """A Prefill that did not finish: its transfer cancelled, its request aborted, and the
        blocks it pinned released once the abort ran (see :meth:`_abort_and_release`)."""
        rt = self.rt
        try:
            await cancel_transfer(handle)
        except Exception:  # the abort and the release below must still happen
            logger.exception("cancelling the transfer of %s failed", eid)
        if not submitted:  # its add never ran: no output, no pin
            rt.loop.remove_sink(eid)
            return
        released = self._abort_and_release(handle, eid, pins)
        if rt.hung or hang.is_set():  # queued: done when (if) the engine steps again
            return
        done = asyncio.wrap_future(released)
        done.add_done_callback(_retrieved)
        # bounded: a call cancelled while the engine stalls must not hold its handler (and
        # rt.inflight: a drain) until the engine moves again; no wait once it is declared hung
        hung = asyncio.ensure_future(hang.wait())
        try:
            await asyncio.wait(
                {done, hung}, timeout=self.abort_wait_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            hung.cancel()
        if not done.done():
            logger.warning(
                "abort of %s not run after %.0f s (the engine stalls); its blocks are "
                "released when it runs",
                eid,
                self.abort_wait_s,
            )

    def _abort_and_release(
        self, handle: SendHandle, eid: str, pins: list[int]
    ) -> concurrent.futures.Future:
        """Abort ``eid`` on the engine thread, then (in the same command) take its sink away
        and collect its pins: commands run in order between steps, so a step still running
        when the call ended (a hang, a stall) has delivered its outputs, and the pin they
        carry, to the sink by then, and after the abort no output comes for ``eid``. The
        pins are dropped there if the transfer is terminal, else once it is (event loop)."""
        rt = self.rt
        aloop = asyncio.get_running_loop()

        def abort(e: EngineCore) -> list[int]:
            try:
                e.abort_request([eid])  # unknown ids (ended, or never added) are ignored
            except Exception:
                logger.exception("abort of %s failed", eid)
            rt.loop.remove_sink(eid)
            if handle.done:  # no byte of the transfer touches the blocks any more
                for pin_id in pins:
                    e.unpin(pin_id)
                return []
            return list(pins)

        def after(fut: concurrent.futures.Future) -> None:  # engine thread (or event loop)
            if fut.cancelled() or fut.exception() is not None:  # the engine died: nothing
                rt.loop.remove_sink(eid)  # to unpin (gone with it)
                return
            left = fut.result()
            if left:
                try:
                    aloop.call_soon_threadsafe(_unpin_all, rt, handle, left)
                except RuntimeError:  # the event loop is closed: the worker is gone
                    logger.error("%s: %d pin(s) not released at shutdown", eid, len(left))

        released = rt.loop.submit(abort)
        released.add_done_callback(after)
        return released

    async def Stats(self, request: pb.StatsRequest, context) -> pb.WorkerStats:
        return await worker_stats(
            self.rt, request, transfer=self.sender.stats, pending_sends=self.pending_sends
        )


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # (an EngineDeadError: nothing left to abort)


def _unpin_all(rt: WorkerRuntime, handle: SendHandle, pins: list[int]) -> None:
    for pin_id in pins:
        unpin_when_terminal(rt.loop, handle, pin_id)


def _first_token(out: EngineCoreOutput) -> pb.FirstToken:
    ft = pb.FirstToken(
        index=out.index,
        token_id=out.new_token_ids[0],
        # a stop the decode worker's rules alone would not see (a grammar's end)
        end=out.finished and out.finish_reason == "stop",
    )
    if out.new_logprobs:
        ft.logprob.CopyFrom(logprob_to_proto(out.new_logprobs[0]))
    return ft


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_worker_cli_args(parser, ROLE)


def run(args: argparse.Namespace) -> int:
    return run_worker(ROLE, args, _main)


async def _main(args: argparse.Namespace) -> int:
    from kvtransfer import TransferMetrics, create_sender

    transport = kv_transport_options(args)  # a bad transport flag fails before the model loads
    rt = WorkerRuntime(ROLE, args)
    sender = create_sender(
        args.kv_transport,
        rt.engine.runner.transfer_pool,
        rt.kv_geometry(),
        checksums=args.kv_checksums,
        secret=rt.security.secret,
        metrics=TransferMetrics(rt.metrics.registry),
        **transport,
    )
    logger.info("KV transfer: %s sender", args.kv_transport)
    servicer = PrefillServicer(rt, sender, args.kv_transfer_timeout)

    async def shutdown() -> None:
        sender.close()

    return await serve_worker(
        rt, lambda s: pb_grpc.add_PrefillWorkerServicer_to_server(servicer, s), on_shutdown=shutdown
    )
