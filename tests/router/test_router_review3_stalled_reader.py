"""A client that stops reading no longer pins the router's view of a worker that is done with
its request: the worker's stream ending (its last message, a failure, or the deadline's cancel)
releases the request's in-flight, decoding and backlog counts at once, not when the client
reads again; and a reader still stalled past the request's deadline is dropped, which releases
its admission ticket (``--max-inflight-requests``)."""

from __future__ import annotations

import time
from dataclasses import replace

import httpx
import pytest
from router_harness import MODEL_NAME, SLOW_READER_BODY, read_to_end, stalled_stream

pytestmark = pytest.mark.integration


def _pool_state(r, wid: str) -> tuple[int, int, int]:
    pool = r.ctx.dispatcher.pool
    return pool.inflight(wid), pool.decoding(wid), sum(pool._backlog.values())


def _wait(cond, timeout: float, what: str, state) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} within {timeout} s: {state()}")


def _served(r, wid: str) -> int:
    """Streams this router saw end on ``wid`` (one per release of its accounting)."""
    return r.ctx.dispatcher.pool._left.get(wid, 0)


def test_a_stalled_reader_releases_its_worker_once_the_worker_is_done(
    make_worker, make_router, router_config
):
    """GenerateMux: the router's reader takes the whole stream while the client reads nothing;
    once the worker has ended it, the router counts nothing in flight there, and routing sees
    the worker idle again (before: 20 of 20 short requests went to the other worker)."""
    w0 = make_worker("d0")
    make_worker("d1")
    r = make_router(
        replace(router_config, decode_stream="mux", request_timeout_s=120.0, max_model_len=None)
    )
    r.wait_workers(2)
    pool = r.ctx.dispatcher.pool
    # the big request first, on whichever worker the policy picks
    s, first = stalled_stream(r.port, SLOW_READER_BODY)
    assert first.startswith(b"HTTP/1.1 200"), first[:200]
    busy = next(
        (wid for wid in ("d0", "d1") if pool.inflight(wid)), "d0" if w0.stats().running else "d1"
    )
    other = "d1" if busy == "d0" else "d0"
    try:
        _wait(
            lambda: _pool_state(r, busy) == (0, 0, 0),
            60,
            f"the router still counts the stalled request on {busy}",
            lambda: (_pool_state(r, busy), r.ctx.inflight),
        )
        # the client is still stalled: its request (admission ticket) is still open
        assert r.ctx.inflight == 1
        assert _served(r, busy) == 1
        # routing sees both workers idle: short requests go to both
        before = _served(r, busy), _served(r, other)
        for i in range(20):
            ok = httpx.post(
                f"{r.url}/v1/completions",
                timeout=30,
                json={"model": MODEL_NAME, "prompt": [20 + i, 11, 12], "max_tokens": 2},
            )
            assert ok.status_code == 200, ok.text
        went = _served(r, busy) - before[0], _served(r, other) - before[1]
        assert sum(went) == 20, went  # each stream released exactly once
        assert went[0] > 0, f"every short request avoided {busy}: {went}"
        assert r.ctx.inflight == 1
    finally:
        raw = read_to_end(s)
    text = (first + raw).decode(errors="replace")
    assert "data: [DONE]" in text[-200:], text[-300:]  # the stalled client still gets it all
    assert not [ln for ln in text.splitlines() if ln.startswith('data: {"error"')]
    _wait(lambda: r.ctx.inflight == 0, 30, "the request did not end", lambda: r.ctx.inflight)
    assert _pool_state(r, busy) == (0, 0, 0)
    assert _served(r, busy) + _served(r, other) == 21  # nothing released twice


@pytest.mark.parametrize("mode", ["mux", "per-request"])
def test_a_reader_stalled_past_the_deadline_is_dropped(
    make_worker, make_router, router_config, mode
):
    """Past the request's deadline the worker's stream is cancelled (per-request: the worker
    was held by backpressure until then) and its counts released while the client is still
    stalled; the stalled reader is then dropped, which releases its admission ticket."""
    make_worker("d0", token_delay=0.001)
    r = make_router(
        replace(
            router_config,
            decode_stream=mode,
            request_timeout_s=4.0,
            stall_timeout_s=1.0,
            max_inflight_requests=1,
            max_model_len=None,
        )
    )
    r.wait_workers(1)
    s, first = stalled_stream(r.port, SLOW_READER_BODY)
    try:
        assert first.startswith(b"HTTP/1.1 200"), first[:200]
        _wait(
            lambda: _pool_state(r, "d0") == (0, 0, 0),
            60,
            "the stalled request's worker was not released",
            lambda: (_pool_state(r, "d0"), r.ctx.inflight),
        )
        assert _served(r, "d0") == 1
        _wait(
            lambda: r.ctx.inflight == 0,
            60,
            "the reader stalled past the deadline still holds its request",
            lambda: r.ctx.inflight,
        )
        # its admission ticket is back: a new request is admitted (max_inflight_requests 1)
        ok = httpx.post(
            f"{r.url}/v1/completions",
            timeout=30,
            json={"model": MODEL_NAME, "prompt": "next", "max_tokens": 2},
        )
        assert ok.status_code == 200, ok.text
        # the worker was not blamed for the slow client
        assert r.metric("pdserve:router_retries_total") == 0
        assert httpx.get(f"{r.url}/health", timeout=10).json()["decode_workers"] == 1
    finally:
        raw = read_to_end(s)
    assert b"data: [DONE]" not in raw[-200:]  # dropped: the body was cut
    assert _served(r, "d0") == 2
