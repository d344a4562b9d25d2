"""In-process loopback transport: the full protocol without a network, for unit tests.

A :class:`LoopbackNetwork` plays the network: receivers listen on it and senders connect
through it (pass the same network to both). Each side still has its own reactor thread, control
messages are delivered in order onto the peer's reactor, and a data message moves only when
both the send and the matching receive are posted (UCX's rendezvous semantics), copying the
bytes straight from the sender's pool into the receiver's pool. Closing either end fails every
outstanding data operation on both ends and notifies both, as a dropped UCX endpoint does.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from kvtransfer.base import DataCallback, Link, Transport
from kvtransfer.errors import PeerLostError, ProtocolError
from kvtransfer.pool import Region, copy_region
from kvtransfer.protocol import ReceiverAddress
from kvtransfer.reactor import Reactor

_Acceptor = Callable[["LoopbackLink"], None]
# A posted data operation: (region, completion, the reactor that runs the completion).
_PostedOp = tuple["Region | None", DataCallback, Reactor]
_Queues = dict[int, collections.deque[_PostedOp]]  # by tag, in posting order


class LoopbackNetwork:
    """Registry of listening loopback receivers; one per test (no global state)."""

    def __init__(self, name: str = "loopback"):
        self.name = name
        self._lock = threading.Lock()
        self._listeners: dict[int, _Acceptor] = {}
        self._next_port = 1

    def bind(self, port: int, acceptor: _Acceptor) -> int:
        with self._lock:
            if port == 0:
                while self._next_port in self._listeners:
                    self._next_port += 1
                port = self._next_port
                self._next_port += 1
            if port in self._listeners:
                raise OSError(f"loopback port {port} is already in use")
            self._listeners[port] = acceptor
            return port

    def unbind(self, port: int) -> None:
        with self._lock:
            self._listeners.pop(port, None)

    def lookup(self, port: int) -> _Acceptor | None:
        with self._lock:
            return self._listeners.get(port)


class _Channel:
    """State shared by the two ends of one loopback connection."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed = False
        # Per direction (index = sending side): tag -> FIFO of posted operations.
        self.sends: tuple[_Queues, _Queues] = ({}, {})
        self.recvs: tuple[_Queues, _Queues] = ({}, {})
        self.ends: list[LoopbackLink] = []


