"""The NIXL link's frames and its rules, over a fake inner link and a fake agent (no NIXL here).

What the link promises (``kvtransfer/nixl.py``): a receive completes only once its read can
no longer write; a READY that lies about its size or that nobody claims in time is refused;
a malformed frame closes the link; closing fails every outstanding operation, cancelling
reads first. The real transport runs in ``test_nixl.py`` (peer processes).
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from kvtransfer.errors import PeerLostError, ProtocolError
from kvtransfer.nixl import _AGENT, _CTRL, _READY, _TAKEN, MAX_UNCLAIMED, NixlLink
from kvtransfer.pool import Region

pytestmark = pytest.mark.unit


class FakeReactor:
    def __init__(self):
        self.queue = []

    def call_soon(self, fn, *args):
        self.queue.append((fn, args))

    def call_later(self, _delay, fn, *args):
        self.queue.append((fn, args))

    def run(self, limit=1000):
        for _ in range(limit):
            if not self.queue:
                return
            fn, args = self.queue.pop(0)
            fn(*args)
        raise AssertionError("reactor queue never drained")


class FakeAgent:
    """Records reads; ``finish(i, error)`` completes read ``i`` as NIXL's poll would."""

    def __init__(self, reactor):
        self.reactor = reactor
        self.reads = []  # [remote, dst, src_addr, src_dev, callback]
        self.loaded = []
        self.cancellable = True
        self.fail_reads = None

    def covers(self, *_):
        return True

    def metadata(self, regs=None):
        return b"MD"

    def load(self, md):
        self.loaded.append(md)
        return "peer-agent"

    def read(self, remote, dst, src_addr, src_dev, callback):
        if self.fail_reads:
            raise RuntimeError(self.fail_reads)
        self.reads.append([remote, dst, src_addr, src_dev, callback])

    def finish(self, i, error=None):
        self.reads[i][4](error)

    def cancel(self, callback):
        if not self.cancellable:
            return False
        for r in self.reads:
            if r[4] is callback:
                self.reads.remove(r)
                self.reactor.call_soon(callback, PeerLostError("read cancelled"))
        return True


class FakeTransport:
    def __init__(self):
        self.reactor = FakeReactor()
        self.agent = FakeAgent(self.reactor)
        self.links = set()
        self.attached = []

    def attach(self, md):
        self.attached.append(md)
        return self.agent.load(md)

    def detach(self, remote):
        self.attached.remove(b"MD")


class FakeInner:
    peer = "fake"

    def __init__(self):
        self.sent = []
        self.alive = True
        self.on_ctrl = self.on_closed = None

    def start(self):
        pass

    def send_ctrl(self, payload):
        self.sent.append(payload)

    def close(self):
        self.alive = False


def frames(inner):
    out = []
    for payload in inner.sent:
        kind, body = payload[0], payload[1:]
        out.append((kind, msgpack.unpackb(body) if kind in (_READY, _TAKEN) else body))
    inner.sent.clear()
    return out


def make(connecting):
    t = FakeTransport()
    inner = FakeInner()
    link = NixlLink(t, inner, connecting=connecting)
    t.links.add(link)
    events = {"ctrl": [], "closed": []}
    link.on_ctrl = events["ctrl"].append
    link.on_closed = events["closed"].append
    link.start()
    return t, inner, link, events


def region(nbytes=64):
    buf = np.zeros(nbytes, np.uint8)
    return Region(0, 1, nbytes, buf, False)


def deliver(inner, kind, body):
    raw = msgpack.packb(body) if kind in (_READY, _TAKEN) else body
    inner.on_ctrl(bytes([kind]) + raw)


def receiver_with_metadata():
    t, inner, link, events = make(connecting=False)
    deliver(inner, _AGENT, b"MD")
    return t, inner, link, events


def test_the_connecting_side_sends_its_metadata_first_and_control_is_prefixed():
    t, inner, link, _ = make(connecting=True)
    link.send_ctrl(b"hello")
    assert frames(inner) == [(_AGENT, b"MD"), (_CTRL, b"hello")]


@pytest.mark.parametrize("posted_first", [True, False])
def test_a_receive_reads_the_announced_bytes_then_answers_taken(posted_first):
    t, inner, link, events = receiver_with_metadata()
    got = []
    r = region(64)
    if posted_first:
        link.recv_data(7, r, got.append)
    deliver(inner, _READY, [7, 0x1000, 64, 0, None])
    if not posted_first:
        link.recv_data(7, r, got.append)
    t.reactor.run()
    assert len(t.agent.reads) == 1 and got == []  # nothing completes before the read
    remote, dst, src_addr, _dev, _cb = t.agent.reads[0]
    assert remote == "peer-agent" and src_addr == 0x1000 and dst[1] == 64
    assert dst[0] == r.buffer.__array_interface__["data"][0]
    t.agent.finish(0)
    assert got == [None]
    assert frames(inner) == [(_TAKEN, [7, None])]
    assert t.attached == [b"MD"]


def test_a_discard_answers_taken_without_reading():
    t, inner, link, _ = receiver_with_metadata()
    got = []
    link.recv_data(3, None, got.append)
    deliver(inner, _READY, [3, 0x1000, 64, 0, None])
    t.reactor.run()
    assert t.agent.reads == [] and got == [None]
    assert frames(inner) == [(_TAKEN, [3, None])]


