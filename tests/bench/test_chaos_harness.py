"""The chaos suite's oracle and stream checks (``bench/chaos.py``), against fake HTTP answers:
no cluster, no network."""

from __future__ import annotations

import asyncio
import json
import math
import types
import zlib

import httpx
import pytest

from bench import chaos
from bench.chaos import Case, _largest_rise_pct, expected_outputs, stream_one

pytestmark = pytest.mark.unit

WANT = (11, 12, 13, 14)


def _sse(events: list[dict | str]) -> bytes:
    out = []
    for e in events:
        out.append("data: " + (e if isinstance(e, str) else json.dumps(e)) + "\n\n")
    return "".join(out).encode()


def _chunk(ids: list[int], finish: str | None = None) -> dict:
    return {
        "choices": [
            {
                "index": 0,
                "text": "".join(f"t{i}" for i in ids),
                "logprobs": {"tokens": [f"token_id:{i}" for i in ids]},
                "finish_reason": finish,
            }
        ]
    }


def _stream(body: bytes, **kw) -> chaos.Result:
    async def go():
        transport = httpx.MockTransport(lambda req: httpx.Response(200, content=body))
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_one(client, "http://x", "m", Case([1, 2], len(WANT), WANT), **kw)

    return asyncio.run(go())


def test_a_whole_stream_with_done_is_identical():
    body = _sse([_chunk([11, 12]), _chunk([13, 14], "length"), "[DONE]"])
    assert _stream(body).outcome == "identical"


def test_a_stream_without_done_is_lost():
    """Every token, then the connection closed: no [DONE], so not a finished stream."""
    r = _stream(_sse([_chunk([11, 12]), _chunk([13, 14], "length")]))
    assert r.outcome == "lost", r
    assert "[DONE]" in r.detail


def test_a_stream_without_a_finish_reason_is_lost():
    r = _stream(_sse([_chunk([11, 12]), _chunk([13, 14]), "[DONE]"]))
    assert r.outcome == "lost", r
    assert "finish_reason" in r.detail


def test_a_cancelled_stream_with_a_wrong_prefix_is_wrong():
    r = _stream(_sse([_chunk([11, 99]), _chunk([13, 14], "length"), "[DONE]"]), cancel_after=2)
    assert (r.kind, r.outcome) == ("cancel", "wrong"), r
    ok = _stream(_sse([_chunk([11, 12]), _chunk([13, 14], "length"), "[DONE]"]), cancel_after=2)
    assert (ok.kind, ok.outcome) == ("cancel", "cancelled"), ok


def _fake_server(monkeypatch, ids: list[int], text: str) -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        lp = {"tokens": [f"token_id:{i}" for i in ids]} if body.get("logprobs") == 0 else None
        return httpx.Response(200, json={"choices": [{"text": text, "logprobs": lp}]})

    real = httpx.AsyncClient
    monkeypatch.setattr(
        chaos.httpx,
        "AsyncClient",
        lambda **kw: real(transport=httpx.MockTransport(handler), **kw),
    )


def test_expected_outputs_are_max_tokens_long(monkeypatch):
    _fake_server(monkeypatch, [5, 6, 7], "abc")
    out = asyncio.run(expected_outputs("http://x", "m", [Case([1, 2], 3)]))
    assert out[0].expected == (5, 6, 7) and out[0].text == "abc"


@pytest.mark.parametrize(("ids", "text"), [([], "abc"), ([5, 6], "ab"), ([5, 6, 7], "")])
def test_an_empty_or_short_oracle_is_an_error(monkeypatch, ids, text):
    """A server that sent no token ids gave an empty oracle, and classify([], (), None) is
    "identical": every stream would have passed."""
    _fake_server(monkeypatch, ids, text)
    with pytest.raises(RuntimeError, match="no oracle"):
        asyncio.run(expected_outputs("http://x", "m", [Case([1, 2], 3)]))


def test_a_nan_sample_does_not_hide_growth():
    """rss_mib() records NaN for a process that had exited; NaN <= 0 is False and every
    comparison with a NaN low is False, so the rise after it was lost."""
    assert _largest_rise_pct([math.nan, 100.0, 200.0]) == pytest.approx(100.0)
    assert _largest_rise_pct([100.0, math.nan, 150.0]) == pytest.approx(50.0)
    assert _largest_rise_pct([math.nan]) is None


def test_the_load_seed_does_not_depend_on_hash_randomisation(monkeypatch):
    seen = []

    class Stop(Exception):
        pass

    def fake_load(url, model, cases, streams, seed):
        seen.append(seed)
        raise Stop

    monkeypatch.setattr(chaos, "Load", fake_load)
    cluster = types.SimpleNamespace(served_model_name="m", url="http://x")
    args = types.SimpleNamespace(streams=1)
    for fault in ("kill-decode", "drain"):
        with pytest.raises(Stop):
            asyncio.run(chaos.run_fault(fault, cluster, None, [], args))
    assert seen == [zlib.crc32(b"kill-decode") & 0xFFFF, zlib.crc32(b"drain") & 0xFFFF]
    assert chaos.load_seed("kill-decode") == zlib.crc32(b"kill-decode") & 0xFFFF
