"""A worker's wait for a grammar to compile is bounded (``PDSERVE_GRAMMAR_COMPILE_TIMEOUT_S``),
also for a request without a deadline, and compiles run on the worker's own grammar threads.

Before, a request without ``deadline_s`` waited for its compile however long it took (a
900-deep schema took 66 s here), on asyncio's default executor, which the worker's drain also
needs. Asserted on events (the compile stalls up to 6 s against a 0.3 s bound), not timings.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import grpc
import pytest

from shared.proto import pdserve_pb2 as pb
from tests.services.inprocess_worker import collect_ending, loopback_servicer, running_runtime

pytestmark = pytest.mark.integration

STALL_S = 6.0


@pytest.fixture
def runtime(tiny_llama):
    with running_runtime(tiny_llama, "decode") as rt:
        yield rt


def _request(rid: str, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=[1, 2, 3, 4],
        sampling=pb.SamplingParams(max_tokens=4, temperature=0, **sampling),
    )


def test_a_compile_past_the_bound_is_refused_and_others_are_served(runtime, monkeypatch):
    rt = runtime
    monkeypatch.setenv("PDSERVE_GRAMMAR_COMPILE_TIMEOUT_S", "0.3")
    compiling = threading.Event()
    compile_over = threading.Event()
    compile_ended = threading.Event()
    threads: list[str] = []

    def slow_compile(params):
        threads.append(threading.current_thread().name)
        assert threading.current_thread().daemon  # never holds up the worker's exit
        compiling.set()
        compile_over.wait(STALL_S)
        compile_ended.set()

    rt.engine.compile_grammar = slow_compile  # type: ignore[method-assign]

    async def scenario():
        servicer, receiver = loopback_servicer(rt)
        slow = _request("g", structured_outputs=pb.StructuredOutputs(regex="[ab]+"))
        try:
            refused = asyncio.ensure_future(collect_ending(servicer, slow))
            plain_chunks, plain_status = await asyncio.wait_for(
                collect_ending(servicer, _request("plain")), 30
            )
            chunks, status = await asyncio.wait_for(refused, 30)
            compiled_still = not compile_ended.is_set()
            compile_over.set()
            assert compiling.is_set() and threads[0].startswith("pdserve-grammar")
            assert status[0] == grpc.StatusCode.INVALID_ARGUMENT and not chunks, status
            assert "did not compile within 0.3 s" in status[1], status
            assert compiled_still, "the call waited for the compile to end"
            # a request without a grammar was served while the compile stalled
            assert plain_status == "OK"
            assert sum(len(o.token_ids) for c in plain_chunks for o in c.outputs) == 4
            assert not servicer.flights and rt.inflight == 0
        finally:
            compile_over.set()
            receiver.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("value", ["soon", "-1"])
def test_a_bad_compile_bound_says_why_at_start_and_exits_2(tiny_llama, value):
    argv = [sys.executable, "-m", "shared.cli", "decode", "--model", str(tiny_llama)]
    env = {**os.environ, "PDSERVE_GRAMMAR_COMPILE_TIMEOUT_S": value}
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"pdserve decode: error: PDSERVE_GRAMMAR_COMPILE_TIMEOUT_S={value!r}" in p.stderr, (
        p.stderr[-2000:]
    )
    assert "Traceback" not in p.stderr


def test_the_engine_thread_never_compiles_a_grammar(runtime):
    """The compiled grammar travels with the request into ``add_request``. Before, the engine
    thread looked it up in the LRU again, and compiled it itself (every step waiting) when
    256 other grammars had evicted it between the two."""
    rt = runtime
    real = rt.engine.compile_grammar
    where: list[str] = []

    def recording(params):
        where.append(threading.current_thread().name)
        return real(params)

    rt.engine.compile_grammar = recording  # type: ignore[method-assign]

    async def scenario():
        servicer, receiver = loopback_servicer(rt)
        try:
            req = _request("g", structured_outputs=pb.StructuredOutputs(regex="[ab]+"))
            chunks, status = await asyncio.wait_for(collect_ending(servicer, req), 60)
            assert status == "OK", status
            assert sum(len(o.token_ids) for c in chunks for o in c.outputs) == 4
        finally:
            receiver.close()

    asyncio.run(scenario())
    assert where and all(name.startswith("pdserve-grammar") for name in where), where


def test_compiles_past_the_queue_bound_are_refused_as_busy(runtime, monkeypatch):
    """Found by review: while every grammar thread was stuck in a long compile, each refused
    request left its compile queued, payload and all (2,000 requests: 45 MB). Past the queue's
    bound a compile is refused at once, RESOURCE_EXHAUSTED (the router tries another worker,
    then answers 429); the ones queued before it are served once a thread frees up."""
    from shared.daemon_pool import DaemonPool
    from shared.engine import structured_output

    rt = runtime
    monkeypatch.setattr(structured_output, "_executor", DaemonPool(1, "g", max_queued=1))
    real = rt.engine.compile_grammar
    started, gate = threading.Event(), threading.Event()

    def gated(params):
        started.set()
        gate.wait(30)
        return real(params)

    rt.engine.compile_grammar = gated  # type: ignore[method-assign]

    async def scenario():
        servicer, receiver = loopback_servicer(rt)
        so = pb.StructuredOutputs(regex="[ab]+")
        try:
            running = asyncio.ensure_future(
                collect_ending(servicer, _request("a", structured_outputs=so))
            )
            assert await asyncio.to_thread(started.wait, 10)
            queued = asyncio.ensure_future(
                collect_ending(servicer, _request("b", structured_outputs=so))
            )
            while structured_output._executor.queued < 1:  # its compile waits behind "a"
                await asyncio.sleep(0.001)
            refused = await asyncio.wait_for(
                collect_ending(servicer, _request("c", structured_outputs=so)), 10
            )
            assert refused[1][0] == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
            assert "grammar compiles at capacity" in refused[1][1]
            gate.set()
            for fut in (running, queued):
                _chunks, status = await asyncio.wait_for(fut, 30)
                assert status == "OK", status
        finally:
            gate.set()
            receiver.close()

    asyncio.run(scenario())


def test_the_worker_times_a_request_from_its_arrival_compile_included(runtime):
    """``Timings.first_token_s`` (and the worker's TTFT / queue histograms) count from the
    request's arrival, as its deadline does: they started once the grammar had compiled, so a
    0.5 s compile was missing from them (found by review)."""
    rt = runtime
    compile_grammar = rt.engine.compile_grammar

    def slow_compile(params):
        threading.Event().wait(0.5)
        return compile_grammar(params)

    rt.engine.compile_grammar = slow_compile  # type: ignore[method-assign]

    async def scenario():
        servicer, receiver = loopback_servicer(rt)
        req = _request("t", structured_outputs=pb.StructuredOutputs(regex="[ab]+"))
        try:
            chunks, status = await asyncio.wait_for(collect_ending(servicer, req), 60)
        finally:
            receiver.close()
        assert status == "OK", status
        (timings,) = [c.timings for c in chunks if c.HasField("timings")]
        assert timings.first_token_s >= 0.5, timings

    asyncio.run(scenario())
