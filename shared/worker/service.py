"""Plumbing shared by the two worker roles: flags, engine thread, KV pool transport geometry,
Redis lease and KV-event publishing, Prometheus endpoint, gRPC health, graceful drain.

The services (``prefill_service``, ``decode_service``) build a ``WorkerRuntime`` and add their
gRPC servicer; they never import each other.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shared.config import ConfigError, EngineArgs, float_at_least, port_number
from shared.engine import EngineCore, InvalidRequestError
from shared.engine.connector import connector_for_role
from shared.engine.outputs import EngineCoreOutput
from shared.pauses import PauseLog
from shared.ports import host_port
from shared.prom import freeze_startup_heap
from shared.proto.channel_options import CLIENT_OPTIONS, SERVER_OPTIONS
from shared.proto.failure import FAILURE_ENGINE, failure_metadata
from shared.security import ClusterSecurity, SecurityConfigError
from shared.worker.engine_loop import EngineDeadError, EngineLoop
from shared.worker.metrics import WorkerMetrics

logger = logging.getLogger(__name__)

# servers: accept the clients' keepalive pings; clients (D's channel to P) detect a frozen peer
GRPC_OPTIONS = SERVER_OPTIONS
CLIENT_GRPC_OPTIONS = CLIENT_OPTIONS


def add_worker_cli_args(parser: argparse.ArgumentParser, role: str) -> None:
    EngineArgs.add_cli_args(parser)
    g = parser.add_argument_group(f"{role} worker")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (gRPC, metrics, KV)")
    g.add_argument(
        "--advertise-host",
        default=None,
        help="address other processes use to reach this worker (default: --host)",
    )
    g.add_argument("--port", type=port_number, default=0, help="gRPC port (0 = any free port)")
    g.add_argument(
        "--metrics-port", type=port_number, default=0, help="Prometheus /metrics port (0 = any)"
    )
    g.add_argument("--kv-port", type=port_number, default=0, help="UCX listener port (decode role)")
    g.add_argument(
        "--kv-transport",
        default="ucx",
        choices=("ucx", "nixl"),
        help="KV transfer data path: ucx (ucxx tagged messages pushed by the prefill worker) or "
        "nixl (NIXL one-sided reads by the decode worker: CMA on one host, RDMA between hosts; "
        "needs pdserve[nixl]); prefill and decode workers must use the same",
    )
    g.add_argument(
        "--kv-transfer-timeout",
        type=float_at_least(0.001),
        default=30.0,
        help="seconds a KV transfer may take before it fails (and D prefills locally)",
    )
    g.add_argument(
        "--no-kv-checksums",
        dest="kv_checksums",
        action="store_false",
        help="skip per-block xxh3 checksums of transferred KV",
    )
    g.add_argument("--redis-url", default=None, help="registry/directory Redis (none: standalone)")
    g.add_argument("--directory-prefix", default="pds:")
    g.add_argument("--worker-id", default=None)
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=0,
        help="refuse new requests with RESOURCE_EXHAUSTED (the router then tries another "
        "worker, or answers 429 with Retry-After) while this many wait to be scheduled; 0 = "
        "4 x --max-num-seqs",
    )
    g.add_argument(
        "--max-waiting-tokens",
        type=int,
        default=0,
        help="the same bound in tokens still to compute for waiting requests; 0 = twice the "
        "KV cache's tokens (the work the cache can hold twice over), -1 = none",
    )
    g.add_argument(
        "--engine-hang-timeout",
        type=float_at_least(0),
        default=60.0,
        help="seconds without a finished engine step (while work is queued) after which the "
        "worker reports NOT_SERVING and lets its registry lease lapse, until a step finishes "
        "(vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S plays this part); a worker of several ranks "
        "(TP/PP) still hung after 3 times this exits with status 1 (to be restarted); 0 = off",
    )
    g.add_argument(
        "--drain-timeout",
        type=float_at_least(0),
        default=30.0,
        help="on SIGTERM, seconds to finish in-flight requests before exiting",
    )
    g.add_argument(
        "--ready-file", default=None, help="write a JSON file with the bound addresses once serving"
    )
    g.add_argument("--log-level", default=os.environ.get("PDSERVE_LOG_LEVEL", "info"))
    ClusterSecurity.add_cli_args(parser)


def kv_transport_options(args: argparse.Namespace) -> dict[str, Any]:
    """The transport options of ``--kv-transport`` for ``create_sender`` / ``create_receiver``,
    checked before the worker starts: NIXL missing, or a bad ``PDSERVE_NIXL_PROGRESS_US``, is
    a :class:`ConfigError` (one line, exit 2), not a traceback."""
    if args.kv_transport != "nixl":
        return {}
    from kvtransfer.nixl_agent import nixl_bindings, progress_us_from_env

    try:
        nixl_bindings()
        return {"nixl_progress_us": progress_us_from_env()}
    except (ImportError, ValueError) as e:
        raise ConfigError(f"--kv-transport nixl: {e}") from None


def run_worker(
    role: str, args: argparse.Namespace, main: Callable[[argparse.Namespace], Awaitable[int]]
) -> int:
    """A worker process's entry point: logging, then ``main`` on an event loop. A bad flag,
    model directory or secret is one line on stderr and exit status 2 (as for the router),
    not a traceback."""
    configure_logging(args.log_level)
    try:
        from shared.engine.structured_output import check_environment

        check_environment()
        if getattr(args, "node_rank", 0) > 0:
            return run_follower(EngineArgs.from_cli_args(args))
        return asyncio.run(main(args))
    except (ConfigError, SecurityConfigError) as e:
        print(f"pdserve {role}: error: {e}", file=sys.stderr)
        return 2


def run_follower(engine_args: EngineArgs) -> int:
    """``--node-rank k > 0``: this host runs only its ranks of a worker whose rank 0 (and
    service) is on node 0; exits when they do."""
    from shared.engine.device import resolve_device
    from shared.engine.distributed import WorkerSpec, run_follower_node

    model_config = engine_args.create_model_config()
    pc = engine_args.create_parallel_config()
    pc.check(model_config)
    device = resolve_device(engine_args.device)
    return run_follower_node(
        WorkerSpec(
            model_config,
            engine_args.create_cache_config(),
            engine_args.create_scheduler_config(model_config, device),
            device,
            engine_args.attention_backend,
            engine_args.seed,
            pc,
        )
    )


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # The engine thread holds the GIL between torch calls; a shorter switch interval keeps the
    # gRPC and UCX I/O threads from waiting up to 5 ms (CPython's default) for it.
    import sys

    sys.setswitchinterval(0.0005)


class QueueFullError(Exception):
    """The worker's waiting queue is at its bound (-> RESOURCE_EXHAUSTED)."""


