"""A slow client is not a failed worker: while a client stops reading, the router stops reading
its worker (backpressure on that request), and the stall watchdog counts only time spent
waiting on the worker, so the worker is neither cooled down nor abandoned and every other
request goes on."""

from __future__ import annotations

import time
from dataclasses import replace

import httpx
import pytest
from router_harness import MODEL_NAME, SLOW_READER_BODY, read_to_end, stalled_stream

pytestmark = pytest.mark.integration


@pytest.fixture(params=["mux", "per-request"])
def router_config(router_config, request):
    """Every test here with both ``--decode-stream`` modes: the shared GenerateMux call per
    worker (the default) and one Generate call per request end streams by the same rules."""
    return replace(router_config, decode_stream=request.param)


def _slow_stream(port: int, body: dict, pause_s: float) -> tuple[bytes, float]:
    """Read the first few KiB of a streamed request, stop reading for ``pause_s`` (the
    router's send buffer and ours fill up), then read to the end; returns (the whole body,
    seconds)."""
    t0 = time.monotonic()
    s, data = stalled_stream(port, body)
    time.sleep(pause_s)
    return data + read_to_end(s), time.monotonic() - t0


def test_a_client_that_stops_reading_does_not_fail_its_worker(
    make_worker, make_router, router_config
):
    make_worker("steady")
    r = make_router(replace(router_config, stall_timeout_s=1.0, max_model_len=None))
    r.wait_workers(1)
    # the router's sends block within ~0.2 s of the pause's start (measured): it then stops
    # reading the worker for ~1.8 s, well past the 1 s stall timeout
    raw, seconds = _slow_stream(r.port, SLOW_READER_BODY, pause_s=2.0)
    text = raw.decode(errors="replace")
    assert seconds >= 2.0
    assert "data: [DONE]" in text[-200:], text[-300:]  # (the body is chunked)
    assert not [ln for ln in text.splitlines() if ln.startswith('data: {"error"')]
    metrics = httpx.get(f"{r.url}/metrics", timeout=10).text
    retries = [ln for ln in metrics.splitlines() if ln.startswith("pdserve:router_retries_total")]
    assert retries and float(retries[0].split()[-1]) == 0, retries
    health = httpx.get(f"{r.url}/health", timeout=10).json()
    assert health["decode_workers"] == 1, health  # not cooled down
    ok = httpx.post(
        f"{r.url}/v1/completions",
        timeout=10,
        json={"model": MODEL_NAME, "prompt": "next", "max_tokens": 4},
    )
    assert ok.status_code == 200
