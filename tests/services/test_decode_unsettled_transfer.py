"""A remote prefill that fails falls back to a local prefill into the same blocks, but only once
its KV receive is terminal. A receive still outstanding after its cancel (a transport that
ignores the cancel) could write those blocks under the local prefill's KV: the request is
prefilled on new blocks instead, and the reserved ones stay pinned until the receive ends.
Before the first fix the local prefill used the reserved blocks regardless; before the second
the request failed (an error to its client, for a fault not its own)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from types import SimpleNamespace

import pytest

import decode_service.server as server
import shared.worker.service as service
from decode_service.server import DecodeServicer, _Flight
from shared.proto import pdserve_pb2 as pb

pytestmark = pytest.mark.unit


class _Handle:
    """A receive whose cancel ends it (``settles``) or is ignored."""

    transfer_id = "r:1"

    def __init__(self, settles: bool) -> None:
        self.settles = settles
        self.done = False

    def cancel(self) -> None:
        self.done = self.settles

    def __await__(self):
        return asyncio.get_running_loop().create_future().__await__()  # never resolves


class _Loop:
    """The engine thread, played inline: records what the servicer asks of the engine."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        engine = SimpleNamespace(
            fail_request=lambda eid, why: self.calls.append(("fail", eid, why)) or [],
            finish_remote_prefill=lambda eid, tokens, fresh_blocks=False: (
                self.calls.append(("local", eid, fresh_blocks)) or []
            ),
        )
        self.engine = engine

    def submit(self, fn):
        f: concurrent.futures.Future = concurrent.futures.Future()
        f.set_result(fn(self.engine))
        return f

    def deliver(self, outs) -> None:
        pass


def _run(settles: bool, monkeypatch) -> list[tuple]:
    monkeypatch.setattr(service, "CANCEL_SETTLE_S", 0.05)
    monkeypatch.setattr(server, "FALLBACK_SETTLE_S", 0.05)
    s = DecodeServicer.__new__(DecodeServicer)
    loop = _Loop()
    fallbacks: list[str] = []
    s.rt = SimpleNamespace(
        loop=loop,
        worker_id="d-0",
        security=SimpleNamespace(call_metadata=()),
        metrics=SimpleNamespace(fallback=fallbacks.append),
    )
    s.prefill_timeout_s = 5.0
    s.fallbacks = 0
    handle = _Handle(settles)
    s.receiver = SimpleNamespace(expect=lambda *a, **k: handle, address=b"d")

    def prefill(*a, **k):
        raise RuntimeError("P refused the call")

    s._stub = lambda address: SimpleNamespace(Prefill=prefill)
    flight = _Flight(pb.GenerateRequest(request_id="r", prefill_address="p:1"), "r@1", 1, None)
    asyncio.run(asyncio.wait_for(s._remote_prefill(flight, 0, [3, 4]), 5))
    assert fallbacks == ["prefill_error"]
    return loop.calls


def test_a_settled_receive_falls_back_to_a_local_prefill_in_the_reserved_blocks(monkeypatch):
    assert _run(True, monkeypatch) == [("local", "r@1", False)]


def test_a_receive_that_ignores_its_cancel_falls_back_on_new_blocks(monkeypatch):
    assert _run(False, monkeypatch) == [("local", "r@1", True)]
