"""A worker whose engine dies (a failed forward pass: a fault of the worker, not of a request)
fails its streams with UNAVAILABLE + ``pdserve-failure: engine`` (the router retries them
elsewhere), leaves the registry at once instead of draining, and exits with status 1 so that
its supervisor restarts it. In process, with a real Redis and a real gRPC server."""

from __future__ import annotations

import argparse
import asyncio
import json

import grpc
import pytest
import redis

from decode_service.server import DecodeServicer
from kvtransfer import LoopbackNetwork, create_receiver
from shared.directory import DirectoryKeys, EmbeddedRedis
from shared.proto import pdserve_pb2 as pb
from shared.proto import pdserve_pb2_grpc as pb_grpc
from shared.proto.failure import FAILURE_ENGINE, FAILURE_KEY
from shared.worker.service import WorkerRuntime, add_worker_cli_args, serve_worker

pytestmark = pytest.mark.integration


def test_engine_death_fails_streams_deregisters_and_exits_1(tiny_llama, tmp_path):
    ready = tmp_path / "ready.json"
    with EmbeddedRedis() as server:
        parser = argparse.ArgumentParser()
        add_worker_cli_args(parser, "decode")
        args = parser.parse_args(
            [
                "--model",
                str(tiny_llama),
                "--num-gpu-blocks-override",
                "64",
                "--max-model-len",
                "512",
                "--redis-url",
                server.url,
                "--worker-id",
                "dead-0",
                "--ready-file",
                str(ready),
                "--directory-prefix",
                "fatal:",
            ]
        )
        rt = WorkerRuntime("decode", args)
        receiver = create_receiver(
            "loopback", rt.engine.runner.kv_cache, rt.kv_geometry(), network=LoopbackNetwork()
        )
        servicer = DecodeServicer(rt, receiver, prefill_timeout_s=5.0)
        r = redis.Redis.from_url(server.url)
        key = DirectoryKeys("fatal:").worker("dead-0")

        async def scenario():
            worker = asyncio.ensure_future(
                serve_worker(rt, lambda s: pb_grpc.add_DecodeWorkerServicer_to_server(servicer, s))
            )
            for _ in range(200):
                if ready.exists():
                    break
                await asyncio.sleep(0.05)
            address = json.loads(ready.read_text())["grpc"]
            assert r.exists(key), "registered while serving"

            def broken(out):
                raise RuntimeError("CUDA error: an illegal memory access (injected)")

            rt.engine.runner.execute = broken  # the next forward pass fails
            async with grpc.aio.insecure_channel(address) as ch:
                call = pb_grpc.DecodeWorkerStub(ch).Generate(
                    pb.GenerateRequest(
                        request_id="doomed",
                        prompt_token_ids=[5, 6, 7],
                        sampling=pb.SamplingParams(temperature=0, max_tokens=4),
                    ),
                    timeout=30,
                )
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in call:
                        pass
            rc = await asyncio.wait_for(worker, 30)
            return rc, info.value

        try:
            rc, err = asyncio.run(scenario())
        finally:
            receiver.close()
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "illegal memory" in err.details()
        assert (FAILURE_KEY, FAILURE_ENGINE) in tuple(err.trailing_metadata())
        assert rc == 1
        assert not r.exists(key), "left the registry"