class WorkerRuntime:
    """Engine + engine thread + metrics + Redis lease/publisher for one worker process."""

    def __init__(self, role: str, args: argparse.Namespace) -> None:
        self.role = role
        self.args = args
        self.worker_id = args.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"
        self.security = ClusterSecurity.from_cli_args(args)
        self.security.warn_if_open(f"{role} worker")
        engine_args = EngineArgs.from_cli_args(args)
        if role == "prefill" and engine_args.speculative_config:
            # a prefill worker draws one token per request: nothing to speculate on (and no
            # draft model to load); pdserve up passes the same engine flags to both pools
            logger.info("prefill worker: --speculative-config ignored")
            engine_args.speculative_config = None
        self.engine = EngineCore(engine_args, connector=connector_for_role(role))
        mc = self.engine.model_config
        self.model_name = mc.served_model_name
        self.metrics = WorkerMetrics(role, self.worker_id, self.model_name, self.engine.stats)
        self.role_hook: Callable[[EngineCore, list[EngineCoreOutput]], None] | None = None
        self.loop = EngineLoop(
            self.engine,
            on_step=self._on_step,
            on_fatal=self._on_fatal,
            on_step_time=self.metrics.observe_step,
        )
        self.fatal: asyncio.Event | None = None  # set (event loop) when the engine died
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._publishing = False  # a publisher drains _events (only with --redis-url)
        self._redis_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.lease = None
        self.publisher = None
        self.draining = False
        self.inflight = 0
        self.hung = False  # the engine thread made no progress for --engine-hang-timeout
        # called on the event loop when the engine is declared hung: each role fails the
        # requests it has in flight (UNAVAILABLE, so they fail over instead of waiting it out)
        self.on_hang: list[Callable[[str], None]] = []
        sc = self.engine.scheduler_config
        self.max_waiting = args.max_waiting_requests or 4 * sc.max_num_seqs
        kv_tokens = self.engine.num_blocks * self.engine.block_size
        self.max_waiting_tokens = (
            None if args.max_waiting_tokens < 0 else (args.max_waiting_tokens or 2 * kv_tokens)
        )

    # ---- engine thread ---------------------------------------------------------------
    def admit(self, engine: EngineCore, num_tokens: int) -> None:
        """Backpressure by default (engine thread, in the command that adds the request):
        raise :class:`QueueFullError` while the waiting queue is at its bound, in requests or
        in tokens still to compute, so that a burst is refused fast (and sent elsewhere or
        retried by the client) instead of waiting until its deadline."""
        sch = engine.scheduler
        waiting = sch.num_waiting
        if waiting >= self.max_waiting:
            raise QueueFullError(
                f"{waiting} requests are waiting on worker {self.worker_id} "
                f"(--max-waiting-requests {self.max_waiting})"
            )
        if self.max_waiting_tokens is not None and waiting:
            queued = sum(r.num_tokens - r.num_computed_tokens for r in sch.waiting)
            queued += sum(r.num_tokens - r.num_computed_tokens for r in sch.swapped)
            if queued + num_tokens > self.max_waiting_tokens:
                raise QueueFullError(
                    f"{queued} tokens are waiting on worker {self.worker_id} "
                    f"(--max-waiting-tokens {self.max_waiting_tokens})"
                )

    def _on_fatal(self, error: BaseException) -> None:
        if self._aloop is not None and self.fatal is not None:
            self._aloop.call_soon_threadsafe(self.fatal.set)

    def _on_step(self, engine: EngineCore, outputs: list[EngineCoreOutput]) -> None:
        events = engine.take_kv_events()  # taken even when unpublished: the pool keeps them
        if events and self._publishing:
            self._events.put(events)
        if self.role_hook is not None:
            self.role_hook(engine, outputs)

    def kv_geometry(self):
        from kvtransfer.geometry import KVGeometry

        mc = self.engine.model_config
        kv = self.engine.runner.transfer_pool
        return KVGeometry(
            model=self.model_name,
            dtype=str(kv.dtype).replace("torch.", ""),
            block_size=self.engine.block_size,
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
        )

    # ---- Redis -------------------------------------------------------------------------
    def start_registry(self, grpc_addr: str, ucx_addr: str, metrics_url: str) -> None:
        if not self.args.redis_url:
            logger.info("no --redis-url: running without registry")
            return
        from shared.directory import (
            DirectoryKeys,
            KVEventPublisher,
            WorkerInfo,
            WorkerLease,
            connect_sync,
        )

        client = connect_sync(self.args.redis_url)
        info = WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            model=self.model_name,
            grpc=grpc_addr,
            block_size=self.engine.block_size,
            num_blocks=self.engine.num_blocks,
            ucx=ucx_addr,
            metrics=metrics_url,
            max_model_len=self.engine.model_config.max_model_len,
            quantization=(
                q.describe() if (q := self.engine.model_config.quantization) is not None else ""
            ),
        )
        self.lease = WorkerLease(client, info, keys=DirectoryKeys(self.args.directory_prefix))
        self.publisher = KVEventPublisher(client, self.lease)
        self.lease.register(self.load())
        self.lease.start(self.load, alive_fn=lambda: not self.hung)
        self._publishing = True
        self._redis_thread = threading.Thread(
            target=self._publish_loop, name="kv-events", daemon=True
        )
        self._redis_thread.start()

    def load(self):
        from shared.directory import WorkerLoad

        s = self.engine.stats()
        return WorkerLoad(free_blocks=s.free_blocks, running=s.running, waiting=s.waiting)

    def _publish_loop(self) -> None:
        while not self._stop.is_set():
            try:
                batch = self._events.get(timeout=1.0)
            except queue.Empty:
                self.publisher.publish([])  # retries anything a Redis outage left pending
                continue
            while True:  # catch up: fold every queued step into this flush
                try:
                    batch = batch + self._events.get_nowait()
                except queue.Empty:
                    break
            self.publisher.publish(batch)

    def stop_registry(self) -> None:
        self._stop.set()
        if self._redis_thread is not None:
            self._redis_thread.join(3.0)
        if self.publisher is not None:
            self.publisher.clear()
        if self.lease is not None:
            self.lease.stop()
            self.lease.deregister()