def test_a_size_that_differs_from_the_receive_is_refused_without_reading():
    t, inner, link, events = receiver_with_metadata()
    got = []
    link.recv_data(3, region(64), got.append)
    deliver(inner, _READY, [3, 0x1000, 65, 0, None])
    t.reactor.run()
    assert t.agent.reads == []
    assert isinstance(got[0], ProtocolError) and "65 bytes announced" in str(got[0])
    assert frames(inner) == [(_TAKEN, [3, "65 bytes announced for a 64-byte receive"])]
    assert events["closed"] == [] and link.alive  # only that message failed


def test_a_refused_read_fails_that_message_only():
    t, inner, link, events = receiver_with_metadata()
    t.agent.fail_reads = "NIXL_ERR_NOT_FOUND"
    got = []
    link.recv_data(3, region(), got.append)
    deliver(inner, _READY, [3, 16, 64, 0, None])
    t.reactor.run()
    assert isinstance(got[0], PeerLostError) and "NOT_FOUND" in str(got[0])
    assert frames(inner)[0][1][0] == 3 and link.alive


def test_data_before_the_peers_metadata_is_refused():
    t, inner, link, _ = make(connecting=False)
    got = []
    link.recv_data(3, region(), got.append)
    deliver(inner, _READY, [3, 16, 64, 0, None])
    t.reactor.run()
    assert isinstance(got[0], ProtocolError) and t.agent.reads == []


def test_a_message_registered_for_itself_loads_its_partial_metadata():
    t, inner, link, _ = receiver_with_metadata()
    link.recv_data(3, region(), lambda e: None)
    deliver(inner, _READY, [3, 16, 64, 0, b"PARTIAL"])
    assert t.agent.loaded == [b"MD", b"PARTIAL"] and len(t.agent.reads) == 1


@pytest.mark.parametrize(
    "kind,body",
    [
        (_READY, b"\xc1"),  # not msgpack
        (_READY, [1, 2, 3]),  # wrong arity
        (_READY, [1, 2, 0, 0, None]),  # zero bytes
        (_READY, [1, True, 64, 0, None]),  # a bool is no address
        (_TAKEN, [1, None]),  # TAKEN to a receiver
        (9, b""),  # unknown kind
        (_AGENT, b"MD2"),  # metadata twice
    ],
)
def test_a_malformed_or_misplaced_frame_closes_the_link(kind, body):
    t, inner, link, events = receiver_with_metadata()
    pending = []
    link.recv_data(5, region(), pending.append)
    if isinstance(body, bytes) and kind == _READY:
        inner.on_ctrl(bytes([kind]) + body)
    else:
        deliver(inner, kind, body)
    t.reactor.run()
    assert not link.alive and not inner.alive
    assert len(events["closed"]) == 1 and isinstance(pending[0], PeerLostError)
    assert link not in t.links


def test_oversized_metadata_closes_the_link():
    t, inner, link, events = make(connecting=False)
    deliver(inner, _AGENT, b"x" * ((1 << 20) + 1))
    t.reactor.run()
    assert not link.alive and len(events["closed"]) == 1


def test_an_announcement_twice_or_too_many_unclaimed_close_the_link():
    t, inner, link, events = receiver_with_metadata()
    deliver(inner, _READY, [1, 16, 64, 0, None])
    deliver(inner, _READY, [1, 16, 64, 0, None])
    t.reactor.run()
    assert not link.alive
    t, inner, link, events = receiver_with_metadata()
    for tag in range(MAX_UNCLAIMED):
        deliver(inner, _READY, [tag, 16, 64, 0, None])
    assert link.alive
    deliver(inner, _READY, [MAX_UNCLAIMED, 16, 64, 0, None])
    t.reactor.run()
    assert not link.alive


def test_closing_cancels_reads_before_it_reports():
    t, inner, link, events = receiver_with_metadata()
    got = []
    link.recv_data(1, region(), got.append)
    deliver(inner, _READY, [1, 16, 64, 0, None])
    t.agent.cancellable = False  # NIXL cannot cancel yet: nothing may be reported
    link.close()
    for _ in range(5):
        fn, args = t.reactor.queue.pop(0)
        fn(*args)
    assert got == [] and events["closed"] == [] and link in t.links
    t.agent.cancellable = True
    t.reactor.run()
    assert isinstance(got[0], PeerLostError)
    assert len(events["closed"]) == 1 and link not in t.links and t.attached == []


def test_the_sender_announces_and_completes_on_taken():
    t, inner, link, events = make(connecting=True)
    frames(inner)
    done = []
    r = region(64)
    link.send_data(9, r, done.append)
    ((kind, body),) = frames(inner)
    assert kind == _READY and body == [9, r.buffer.__array_interface__["data"][0], 64, 0, None]
    assert done == []  # the region stays in use until the receiver took it
    deliver(inner, _TAKEN, [9, None])
    assert done == [None]
    link.send_data(10, r, done.append)
    deliver(inner, _TAKEN, [10, "size mismatch"])
    assert isinstance(done[1], PeerLostError) and "size mismatch" in str(done[1])
    deliver(inner, _TAKEN, [10, None])  # not outstanding: the peer misbehaves
    t.reactor.run()
    assert not link.alive


def test_closing_fails_the_senders_outstanding_sends():
    t, inner, link, events = make(connecting=True)
    done = []
    link.send_data(1, region(), done.append)
    inner.on_closed(PeerLostError("reset"))
    t.reactor.run()
    assert isinstance(done[0], PeerLostError) and len(events["closed"]) == 1
    link.send_data(2, region(), done.append)  # after the close: fails at once
    t.reactor.run()
    assert isinstance(done[1], PeerLostError)


def test_a_link_closed_before_start_leaves_the_transport():
    t = FakeTransport()
    link = NixlLink(t, FakeInner(), connecting=False)
    t.links.add(link)
    link.close()
    t.reactor.run()
    assert link not in t.links
