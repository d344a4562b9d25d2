"""Liveness that tells the truth: a worker whose engine thread makes no progress (a forward pass
that hangs) turns NOT_SERVING and lets its lease lapse, so routers stop choosing it; when the
step finishes it serves and registers again. The stream it held fails with UNAVAILABLE as soon
as the hang is declared (the router resumes it elsewhere), not when the step returns. In
process, real Redis and a real gRPC server."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.directory import DirectoryKeys, EmbeddedRedis
from shared.proto import pdserve_pb2 as pb
from shared.proto import pdserve_pb2_grpc as pb_grpc
from tests.services.inprocess_worker import decode_runtime, serve

pytestmark = pytest.mark.integration


def test_a_hung_engine_turns_not_serving_and_leaves_the_registry_until_it_recovers(
    tiny_llama, tmp_path
):
    ready = tmp_path / "ready.json"
    with EmbeddedRedis() as server:
        rt, servicer = decode_runtime(
            tiny_llama, server.url, "hang-0", ready, "hang:", "--engine-hang-timeout", "1"
        )
        r = redis.Redis.from_url(server.url)
        key = DirectoryKeys("hang:").worker("hang-0")
        release = threading.Event()
        real = rt.engine.runner.execute

        def stuck(out):  # the first forward pass hangs until the test lets it go
            release.wait(30)
            return real(out)

        async def scenario():
            worker, address = await serve(rt, servicer, ready)
            seen = {}
            async with grpc.aio.insecure_channel(address) as ch:
                hstub = health_pb2_grpc.HealthStub(ch)

                async def health():
                    return (await hstub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status

                assert await health() == health_pb2.HealthCheckResponse.SERVING
                generation = r.hget(key, "generation")
                rt.engine.runner.execute = stuck
                call = pb_grpc.DecodeWorkerStub(ch).Generate(
                    pb.GenerateRequest(
                        request_id="slow",
                        prompt_token_ids=[5, 6, 7],
                        sampling=pb.SamplingParams(temperature=0, max_tokens=4),
                    ),
                    timeout=60,
                    metadata=rt.security.call_metadata,
                )
                reader = asyncio.ensure_future(call.read())
                t0 = time.monotonic()
                while await health() != health_pb2.HealthCheckResponse.NOT_SERVING:
                    assert time.monotonic() - t0 < 10, "never turned NOT_SERVING"
                    await asyncio.sleep(0.2)
                seen["not_serving_after"] = time.monotonic() - t0
                # the stream in flight fails over now (UNAVAILABLE), not when the step returns
                try:
                    await asyncio.wait_for(asyncio.shield(reader), 5)
                except grpc.aio.AioRpcError as e:
                    seen["inflight_failed"] = (e.code(), time.monotonic() - t0)
                while r.exists(key):
                    assert time.monotonic() - t0 < 15, "the lease never lapsed"
                    await asyncio.sleep(0.2)
                seen["lease_gone_after"] = time.monotonic() - t0
                release.set()  # the step finishes
                rt.engine.runner.execute = real
                while await health() != health_pb2.HealthCheckResponse.SERVING:
                    assert time.monotonic() - t0 < 25, "never served again"
                    await asyncio.sleep(0.2)
                while not r.exists(key):
                    assert time.monotonic() - t0 < 30, "never registered again"
                    await asyncio.sleep(0.2)
                seen["new_generation"] = r.hget(key, "generation") != generation
                again = pb_grpc.DecodeWorkerStub(ch).Generate(
                    pb.GenerateRequest(
                        request_id="after",
                        prompt_token_ids=[5, 6, 7],
                        sampling=pb.SamplingParams(temperature=0, max_tokens=4),
                    ),
                    timeout=30,
                    metadata=rt.security.call_metadata,
                )
                chunks = [c async for c in again]
                seen["serves_again"] = bool(chunks) and chunks[-1].finished
            worker.cancel()
            try:
                await worker
            except asyncio.CancelledError:
                pass
            return seen

        try:
            seen = asyncio.run(scenario())
        finally:
            release.set()
            servicer.receiver.close()
            rt.loop.stop()
    assert seen["not_serving_after"] < 4, seen
    assert seen["lease_gone_after"] < 8, seen
    assert seen["inflight_failed"][0] == grpc.StatusCode.UNAVAILABLE, seen
    assert seen["inflight_failed"][1] < 5, seen
    assert seen["new_generation"] and seen["serves_again"], seen
