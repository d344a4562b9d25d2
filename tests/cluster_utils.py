"""Helpers for integration tests that start real worker processes, Redis and the router."""

from __future__ import annotations

import contextlib
import time

import grpc

from shared.cli.launcher import Cluster, cluster_args
from shared.proto import pdserve_pb2 as pb
from shared.proto import pdserve_pb2_grpc as pb_grpc
from shared.security import ClusterSecurity
from tests.ports import free_port


def make_cluster(model_dir, run_dir, *flags: str, prefill: int = 1, decode: int = 1) -> Cluster:
    args = cluster_args(
        [
            "--model",
            str(model_dir),
            "--run-dir",
            str(run_dir),
            "--prefill",
            str(prefill),
            "--decode",
            str(decode),
            "--port",
            str(free_port()),
            "--threads-per-worker",
            "1",
            "--kv-cache-memory",
            "64MiB",
            "--startup-timeout",
            "120",
            *flags,
        ]
    )
    return Cluster(args)


@contextlib.contextmanager
def channel_to(address: str):
    ch = ClusterSecurity.from_env().channel(address)  # tests/conftest.py sets the secret
    try:
        grpc.channel_ready_future(ch).result(timeout=30)
        yield ch
    finally:
        ch.close()


def decode_stub(ch) -> pb_grpc.DecodeWorkerStub:
    return pb_grpc.DecodeWorkerStub(ch)


def prefill_stub(ch) -> pb_grpc.PrefillWorkerStub:
    return pb_grpc.PrefillWorkerStub(ch)


def generate(
    stub,
    request_id: str,
    prompt: list[int],
    prefill_address: str = "",
    timeout: float = 120,
    **sampling,
) -> tuple[dict[int, list[int]], pb.GenerateChunk]:
    """Run one Generate stream; returns (tokens per sample index, the final chunk)."""
    sampling.setdefault("temperature", 0.0)
    req = pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(**sampling),
        prefill_address=prefill_address,
    )
    tokens: dict[int, list[int]] = {}
    final = None
    for chunk in stub.Generate(req, timeout=timeout):
        for d in chunk.outputs:
            tokens.setdefault(d.index, []).extend(d.token_ids)
        if chunk.finished:
            final = chunk
    assert final is not None, "stream ended without a final chunk"
    return tokens, final


def wait_until(pred, timeout: float = 20.0, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
