"""A client that stops sending its request body gets a 408 after the body's idle bound
(``router.server.BODY_IDLE_TIMEOUT_S``, 60 s; 1 s here), and the router lets go of the
request. Before, uvicorn waited for the rest of the body for ever: the request's task and its
connection were held (a reviewer's reproduction: still waiting 17 s past a 4 s request
deadline). A slow body that keeps coming and a stream that outlives the bound are untouched."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from router_harness import MODEL_NAME, router_with_one_worker

from router import server as router_server

pytestmark = pytest.mark.integration

IDLE_S = 1.0


@pytest.fixture
def router(tiny_model, redis_server, monkeypatch):
    monkeypatch.setattr(router_server, "BODY_IDLE_TIMEOUT_S", IDLE_S)
    with router_with_one_worker(
        tiny_model, redis_server.url, "stall", worker_opts={"token_delay": 0.2}
    ) as r:
        yield r


def _read_response(s: socket.socket, timeout: float) -> tuple[int, dict]:
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"connection closed without an answer: {data!r}"
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    status = int(head.split(b" ")[1])
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    while len(rest) < length:
        chunk = s.recv(65536)
        assert chunk
        rest += chunk
    return status, json.loads(rest[:length])


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_stalled_body_ends_408_and_the_router_lets_go(router, framing):
    s = socket.create_connection(("127.0.0.1", router.port))
    try:
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        if framing == "content-length":
            s.sendall((head + "Content-Length: 1000\r\n\r\n").encode() + b'{"model": ')
        else:
            s.sendall(
                (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + b'a\r\n{"model": \r\n'
            )
        t0 = time.monotonic()
        status, body = _read_response(s, timeout=30)
        elapsed = time.monotonic() - t0
        assert status == 408, body
        assert body["error"]["code"] == "request_timeout", body
        assert IDLE_S * 0.9 < elapsed < 20
        s.settimeout(10)
        assert s.recv(1) == b""  # the router closed the connection
    finally:
        s.close()
    # nothing left in flight, and the router serves
    r = httpx.post(
        f"{router.url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 200, r.text


def test_a_slow_body_that_keeps_coming_and_a_long_stream_are_served(router):
    payload = json.dumps(
        {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 8, "stream": True}
    ).encode()
    pieces = [payload[i : i + 8] for i in range(0, len(payload), 8)]

    def slow_body():
        for p in pieces[:8]:  # each pause a quarter of the bound, the whole body twice it
            yield p
            time.sleep(IDLE_S / 4)
        yield b"".join(pieces[8:])

    with httpx.Client(timeout=30) as client:
        with client.stream(
            "POST",
            f"{router.url}/v1/completions",
            content=slow_body(),
            headers={"Content-Type": "application/json"},
        ) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
    # 8 tokens 0.2 s apart: the stream outlived the body's bound, uncut
    assert events[-1] == "data: [DONE]"
    tokens = [json.loads(e[6:]) for e in events[:-1]]
    assert sum(1 for t in tokens if t["choices"] and t["choices"][0]["text"]) >= 1
    assert tokens[-1]["choices"][0]["finish_reason"] == "length" or any(
        t["choices"] and t["choices"][0].get("finish_reason") == "length" for t in tokens
    )