def start_metrics_server(host: str, port: int, registry):
    """Serve ``/metrics`` (Prometheus text format 0.0.4 always, so the ``pdserve:`` names
    survive any scraper's content negotiation) and ``/health`` from a daemon thread."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.split("?")[0] == "/metrics":
                body, ctype, code = generate_latest(registry), CONTENT_TYPE_LATEST, 200
            elif self.path == "/health":
                body, ctype, code = b"ok\n", "text/plain", 200
            else:
                body, ctype, code = b"not found\n", "text/plain", 404
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # scrapes are not worth a log line each
            pass

    class Server(ThreadingHTTPServer):
        # an IPv6 literal needs an AF_INET6 socket (ThreadingHTTPServer's is AF_INET)
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    httpd = Server((host.strip("[]"), port), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd


def advertise(args: argparse.Namespace, port: int) -> str:
    return host_port(args.advertise_host or args.host, port)


async def serve_worker(
    runtime: WorkerRuntime,
    add_servicer: Callable[[grpc.aio.Server], None],
    extra_ready: dict | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    ucx_address: str = "",
) -> int:
    """Start gRPC + health + metrics, register, wait for SIGTERM/SIGINT, drain, stop.

    Returns the process exit code: 0 after a drain, 1 when the engine died (then the worker
    turns NOT_SERVING and leaves the registry at once, without a drain: every request on it
    already failed, and its supervisor restarts it)."""
    args = runtime.args
    runtime._aloop = asyncio.get_running_loop()
    runtime.fatal = asyncio.Event()
    runtime.loop.start()
    server = grpc.aio.server(
        options=GRPC_OPTIONS, interceptors=runtime.security.server_interceptors()
    )
    add_servicer(server)
    health_servicer = (
        health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = runtime.security.add_port(server, host_port(args.host, args.port))
    await server.start()
    # the model, the engine and the servers live as long as the process: out of the cyclic
    # collector's reach, so a full collection walks only what requests allocate (measured:
    # ~240k objects for the small model, whose full collection took 0.1-0.3 s of every thread)
    frozen = freeze_startup_heap()
    logger.info("froze %d start-up objects out of the garbage collector's generations", frozen)
    httpd = start_metrics_server(args.host, args.metrics_port, runtime.metrics.registry)
    metrics_port = httpd.server_port
    grpc_addr = advertise(args, port)
    metrics_url = f"http://{advertise(args, metrics_port)}/metrics"
    runtime.start_registry(grpc_addr, ucx_address, metrics_url)
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
    ready = {
        "worker_id": runtime.worker_id,
        "role": runtime.role,
        "grpc": grpc_addr,
        "metrics": metrics_url,
        "kv_capacity": runtime.engine.capacity_line,
        "num_blocks": runtime.engine.num_blocks,
        "pid": os.getpid(),
        **(extra_ready or {}),
    }
    logger.info(
        "%s worker %s serving gRPC on %s, metrics on %s",
        runtime.role,
        runtime.worker_id,
        grpc_addr,
        metrics_url,
    )
    logger.info(runtime.engine.capacity_line)
    if args.ready_file:
        tmp = Path(args.ready_file + ".tmp")
        tmp.write_text(json.dumps(ready))
        tmp.replace(args.ready_file)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if not runtime.loop.alive:  # died before the event existed
        runtime.fatal.set()
    stopper = asyncio.ensure_future(stop.wait())
    dier = asyncio.ensure_future(runtime.fatal.wait())
    watcher = asyncio.ensure_future(_watch_hang(runtime, health_servicer))
    await asyncio.wait([stopper, dier], return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    dier.cancel()
    watcher.cancel()
    died = runtime.fatal.is_set()

    runtime.draining = True
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    if died:
        logger.critical(
            "engine died (%r): NOT_SERVING, leaving the registry, exiting", runtime.loop.error
        )
        await asyncio.to_thread(runtime.stop_registry)
    else:
        # Drain: stop admitting, leave the registry so routers stop choosing us, finish in flight.
        logger.info("draining (%d in flight, up to %.0fs)", runtime.inflight, args.drain_timeout)
        await asyncio.to_thread(runtime.stop_registry)
        deadline = time.monotonic() + args.drain_timeout
        while runtime.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    if on_shutdown is not None:
        await on_shutdown()
    await server.stop(grace=0.5 if died else 2.0)
    httpd.shutdown()
    runtime.loop.stop()
    runtime.engine.shutdown()
    logger.info("worker %s stopped", runtime.worker_id)
    return 1 if died else 0


#: A worker of several ranks (TP / PP) whose engine stays hung this many times
#: ``--engine-hang-timeout`` exits (status 1) so that its supervisor restarts it. Every wait on
#: another rank is bounded (``PDSERVE_DIST_TIMEOUT_S`` / ``PDSERVE_SHM_TIMEOUT_S``, 60 s: the
#: step fails and the worker exits by itself); this is the backstop for a wait that is not. A
#: worker of one rank only turns NOT_SERVING (a slow step there recovers by itself).
HANG_EXIT_FACTOR = 3


def _hang_exit_after(runtime: WorkerRuntime, limit: float) -> float | None:
    """Seconds of a hung engine after which this worker exits (``None``: never)."""
    world = getattr(getattr(runtime.engine, "parallel_config", None), "world_size", 1)
    if limit <= 0 or not isinstance(world, int) or world <= 1:
        return None
    return HANG_EXIT_FACTOR * limit


def _exit_hung(runtime: WorkerRuntime, stalled: float) -> None:
    """The backstop: kill this node's rank processes (a stopped one would outlive us) and
    exit at once; a clean shutdown would wait on the hung engine thread and on its ranks."""
    logger.critical(
        "engine made no progress for %.0f s (%d x --engine-hang-timeout) on a worker of "
        "several ranks: exiting so that it is restarted",
        stalled,
        HANG_EXIT_FACTOR,
    )
    executor = getattr(getattr(runtime.engine, "runner", None), "executor", None)
    for p in getattr(executor, "procs", None) or []:
        try:
            p.proc.kill()  # SIGKILL: a stopped process too
        except Exception:
            logger.debug("killing rank %s failed", getattr(p, "rank", "?"), exc_info=True)
    logging.shutdown()
    os._exit(1)


async def _watch_hang(
    runtime: WorkerRuntime,
    health_servicer,
    period_s: float = 0.5,
    pauses: PauseLog | None = None,
) -> None:
    """Liveness that tells the truth: when no engine step finished for
    ``--engine-hang-timeout`` while work is queued, turn NOT_SERVING, let the lease lapse
    (routers stop sending here) and fail the requests in flight with UNAVAILABLE (the router
    resumes them elsewhere, a decode worker prefills locally); turn SERVING again once a step
    finishes. A worker of several ranks hung ``HANG_EXIT_FACTOR`` times as long exits.

    Time the whole process was paused (``PauseLog``, ticked here) is not a hang: a worker stopped for
    longer than the timeout in the middle of a step, then continued, would otherwise fail
    everything in flight on resume (and a worker of several ranks exit) before the step it
    was in could finish."""
    limit = runtime.args.engine_hang_timeout
    exit_after = _hang_exit_after(runtime, limit)
    pauses = pauses or PauseLog(period_s)
    forgiven = 0.0  # paused seconds inside the current stall
    last_raw = 0.0
    while True:
        await asyncio.sleep(period_s)
        paused = pauses.check()
        raw = runtime.loop.stalled_for()
        if raw < last_raw:
            forgiven = 0.0  # the engine progressed: this stall began after those pauses
        last_raw = raw
        forgiven = min(raw, forgiven + paused)
        stalled = raw - forgiven
        if exit_after is not None and stalled > exit_after:
            _exit_hung(runtime, stalled)
        hung = limit > 0 and stalled > limit
        if hung and not runtime.hung:
            runtime.hung = True
            logger.critical(
                "engine made no progress for %.0f s: NOT_SERVING, leaving the "
                "registry until it does",
                stalled,
            )
            runtime.metrics.hung(True)
            await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
            why = f"the engine made no progress for {stalled:.0f} s"
            for fail_inflight in runtime.on_hang:
                try:
                    fail_inflight(why)
                except Exception:  # one role's hook never stops the watcher
                    logger.exception("failing in-flight requests after a hang failed")
        elif not hung and runtime.hung:
            runtime.hung = False
            logger.warning("engine progresses again after a hang: SERVING")
            runtime.metrics.hung(False)
            if not runtime.draining:
                await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)


async def _set_health(servicer, status) -> None:
    result = servicer.set("", status)
    if asyncio.iscoroutine(result):
        await result


# ---- helpers for both roles -------------------------------------------------------------


def unpin_when_terminal(loop: EngineLoop, handle, pin_id: int | None) -> None:
    """Drop the engine pin ``pin_id`` once ``handle`` (a kvtransfer handle, or None when no
    transfer was opened) is terminal: at once if it is, else when it becomes so. Never before:
    until then bytes may still move to or from the pinned blocks."""
    if pin_id is None:
        return

    def unpin(_=None) -> None:
        fut = loop.submit(lambda e: e.unpin(pin_id))
        fut.add_done_callback(_log_unpin_error)

    if handle is None or handle.done:
        unpin()
    else:
        asyncio.ensure_future(_after_terminal(handle, unpin))


async def _after_terminal(handle, fn) -> None:
    await handle
    fn()


def _log_unpin_error(fut) -> None:
    e = fut.exception()
    if e is not None and not isinstance(e, EngineDeadError):
        logger.error("unpin failed: %r", e)


async def wait_transfer(handle, timeout_s: float) -> None:
    """Wait (without blocking the event loop) until a kvtransfer handle is terminal; raise its
    error, or ``TimeoutError`` after ``timeout_s``."""
    if not handle.done:
        await asyncio.wait_for(handle, timeout_s)  # (a handle's await is shielded)
    handle.raise_for_state()


HUNG_MESSAGE = "the engine of worker {} is hung (no progress for --engine-hang-timeout)"


async def abort_hung(context: grpc.aio.ServicerContext, rt: WorkerRuntime) -> None:
    """End a call UNAVAILABLE with the engine failure: the engine is hung, and a request would
    wait behind its stuck step (the router resumes it elsewhere; a decode worker prefills
    locally instead)."""
    await context.abort(
        grpc.StatusCode.UNAVAILABLE,
        HUNG_MESSAGE.format(rt.worker_id),
        failure_metadata(FAILURE_ENGINE),
    )


async def admission(
    added: concurrent.futures.Future, hang: asyncio.Event, deadline: float | None = None
) -> str | None:
    """Wait for a request's add command (``EngineLoop.submit``'s future) until ``deadline``
    (``time.monotonic()``; None: no bound) or a hang's declaration: None once it ran (raising
    what it raised), else ``"hung"`` or ``"deadline"``. The add is then cancelled if it has not
    begun (``added.cancelled()``); if it had, it admits the request, which the caller's abort
    ends."""
    admitted = asyncio.wrap_future(added)
    hung = asyncio.ensure_future(hang.wait())
    try:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        await asyncio.wait({admitted, hung}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hung.cancel()
        if not admitted.done():  # hung, past the deadline or this call cancelled: not now
            added.cancel()  # (at once: ``admitted``'s cancel reaches ``added`` only later)
            admitted.cancel()
    if admitted.cancelled():
        return "hung" if hang.is_set() else "deadline"
    admitted.result()
    return None


async def within(fut: asyncio.Future, deadline: float | None) -> bool:
    """Wait for ``fut`` until ``deadline`` (``time.monotonic()``; ``None``: no bound); False
    if it passed first (``fut`` is left as it is)."""
    if deadline is None:
        await fut
        return True
    try:
        done, _ = await asyncio.wait((fut,), timeout=max(0.0, deadline - time.monotonic()))
    except asyncio.CancelledError:
        fut.cancel()  # as ``await fut`` would
        raise
    if not done:  # its outcome, whenever it comes, is nobody's: read it (no "never retrieved")
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return bool(done)


async def compile_grammar(
    engine: EngineCore, params, deadline: float | None = None
) -> object | None:
    """Compile ``params``' grammar off the event loop, on the grammar threads: the compiled
    grammar, for ``add_request(grammar=...)`` (so the engine thread never compiles, even if
    the LRU evicted it meanwhile); None when the request's ``deadline``
    (``time.monotonic()``) passed first. ``InvalidRequestError`` when it does not
    compile, or not within ``PDSERVE_GRAMMAR_COMPILE_TIMEOUT_S`` (a schema too complex to
    serve: the worker's wait is bounded, and a compile not yet started is dropped).
    ``QueueFullError`` (busy, RESOURCE_EXHAUSTED) when every grammar thread is taken and
    enough compiles already wait."""
    from shared.daemon_pool import PoolBusyError
    from shared.engine.structured_output import compile_executor, grammar_compile_timeout_s

    bound = grammar_compile_timeout_s()
    limit = time.monotonic() + bound if bound > 0 else None
    try:
        fut = asyncio.get_running_loop().run_in_executor(
            compile_executor(), engine.compile_grammar, params
        )
    except PoolBusyError as e:  # every grammar thread stuck in a long compile: busy, not bad
        raise QueueFullError(f"grammar compiles at capacity ({e})") from None
    ends = [t for t in (deadline, limit) if t is not None]
    if await within(fut, min(ends) if ends else None):
        return fut.result()
    fut.cancel()  # a compile still queued never starts; one running ends on its thread
    if limit is not None and (deadline is None or limit < deadline):
        raise InvalidRequestError(
            f"structured_outputs did not compile within {bound:g} s "
            "(PDSERVE_GRAMMAR_COMPILE_TIMEOUT_S): the schema or grammar is too complex",
            "structured_outputs",
        )
    return None


CANCEL_SETTLE_S = 10.0  # how long a cancelled transfer may take to become terminal
# how long a decode worker falling back to a local prefill waits for the cancelled receive
# before it prefills on new blocks instead of the reserved ones (they stay pinned meanwhile)
FALLBACK_SETTLE_S = 1.0


async def cancel_transfer(handle, settle_s: float | None = None) -> bool:
    """Cancel and wait until the handle is terminal: after that no byte of the transfer is read
    from or written to the pool any more (the kvtransfer contract). False when it is still not
    terminal after ``settle_s`` (``CANCEL_SETTLE_S`` by default): its blocks may yet be
    written, so nothing else may write them (the pin holding them drops only when it ends)."""
    bound = CANCEL_SETTLE_S if settle_s is None else settle_s
    handle.cancel()
    if not handle.done:
        try:
            await asyncio.wait_for(handle, bound)
        except TimeoutError:
            # past the default bound the blocks may stay pinned for good: an error; a caller's
            # own shorter bound has a way on (a fallback on new blocks): a warning
            logger.log(
                logging.ERROR if settle_s is None else logging.WARNING,
                "transfer %s did not settle %.1f s after cancel",
                handle.transfer_id,
                bound,
            )
            return False
    return True


async def worker_stats(
    rt: WorkerRuntime,
    request,
    fallbacks: int = 0,
    transfer=None,
    pending_sends: int = 0,
    remote_prefills_noted: int = 0,
):
    from shared.proto import pdserve_pb2 as pb

    def collect(e: EngineCore):
        err = ""
        if request.check_integrity:
            try:
                e.check_integrity()
            except AssertionError as ex:  # IntegrityError
                err = str(ex) or type(ex).__name__
        s = e.stats()
        used = sum(1 for b in e.kv.pool.blocks if b.ref_cnt > 0)
        return s, err, used

    s, err, used = await asyncio.wrap_future(rt.loop.submit(collect))
    out = pb.WorkerStats(
        worker_id=rt.worker_id,
        role=rt.role,
        num_blocks=s.num_blocks,
        free_blocks=s.free_blocks,
        running=s.running,
        waiting=s.waiting,
        integrity_ok=not err,
        integrity_error=err,
        used_blocks=used,
        prefill_fallbacks=fallbacks,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        pending_sends=pending_sends,
        remote_prefills_noted=remote_prefills_noted,
    )
    if transfer is not None:  # kvtransfer TransferCounters
        out.kv_transfer_bytes = int(transfer.bytes_total)
        out.kv_transfer_blocks = int(
            transfer.bytes_total // max(1, rt.engine.runner.transfer_block_bytes)
        )
        out.kv_transfer_failures = int(transfer.failures_total)
    return out
