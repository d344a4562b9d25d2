"""Backpressure by default: a worker whose waiting queue is at its bound refuses new requests
with RESOURCE_EXHAUSTED at once (the router then tries another worker or answers 429 with
Retry-After) instead of queueing them until their deadline. And the deadline itself: a stream
that outlives its request's ``deadline_s`` ends DEADLINE_EXCEEDED and leaves the engine. (The
same one-sequence worker also checks the engine-step metrics, whose counts it makes exact.)"""

from __future__ import annotations

import concurrent.futures as cf
import time

import grpc
import httpx
import pytest

from shared.proto import pdserve_pb2 as pb
from tests.cluster_utils import channel_to, decode_stub, make_cluster, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    c = make_cluster(
        tiny_llama,
        tmp_path_factory.mktemp("bp"),
        "--max-num-seqs",
        "1",
        "--worker-arg=--max-waiting-requests=2",
        prefill=0,
        decode=1,
    )
    c.start_redis()
    workers = [c.spawn_worker("decode", 0)]
    c.wait_ready(workers)
    yield c
    c.stop()


def _run(stub, rid: str, tokens: int, calls: dict | None = None):
    """Stream request ``rid`` to its end: ``(status, seconds)``. ``calls`` gets the call, for
    the test to cancel it."""
    req = pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=[5, 6, 7],
        sampling=pb.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
    )
    t0 = time.monotonic()
    try:
        call = stub.Generate(req, timeout=120)
        if calls is not None:
            calls[rid] = call
        for _ in call:
            pass
        return "ok", time.monotonic() - t0
    except grpc.RpcError as e:
        return e.code().name, time.monotonic() - t0


def test_a_full_queue_answers_resource_exhausted_at_once(cluster):
    with channel_to(cluster.ready["decode-0"]["grpc"]) as ch:
        stub = decode_stub(ch)
        with cf.ThreadPoolExecutor(6) as pool:
            # one runs (max_num_seqs 1), two wait (the bound), the rest are refused
            def at(running: int, waiting: int, what: str) -> None:
                wait_until(
                    lambda: (lambda st: st.running == running and st.waiting == waiting)(
                        stub.Stats(pb.StatsRequest(), timeout=10)
                    ),
                    what=what,
                )

            calls: dict = {}
            try:
                # the first is scheduled before the others come: while it still waited, the
                # second and third together would find the queue at its bound already
                futs = [pool.submit(_run, stub, "r0", 3000, calls)]
                at(1, 0, "the first request to run")
                futs += [pool.submit(_run, stub, f"r{i}", 4) for i in (1, 2)]
                at(1, 2, "one running and two waiting requests")  # the queue is at its bound
                refused = [pool.submit(_run, stub, f"x{i}", 4) for i in range(3)]
                late = [f.result(timeout=60) for f in refused]
                # the bound held the queued two, not refused them: the long first request is
                # cancelled (its 3000 tokens proved the point), and the queued two then run
                calls["r0"].cancel()
                first = [f.result(timeout=60) for f in futs]
            finally:
                for call in calls.values():  # a failure above does not wait for 3000 tokens
                    call.cancel()
    assert [s for s, _ in first] == ["CANCELLED", "ok", "ok"], first
    # refused at once (ms), not after the first request's run (its 3000 tokens: ~4 s here)
    assert all(s == "RESOURCE_EXHAUSTED" and dt < 2.5 for s, dt in late), late
    with channel_to(cluster.ready["decode-0"]["grpc"]) as ch:  # room again afterwards
        assert _run(decode_stub(ch), "after", 4)[0] == "ok"


def test_a_stream_past_its_deadline_ends_deadline_exceeded_and_leaves_the_engine(cluster):
    """The decode worker's deadline is one timer per stream (not a wait per message): a
    request still streaming when it fires ends with DEADLINE_EXCEEDED after the tokens it
    had, and the engine no longer runs it."""
    req = pb.GenerateRequest(
        request_id="late",
        prompt_token_ids=[5, 6, 7],
        sampling=pb.SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True),
        deadline_s=0.5,
    )
    with channel_to(cluster.ready["decode-0"]["grpc"]) as ch:
        stub = decode_stub(ch)
        tokens = 0
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            for chunk in stub.Generate(req, timeout=60):
                tokens += sum(len(d.token_ids) for d in chunk.outputs)
        elapsed = time.monotonic() - t0
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
        assert "deadline of 0.5s" in (err.value.details() or "")
        assert 0 < tokens < 3000 and 0.5 <= elapsed < 5.0, (tokens, elapsed)
        wait_until(
            lambda: stub.Stats(pb.StatsRequest(), timeout=10).running == 0,
            what="the late request to leave the engine",
        )
        assert _run(stub, "after-late", 4)[0] == "ok"


def test_the_worker_exports_each_engine_step_with_its_tokens(cluster):
    """One request alone on the worker: a 20-token prompt in one step, then 3 decode steps."""

    def scrape() -> dict[str, float]:
        text = httpx.get(cluster.ready["decode-0"]["metrics"], timeout=10).text
        want = (
            "pdserve:engine_step_seconds_count",
            "pdserve:iteration_tokens_total_count",
            "pdserve:iteration_tokens_total_sum",
        )
        return {
            name: float(ln.split()[-1])
            for ln in text.splitlines()
            for name in want
            if ln.startswith(name + "{")
        }

    before = scrape()
    req = pb.GenerateRequest(
        request_id="steps",
        prompt_token_ids=list(range(200, 220)),  # no block of it cached before
        sampling=pb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    )
    with channel_to(cluster.ready["decode-0"]["grpc"]) as ch:
        list(decode_stub(ch).Generate(req, timeout=60))
    after = scrape()
    assert (
        after["pdserve:engine_step_seconds_count"] - before["pdserve:engine_step_seconds_count"]
        == 4
    )
    assert (
        after["pdserve:iteration_tokens_total_count"]
        - before["pdserve:iteration_tokens_total_count"]
        == 4
    )
    assert (
        after["pdserve:iteration_tokens_total_sum"] - before["pdserve:iteration_tokens_total_sum"]
        == 23
    )


def test_the_worker_freezes_its_start_up_heap_and_exports_its_gc_pauses(cluster):
    """Everything alive once the worker serves (model, engine, servers: ~240k objects for the
    small model) is frozen out of the cyclic collector, whose full collections would otherwise
    walk it all and stop every thread for 0.1-0.3 s; the pauses that remain are exported."""
    text = httpx.get(cluster.ready["decode-0"]["metrics"], timeout=10).text
    frozen = [
        float(ln.split()[-1])
        for ln in text.splitlines()
        if ln.startswith("pdserve:gc_frozen_objects{")
    ]
    assert len(frozen) == 1 and frozen[0] > 20_000, frozen
    gens = {
        ln.split('generation="')[1].split('"')[0]
        for ln in text.splitlines()
        if ln.startswith("pdserve:gc_pause_seconds_count{")
    }
    assert gens == {"0", "1", "2"}
