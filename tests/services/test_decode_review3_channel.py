"""A decode worker's Prefill channel to a prefill worker is shared by every request it sends
there. One call refused UNAVAILABLE (a draining P: "worker is draining") made D drop that
channel, and dropping it called ``channel.close()``, which cancelled every other call still on
it; ``_remote_prefill`` took their ``CancelledError`` for its own cancellation and re-raised:
no local fallback, and the requests stayed ``WAITING_FOR_REMOTE_KV`` (holding their blocks)
until their deadline. Now a dropped channel leaves the cache at once but closes only when its
calls have ended, and a ``CancelledError`` that is not the task's own cancellation (a call
cancelled under it) falls back to a local prefill like any other failure of P.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from decode_service.server import DecodeServicer
from kvtransfer import LoopbackNetwork, create_receiver
from shared.proto import pdserve_pb2 as pb
from shared.proto import pdserve_pb2_grpc as pb_grpc
from shared.security import ClusterSecurity
from tests.services.inprocess_worker import collect, standalone_runtime

pytestmark = pytest.mark.integration


@pytest.fixture
def runtime(tiny_llama, monkeypatch):
    monkeypatch.delenv("PDSERVE_CLUSTER_SECRET")
    rt = standalone_runtime(tiny_llama, "decode")
    rt.security = ClusterSecurity.from_environ({})
    rt.loop.start()
    yield rt
    rt.loop.stop()


async def _engine_idle(rt) -> tuple[int, int, int]:
    def state(e):
        e.check_integrity()
        return (
            len(e.parents),
            e.kv.num_pinned_blocks,
            e.num_blocks - e.kv.pool.num_free_blocks,
        )

    return await asyncio.wrap_future(rt.loop.submit(state))


def test_a_refused_call_does_not_cancel_the_others_on_its_channel(runtime):
    """The reviewer's scenario: A is slow on P; B is refused UNAVAILABLE (P drains). B falls
    back at once; A's call goes on (it is not cancelled by B's channel drop) and, when P fails
    it, A falls back too and completes, long before its deadline."""
    rt = runtime

    async def scenario():
        release_a = asyncio.Event()
        a_cancelled_on_p: list[bool] = []

        class FakePrefill(pb_grpc.PrefillWorkerServicer):
            async def Prefill(self, request, context):
                if request.request_id == "B":  # P started draining: new work refused
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining")
                try:
                    await release_a.wait()  # A: P is slow (finishing its drain)
                except asyncio.CancelledError:
                    a_cancelled_on_p.append(True)
                    raise
                await context.abort(grpc.StatusCode.INTERNAL, "P failed A")

        server = grpc.aio.server()
        pb_grpc.add_PrefillWorkerServicer_to_server(FakePrefill(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        addr = f"127.0.0.1:{port}"
        receiver = create_receiver(
            "loopback", rt.engine.runner.kv_cache, rt.kv_geometry(), network=LoopbackNetwork()
        )
        servicer = DecodeServicer(rt, receiver, prefill_timeout_s=60.0)

        def req(rid: str) -> pb.GenerateRequest:
            return pb.GenerateRequest(
                request_id=rid,
                prompt_token_ids=list(range(3, 40)),
                sampling=pb.SamplingParams(max_tokens=3, temperature=0),
                prefill_address=addr,
                deadline_s=30.0,
            )

        try:
            a = asyncio.ensure_future(collect(servicer, req("A")))
            for _ in range(400):  # A's Prefill call is on the channel
                if servicer.channels:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
            chunks_b, status_b = await asyncio.wait_for(collect(servicer, req("B")), 20)
            assert status_b == "OK" and chunks_b[-1].finished
            assert addr not in servicer.channels  # B's UNAVAILABLE dropped the channel
            assert not a.done() and not a_cancelled_on_p, "A's call was cancelled by B's drop"
            release_a.set()  # now P fails A: D must prefill it locally and finish
            chunks_a, status_a = await asyncio.wait_for(a, 20)
            assert status_a == "OK", f"A ended {status_a}"
            assert chunks_a[-1].finished and chunks_a[-1].timings.path == "fallback"
            assert servicer.fallbacks == 2
            assert await _engine_idle(rt) == (0, 0, 0)
            for _ in range(100):  # the dropped channel closes once A's call ended
                if not servicer._dropped_channels:
                    break
                await asyncio.sleep(0.05)
            assert not servicer._dropped_channels
        finally:
            release_a.set()
            receiver.close()
            for channel, _ in servicer.channels.values():
                await channel.close()
            await server.stop(0)

    asyncio.run(scenario())


def test_a_prefill_call_cancelled_under_the_request_falls_back_locally(runtime):
    """A Prefill call cancelled by something else than the request (its channel closed) is
    a failure of P like any other: the request is prefilled locally, not left waiting for KV
    that will never come."""
    rt = runtime

    class CancelledCall:
        def __init__(self) -> None:
            self.calls = 0

        async def _call(self):
            await asyncio.sleep(0.05)
            raise asyncio.CancelledError  # what grpc raises when the channel closes

        def Prefill(self, request, timeout=None, metadata=None):
            self.calls += 1
            return self._call()

    async def scenario():
        receiver = create_receiver(
            "loopback", rt.engine.runner.kv_cache, rt.kv_geometry(), network=LoopbackNetwork()
        )
        servicer = DecodeServicer(rt, receiver, prefill_timeout_s=60.0)
        prefill = CancelledCall()
        servicer._stub = lambda address: prefill
        req = pb.GenerateRequest(
            request_id="c",
            prompt_token_ids=list(range(3, 40)),
            sampling=pb.SamplingParams(max_tokens=3, temperature=0),
            prefill_address="127.0.0.1:9",
            deadline_s=15.0,
        )
        try:
            chunks, status = await asyncio.wait_for(collect(servicer, req), 30)
            assert prefill.calls == 1
            assert status == "OK", f"ended {status} (the request waited for KV that never came)"
            assert chunks[-1].finished and chunks[-1].timings.path == "fallback"
            assert servicer.fallbacks == 1
            assert await _engine_idle(rt) == (0, 0, 0)
        finally:
            receiver.close()

    asyncio.run(scenario())


def test_the_channel_cache_is_bounded_least_recently_used_first(runtime, monkeypatch):
    """Found by review: a channel left the cache only when a call on it failed as unreachable,
    so prefill workers that went away after an ordinary answer (restarted on a new port, a
    replaced pod) kept theirs for the decode worker's lifetime (300 addresses: 296 channels).
    Now at most ``MAX_CHANNELS``, the least recently used dropped first (closed once their
    calls end), and a used one is kept."""
    import decode_service.server as server

    monkeypatch.setattr(server, "MAX_CHANNELS", 8)

    async def scenario():
        receiver = create_receiver(
            "loopback",
            runtime.engine.runner.kv_cache,
            runtime.kv_geometry(),
            network=LoopbackNetwork(),
        )
        servicer = DecodeServicer(runtime, receiver, prefill_timeout_s=5.0)
        try:
            first = "127.0.0.1:1"
            stub = servicer._stub(first)
            for port in range(2, 40):
                servicer._stub(f"127.0.0.1:{port}")
                assert servicer._stub(first) is stub  # used all along: never dropped
            assert len(servicer.channels) == 8
            assert list(servicer.channels)[-1] == first
            assert set(servicer.channels) == {first} | {f"127.0.0.1:{p}" for p in range(33, 40)}
            for _ in range(50):  # the dropped ones close (no call was on them)
                if not servicer._closing:
                    break
                await asyncio.sleep(0.02)
            assert not servicer._closing and not servicer._dropped_channels
        finally:
            await servicer.close_channels()
            receiver.close()

    asyncio.run(scenario())
