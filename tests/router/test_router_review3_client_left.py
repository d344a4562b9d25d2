"""A client that leaves a request of several prompts ends it at once, as it ends a request of
one prompt: the prompts' streams end on their workers (``client_left``) and the request's
consumer wakes up, instead of waiting out the grace period after which the router cancels it
(here made a minute long, so a request still open after 30 s was waiting on it)."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import replace

import pytest
from router_harness import MODEL_NAME

import router.generation
import router.sse

pytestmark = pytest.mark.integration


def _open(port: int, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
        + payload
    )
    return s


@pytest.mark.parametrize("mode", ["mux", "per-request"])
@pytest.mark.parametrize(
    "stream,leave", [(True, "before"), (True, "during"), (False, "before"), (False, "during")]
)
def test_leaving_a_request_of_several_prompts_ends_it_at_once(
    make_worker, make_router, router_config, monkeypatch, mode, stream, leave
):
    monkeypatch.setattr(router.sse, "_ON_GONE_GRACE_S", 60.0)
    monkeypatch.setattr(router.generation, "_CALL_CANCEL_GRACE_S", 60.0)
    w = make_worker("d0", first_token_delay=1.0, token_delay=0.02)
    r = make_router(replace(router_config, decode_stream=mode))
    r.wait_workers(1)
    body = {
        "model": MODEL_NAME,
        "prompt": [[10, 11], [12, 13], [14, 15]],
        "max_tokens": 500,
        "n": 2,
        "stream": stream,
        "ignore_eos": True,
    }
    s = _open(r.port, body)
    pool = r.ctx.dispatcher.pool
    if leave == "before":  # while the prompts wait for their first tokens
        deadline = time.monotonic() + 30
        while pool.inflight("d0") < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.inflight("d0") == 3
    elif stream:  # after the first events came
        s.settimeout(30)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
    else:  # while the tokens come (the response comes at the end)
        deadline = time.monotonic() + 30
        while pool.decoding("d0") < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.decoding("d0") == 3
    assert r.ctx.inflight == 1
    s.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if r.ctx.inflight == 0 and pool.inflight("d0") == 0 and w.stats().running == 0:
            break
        time.sleep(0.05)
    assert (r.ctx.inflight, pool.inflight("d0"), pool.decoding("d0")) == (0, 0, 0)
    assert w.stats().running == 0
