"""A worker whose engine dies (a failed forward pass: a fault of the worker, not of a request)
fails its streams with UNAVAILABLE + ``pdserve-failure: engine`` (the router retries them
elsewhere), leaves the registry at once instead of draining, and exits with status 1 so that
its supervisor restarts it. In process, with a real Redis and a real gRPC server."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import redis

from shared.directory import DirectoryKeys, EmbeddedRedis
from shared.proto import pdserve_pb2 as pb
from shared.proto import pdserve_pb2_grpc as pb_grpc
from shared.proto.failure import FAILURE_ENGINE, FAILURE_KEY
from tests.services.inprocess_worker import decode_runtime, serve

pytestmark = pytest.mark.integration


def test_engine_death_fails_streams_deregisters_and_exits_1(tiny_llama, tmp_path):
    ready = tmp_path / "ready.json"
    with EmbeddedRedis() as server:
        rt, servicer = decode_runtime(tiny_llama, server.url, "dead-0", ready, "fatal:")
        r = redis.Redis.from_url(server.url)
        key = DirectoryKeys("fatal:").worker("dead-0")

        async def scenario():
            worker, address = await serve(rt, servicer, ready)
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
                    metadata=rt.security.call_metadata,
                )
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in call:
                        pass
            rc = await asyncio.wait_for(worker, 30)
            return rc, info.value

        try:
            rc, err = asyncio.run(scenario())
        finally:
            servicer.receiver.close()
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "illegal memory" in err.details()
        assert (FAILURE_KEY, FAILURE_ENGINE) in tuple(err.trailing_metadata())
        assert rc == 1
        assert not r.exists(key), "left the registry"
