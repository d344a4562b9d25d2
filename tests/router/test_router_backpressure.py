"""A slow client is not a failed worker: while a client stops reading, the router stops reading
its worker (backpressure on that request), and the stall watchdog counts only time spent
waiting on the worker, so the worker is neither cooled down nor abandoned and every other
request goes on."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import replace

import httpx
import pytest
from router_harness import MODEL_NAME

pytestmark = pytest.mark.integration


@pytest.fixture(params=["mux", "per-request"])
def router_config(router_config, request):
    """Every test here with both ``--decode-stream`` modes: the shared GenerateMux call per
    worker (the default) and one Generate call per request end streams by the same rules."""
    return replace(router_config, decode_stream=request.param)


def _slow_stream(port: int, body: dict, pause_s: float) -> tuple[bytes, float]:
    """POST a streaming request over a socket with a 4 KiB receive buffer, read the first few
    KiB, stop reading for ``pause_s`` (the router's send buffer and ours fill up), then read to
    the end; returns (the whole body, seconds)."""
    payload = json.dumps(body).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
        + payload
    )
    t0 = time.monotonic()
    data = s.recv(4096)
    time.sleep(pause_s)
    s.settimeout(60)
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    return data, time.monotonic() - t0


def test_a_client_that_stops_reading_does_not_fail_its_worker(
    make_worker, make_router, router_config
):
    make_worker("steady")
    r = make_router(replace(router_config, stall_timeout_s=1.0, max_model_len=None))
    r.wait_workers(1)
    # 8 samples x 3000 tokens x ~600 B of SSE (20 top logprobs): ~14 MB, more than the
    # kernel buffers (up to 4 MiB each way) hold
    body = {
        "model": MODEL_NAME,
        "prompt": "slow reader",
        "max_tokens": 3000,
        "stream": True,
        "n": 8,
        "logprobs": 20,
        "temperature": 0,
        "ignore_eos": True,
    }
    raw, seconds = _slow_stream(r.port, body, pause_s=4.0)
    text = raw.decode(errors="replace")
    assert seconds >= 4.0
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
