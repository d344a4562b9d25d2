"""``bench/router_overhead.py``'s concurrent phase counts what the streams delivered and fails
on a broken stream (fake aiohttp session: no router, no network)."""

from __future__ import annotations

import asyncio
import json
import os
import types

import aiohttp
import pytest

from bench import router_overhead as ro

pytestmark = pytest.mark.unit


def _line(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n"


def _choice(text: str, finish=None) -> bytes:
    ev = {"id": "c", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    return _line(json.dumps(ev, separators=(",", ":")).replace("}]}", '}],"usage":null}').encode())


def _usage(n: int) -> bytes:
    return _line({"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}})


OK = [_choice("a"), b"\n", _choice("b", "length"), b"\n", _usage(2), b"\n", _line(b"[DONE]")]


class _Resp:
    def __init__(self, lines: list[bytes]) -> None:
        self.status = 200
        self.lines = lines

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    @property
    def content(self):
        return _Content(self.lines)


class _Content:
    """aiohttp's StreamReader: iterated, one line at a time; ``iter_any()``, as it arrives."""

    def __init__(self, lines: list[bytes]) -> None:
        self.lines = lines

    async def __aiter__(self):
        for ln in self.lines:
            yield ln

    async def iter_any(self):
        for ln in self.lines:
            yield ln


class _Session:
    def __init__(self, lines: list[bytes]) -> None:
        self.lines = lines

    def post(self, url, json=None):
        return _Resp(self.lines)


def _one(lines: list[bytes]):
    return asyncio.run(ro._stream_one(_Session(lines), "http://x", "p", 16))


def test_a_whole_stream_counts_the_usage_tokens():
    events, tokens = _one(OK)
    assert (events, tokens) == (4, 2)


def test_an_error_event_raises():
    err = _line({"error": {"message": "boom", "type": "x", "code": 500}})
    with pytest.raises(RuntimeError, match="boom"):
        _one([_choice("a"), b"\n", err, b"\n", _line(b"[DONE]")])


def test_a_stream_without_done_raises():
    with pytest.raises(RuntimeError, match=r"\[DONE\]"):
        _one([_choice("a"), b"\n", _choice("b", "length"), b"\n", _usage(2), b"\n"])


def test_concurrent_divides_by_the_tokens_received(monkeypatch):
    """16 tokens asked per stream, 2 delivered: the throughput and the CPU per token are per
    delivered token (they were computed as if all 16 had come)."""

    class FakeClientSession(_Session):
        def __init__(self, **kw) -> None:
            super().__init__(OK)

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

    monkeypatch.setattr(aiohttp, "ClientSession", FakeClientSession)
    monkeypatch.setattr(aiohttp, "TCPConnector", lambda **kw: None)
    cpu = iter([10.0, 10.5])
    monkeypatch.setattr(ro, "_cpu_s", lambda pid: next(cpu))
    args = types.SimpleNamespace(streams=2, stream_tokens=16)
    r = asyncio.run(ro._concurrent("http://x", os.getpid(), args, ["p"] * 5))
    assert r["router_cpu_us_per_token"] == pytest.approx(0.5 / 10 * 1e6)
    assert r["output_tokens_per_s"] == pytest.approx(10 / r["wall_s"])
    assert r["output_tokens"] == 10