class LoopbackLink(Link):
    """One end of a loopback connection; ``side`` 0 is the connecting end."""

    def __init__(self, channel: _Channel, side: int, reactor: Reactor | None):
        self._ch = channel
        self._side = side
        self.reactor = reactor
        self._started = False
        self._inbox: list[bytes] = []
        self._closed_notified = False
        self._refused: BaseException | None = None
        channel.ends.append(self)

    @property
    def _peer(self) -> LoopbackLink:
        return self._ch.ends[1 - self._side]

    @property
    def alive(self) -> bool:
        return not self._ch.closed

    def start(self) -> None:
        assert self.reactor is not None  # a link is adopted by a reactor before it starts
        self._started = True
        if self._refused is not None:
            self.reactor.call_soon(self._notify_closed, self._refused)
        self.reactor.call_soon(self._drain_inbox)

    def _deliver(self, payload: bytes) -> None:  # on this end's reactor
        self._inbox.append(payload)
        if self._started:
            self._drain_inbox()

    def _drain_inbox(self) -> None:
        while self._inbox and not self._ch.closed:
            payload = self._inbox.pop(0)
            if len(payload) > self.max_ctrl_bytes:  # as a UCX link: the connection closes
                self.close()
                return
            self.on_ctrl(payload)

    def send_ctrl(self, payload: bytes) -> None:
        if self._ch.closed or len(self._ch.ends) < 2:
            return
        peer = self._peer
        assert peer.reactor is not None  # the accepting side adopted it in connect()
        peer.reactor.call_soon_threadsafe(peer._deliver, bytes(payload))

    def send_data(self, tag: int, region: Region, done: DataCallback) -> None:
        assert self.reactor is not None  # started links only
        self._post(
            self._ch.sends,
            self._ch.recvs,
            self._side,
            tag,
            (region, done, self.reactor),
            sending=True,
        )

    def recv_data(self, tag: int, region: Region | None, done: DataCallback) -> None:
        assert self.reactor is not None  # started links only
        self._post(
            self._ch.recvs,
            self._ch.sends,
            1 - self._side,
            tag,
            (region, done, self.reactor),
            sending=False,
        )

    def _post(
        self,
        mine: tuple[_Queues, _Queues],
        theirs: tuple[_Queues, _Queues],
        direction: int,
        tag: int,
        op: _PostedOp,
        *,
        sending: bool,
    ) -> None:
        with self._ch.lock:
            if not self._ch.closed:
                queue = theirs[direction].get(tag)
                if queue:
                    other = queue.popleft()
                    if not queue:
                        del theirs[direction][tag]
                else:
                    mine[direction].setdefault(tag, collections.deque()).append(op)
                    return
        if self._ch.closed:
            _region, done, reactor = op
            reactor.call_soon_threadsafe(done, PeerLostError("loopback connection closed"))
            return
        send, recv = (op, other) if sending else (other, op)
        self._move(send, recv)

    @staticmethod
    def _move(send: _PostedOp, recv: _PostedOp) -> None:
        """Copy a matched send into its receive, then complete both (UCX semantics: a receive
        smaller than the message fails as truncated, the send still succeeds)."""
        src, send_done, send_reactor = send
        dst, recv_done, recv_reactor = recv
        assert src is not None  # send_data always posts a region
        recv_error: BaseException | None = None
        if dst is not None:
            if dst.nbytes != src.nbytes:
                recv_error = ProtocolError(
                    f"message truncated: {src.nbytes} bytes into {dst.nbytes}"
                )
            else:
                copy_region(dst, src)
        send_reactor.call_soon_threadsafe(send_done, None)
        recv_reactor.call_soon_threadsafe(recv_done, recv_error)

    def close(self) -> None:
        ch = self._ch
        with ch.lock:
            if ch.closed:
                return
            ch.closed = True
            pending = [op for table in (*ch.sends, *ch.recvs) for q in table.values() for op in q]
            for table in (*ch.sends, *ch.recvs):
                table.clear()
        error = PeerLostError("loopback connection closed")
        for _region, done, reactor in pending:
            reactor.call_soon_threadsafe(done, error)
        for end in ch.ends:
            if end.reactor is not None:
                end.reactor.call_soon_threadsafe(end._notify_closed, error)

    def _notify_closed(self, error: BaseException) -> None:
        if self._closed_notified or not self._started:
            return
        self._closed_notified = True
        self.on_closed(error)


class LoopbackTransport(Transport):
    """Loopback connections on ``network``, driven by a reactor thread of its own."""

    kind = "loopback"

    def __init__(self, network: LoopbackNetwork, *, name: str = "loopback"):
        if not isinstance(network, LoopbackNetwork):
            raise TypeError(
                "the loopback transport needs network=LoopbackNetwork() shared by both sides"
            )
        self.network = network
        self.reactor = Reactor(name)
        self.reactor.start()
        self._port: int | None = None
        self._on_accept: Callable[[Link], None] | None = None
        self._links: set[LoopbackLink] = set()
        self._closed = False

    def listen(
        self,
        host: str,
        port: int,
        on_accept: Callable[[Link], None],
        bind_host: str | None = None,
    ) -> tuple[str, int]:
        if self._port is not None:
            raise RuntimeError("this transport already listens")
        self._on_accept = on_accept
        self._port = self.network.bind(port, self._accept_from_peer)
        return self.network.name, self._port

    def _accept_from_peer(self, end: LoopbackLink) -> None:
        """Called on the connecting side's thread: adopt ``end`` and hand it over."""
        end.reactor = self.reactor
        self.reactor.call_soon_threadsafe(self._accept, end)

    def _accept(self, end: LoopbackLink) -> None:
        if self._closed or self._on_accept is None:
            end.close()
            return
        self._links.add(end)
        self._on_accept(end)

    def connect(self, address: ReceiverAddress) -> Link:
        channel = _Channel()
        mine = LoopbackLink(channel, 0, self.reactor)
        theirs = LoopbackLink(channel, 1, None)
        self._links.add(mine)
        acceptor = self.network.lookup(address.port) if address.host == self.network.name else None
        if acceptor is None:
            channel.closed = True
            mine._refused = PeerLostError(f"connection refused: nothing listens at {address}")
        else:
            acceptor(theirs)
        return mine

    def close(self) -> None:
        if self._closed:
            return
        if self.reactor.running:
            try:
                self.reactor.run_sync(self._teardown)
            except (TimeoutError, RuntimeError):
                pass
        self._closed = True
        self.reactor.stop()

    def _teardown(self) -> None:
        self._closed = True
        if self._port is not None:
            self.network.unbind(self._port)
        for link in list(self._links):
            link.close()
