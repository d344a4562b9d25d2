"""A decode worker in this process (real gRPC server, real Redis, loopback KV receiver), for
tests that reach into its engine: ``decode_runtime`` builds it, ``serve`` starts it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

from decode_service.server import DecodeServicer
from kvtransfer import LoopbackNetwork, create_receiver
from shared.proto import pdserve_pb2_grpc as pb_grpc
from shared.worker.service import WorkerRuntime, add_worker_cli_args, serve_worker


def standalone_runtime(model_dir: Path, role: str, *flags: str) -> WorkerRuntime:
    """A ``role`` worker's runtime (64 blocks, 512 tokens; no registry unless ``flags`` name
    one), its engine loop not started."""
    parser = argparse.ArgumentParser()
    add_worker_cli_args(parser, role)
    args = parser.parse_args(
        [
            "--model",
            str(model_dir),
            "--num-gpu-blocks-override",
            "64",
            "--max-model-len",
            "512",
            *flags,
        ]
    )
    return WorkerRuntime(role, args)


@contextlib.contextmanager
def running_runtime(model_dir: Path, role: str, *flags: str) -> Iterator[WorkerRuntime]:
    """:func:`standalone_runtime` with its engine loop running (stopped on exit)."""
    rt = standalone_runtime(model_dir, role, *flags)
    rt.loop.start()
    try:
        yield rt
    finally:
        rt.loop.stop()


class RejectingContext:
    """A servicer context for calls expected to succeed: an abort fails the test."""

    async def abort(self, code, details="", trailing_metadata=()):
        raise AssertionError(f"aborted with {code}: {details}")


class Aborted(Exception):
    """What :class:`AbortingContext` raises: ``args`` are the call's code, details and
    trailing metadata (a dict)."""


class AbortingContext:
    """A servicer context whose abort ends the call as gRPC's does (an exception)."""

    async def abort(self, code, details="", trailing_metadata=()):
        raise Aborted(code, details, dict(trailing_metadata))


async def collect(servicer, req) -> tuple[list, object]:
    """A decode ``Generate`` call's chunks and how it ended ("OK", or the abort's code)."""
    chunks, ending = await collect_ending(servicer, req)
    return chunks, ending if ending == "OK" else ending[0]


async def collect_ending(servicer, req) -> tuple[list, object]:
    """A decode ``Generate`` call's chunks and how it ended: "OK", or the abort's (code,
    details, trailing metadata)."""
    chunks = []
    try:
        async for c in servicer.Generate(req, AbortingContext()):
            chunks.append(c)
        return chunks, "OK"
    except Aborted as e:
        return chunks, e.args


def loopback_servicer(rt: WorkerRuntime) -> tuple[DecodeServicer, object]:
    """A decode servicer on ``rt`` with a loopback KV receiver (close it afterwards)."""
    receiver = create_receiver(
        "loopback", rt.engine.runner.kv_cache, rt.kv_geometry(), network=LoopbackNetwork()
    )
    return DecodeServicer(rt, receiver, prefill_timeout_s=5.0), receiver


def decode_runtime(
    model_dir: Path, redis_url: str, worker_id: str, ready: Path, prefix: str, *flags: str
) -> tuple[WorkerRuntime, DecodeServicer]:
    """A decode runtime (64 blocks, 512 tokens) registering under ``prefix``, and its servicer."""
    rt = standalone_runtime(
        model_dir,
        "decode",
        "--redis-url",
        redis_url,
        "--worker-id",
        worker_id,
        "--ready-file",
        str(ready),
        "--directory-prefix",
        prefix,
        *flags,
    )
    receiver = create_receiver(
        "loopback", rt.engine.runner.kv_cache, rt.kv_geometry(), network=LoopbackNetwork()
    )
    return rt, DecodeServicer(rt, receiver, prefill_timeout_s=5.0)


async def serve(
    rt: WorkerRuntime, servicer: DecodeServicer, ready: Path, timeout_s: float = 10.0
) -> tuple[asyncio.Future[int], str]:
    """Start serving; returns (the serve task, whose result is the exit code, the gRPC address)
    once the ready file is written."""
    worker = asyncio.ensure_future(
        serve_worker(rt, lambda s: pb_grpc.add_DecodeWorkerServicer_to_server(servicer, s))
    )
    async with asyncio.timeout(timeout_s):
        while not ready.exists():
            if worker.done():
                worker.result()  # raises what stopped it
                raise RuntimeError(f"worker exited with {worker.result()} before it was ready")
            await asyncio.sleep(0.05)
    return worker, json.loads(ready.read_text())["grpc"]
