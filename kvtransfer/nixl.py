"""NIXL transport: control over a UCX link, block data pulled with one-sided NIXL READs.

NIXL (``nixl_cu12``, the data plane vLLM's and Dynamo's disaggregation use, itself built on
UCX; imported only by :mod:`kvtransfer.nixl_agent`). NIXL moves bytes from the sender's pool to
the receiver's pool by the fastest path UCX finds between the two processes: cross-memory
attach (CMA) on one host, RDMA or TCP between hosts, NVLink / GPUDirect for device pools. On
one host that is a single ``process_vm_readv`` by the receiver, with no byte crossing a socket
(``docs/notes/kvtransfer_bench.md``).

The protocol state machines (:mod:`kvtransfer.sender`, :mod:`kvtransfer.receiver`) are the same
as over UCX: :class:`NixlLink` implements the same :class:`~kvtransfer.base.Link` contract, so
``send_data`` / ``recv_data`` keep their meaning, but a data message is a rendezvous carried out
with a one-sided read instead of a tagged send:

1. ``send_data(tag, region)`` on the sender announces ``READY [tag, address, nbytes, device]``
   on the link; the region stays untouched until ``done`` runs.
2. ``recv_data(tag, region)`` on the receiver waits for that announcement, then READs
   ``nbytes`` from the sender's registered pool straight into ``region`` (NIXL checks the range
   against the sender's registrations) and answers ``TAKEN [tag, error]``.
3. ``TAKEN`` completes the sender's ``done``. A receive posted with no region (discard) answers
   ``TAKEN`` without reading.

So the receiver is the only process that ever writes into its pool, and it does so only while a
receive it posted is outstanding: once ``recv_data``'s ``done`` has run (success, error or a
closed link) no byte of that message can land any more, which is what lets a handle turn
terminal (``kvtransfer/base.py``). A sender that is frozen cannot write into a receiver's pool
late, unlike a push design: a read in flight is not released until it ends (NIXL's release of a
read in flight does not stop it on every path), so a link closing with reads from a frozen
peer waits for them, and their transfers settle only then; a receiver frozen past the sender's
deadline and settle time could still read source blocks the sender has since reused, which the
per-block checksums catch (keep them on).

Link frames (on the inner UCX link's control stream, first byte the kind):

* ``0`` + a protocol control message (what the sender / receiver state machines exchange);
* ``1`` + the connecting side's NIXL agent metadata (sent once, first);
* ``2`` + msgpack ``[tag, address, nbytes, device, metadata | nil]`` (READY; ``metadata`` is the
  partial agent metadata of memory registered for this message only, e.g. a fault-injection
  copy outside the pool);
* ``3`` + msgpack ``[tag, error | nil]`` (TAKEN).

A malformed frame closes the link (as a corrupt UCX frame does). Progress: NIXL's own progress
thread (a period of ``progress_us``, not NIXL's busy default: a polling thread would take a
whole core of these machines) serves reads of this process's memory by remote agents where the
path needs the target's help (TCP); the reactor polls the reads this side started.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgpack

from kvtransfer.base import DataCallback, Link, Transport
from kvtransfer.errors import KVTransferError, PeerLostError, ProtocolError
from kvtransfer.nixl_agent import DEFAULT_PROGRESS_US, NixlAgent, buffer_location, nixl_bindings
from kvtransfer.pool import Region
from kvtransfer.protocol import ReceiverAddress
from kvtransfer.ucx import UcxTransport

logger = logging.getLogger("kvtransfer")

_CTRL, _AGENT, _READY, _TAKEN = 0, 1, 2, 3
#: READY announcements a link holds for receives not yet posted; more is a misbehaving peer.
MAX_UNCLAIMED = 4096
#: A peer's NIXL agent metadata (a few hundred bytes for one pool), kept until its first read.
MAX_METADATA_BYTES = 1 << 20
_TEARDOWN_S = 2.0


class NixlLink(Link):
    """A UCX link for control plus NIXL reads for data (see the module docstring)."""

    def __init__(self, transport: NixlTransport, inner: Link, connecting: bool):
        self._t = transport
        self._inner = inner
        self._connecting = connecting
        self.peer = getattr(inner, "peer", "peer")
        self._closed = False
        self._started = False
        self._notified = False
        self._closing_since = 0.0
        self._warned = False
        self._remote_md: bytes | None = None
        self._remote: str | None = None
        # sender side: tag -> (done, temporary registration or None)
        self._sends: dict[int, tuple[DataCallback, Any]] = {}
        # receiver side
        self._posted: dict[int, tuple[Region | None, DataCallback]] = {}
        self._ready: dict[int, list[Any]] = {}
        self._reading: dict[int, Callable[[BaseException | None], None]] = {}
        inner.on_ctrl = self._on_frame
        inner.on_closed = self._on_inner_closed

    @property
    def alive(self) -> bool:
        return not self._closed and self._inner.alive

    @property
    def max_ctrl_bytes(self) -> int:  # the frames are the inner link's
        return self._inner.max_ctrl_bytes

    @max_ctrl_bytes.setter
    def max_ctrl_bytes(self, value: int) -> None:
        self._inner.max_ctrl_bytes = value

    def start(self) -> None:
        self._started = True
        if self._closed:
            self._shutdown(PeerLostError(f"connection to {self.peer} closed"))
            return
        self._inner.start()
        if self._connecting:
            self._inner.send_ctrl(bytes([_AGENT]) + self._t.agent.metadata())

    def send_ctrl(self, payload: bytes) -> None:
        if not self._closed:
            self._inner.send_ctrl(bytes([_CTRL]) + payload)

    def _send_frame(self, kind: int, body: list[Any]) -> None:
        if not self._closed:
            self._inner.send_ctrl(bytes([kind]) + msgpack.packb(body, use_bin_type=True))

    # -- sender side ------------------------------------------------------------------

    def send_data(self, tag: int, region: Region, done: DataCallback) -> None:
        reactor = self._t.reactor
        if self._closed:
            reactor.call_soon(done, PeerLostError(f"connection to {self.peer} is closed"))
            return
        if tag in self._sends:
            reactor.call_soon(done, ProtocolError(f"data tag {tag:#x} is already in flight"))
            return
        addr, dev, cuda = buffer_location(region)
        agent = self._t.agent
        regs, md = None, None
        if not agent.covers(addr, region.nbytes, dev, cuda):
            # Not pool memory (a fault-injection copy): registered for this message alone.
            try:
                regs = agent.register(addr, region.nbytes, dev, cuda)
                md = agent.metadata(regs)
            except Exception as e:  # noqa: BLE001  (NIXL raises one type per status)
                if regs is not None:
                    agent.deregister(regs)
                reactor.call_soon(done, PeerLostError(f"NIXL cannot register the data: {e}"))
                return
        # the region object stays referenced (by the caller's done) until TAKEN
        self._sends[tag] = (done, regs)
        self._send_frame(_READY, [tag, addr, region.nbytes, dev, md])

    def _on_taken(self, body: Any) -> None:
        if not (isinstance(body, list) and len(body) == 2 and isinstance(body[0], int)):
            raise ProtocolError("malformed TAKEN frame")
        tag, error = body
        entry = self._sends.pop(tag, None)
        if entry is None:
            raise ProtocolError(f"TAKEN for data tag {tag:#x} that was not sent")
        done, regs = entry
        if regs is not None:
            self._t.agent.deregister(regs)
        done(None if error is None else PeerLostError(f"receiver could not take data: {error}"))

    # -- receiver side ----------------------------------------------------------------

    def recv_data(self, tag: int, region: Region | None, done: DataCallback) -> None:
        reactor = self._t.reactor
        if self._closed:
            reactor.call_soon(done, PeerLostError(f"connection to {self.peer} is closed"))
            return
        if tag in self._posted or tag in self._reading:
            reactor.call_soon(done, ProtocolError(f"a receive for tag {tag:#x} is already posted"))
            return
        ready = self._ready.pop(tag, None)
        if ready is None:
            self._posted[tag] = (region, done)
        else:
            self._take(tag, region, done, ready)

    def _on_ready(self, body: Any) -> None:
        if not (
            isinstance(body, list)
            and len(body) == 5
            and all(isinstance(x, int) and not isinstance(x, bool) for x in body[:4])
            and body[2] > 0
            and (body[4] is None or isinstance(body[4], bytes))
        ):
            raise ProtocolError("malformed READY frame")
        tag = body[0]
        if tag in self._ready or tag in self._reading:
            raise ProtocolError(f"data tag {tag:#x} announced twice")
        posted = self._posted.pop(tag, None)
        if posted is not None:
            self._take(tag, posted[0], posted[1], body)
        elif len(self._ready) >= MAX_UNCLAIMED:
            raise ProtocolError(f"more than {MAX_UNCLAIMED} unclaimed data messages")
        else:
            self._ready[tag] = body

    def _take(self, tag: int, region: Region | None, done: DataCallback, ready: list[Any]) -> None:
        # ``done`` always runs from a later reactor callback, as UCX completions do: the
        # receiver may post receives from inside its own completion handling
        _, src_addr, nbytes, src_dev, md = ready
        reactor = self._t.reactor
        if region is None:  # discard: nothing is read
            self._send_frame(_TAKEN, [tag, None])
            reactor.call_soon(done, None)
            return
        if nbytes != region.nbytes:
            reason = f"{nbytes} bytes announced for a {region.nbytes}-byte receive"
            self._send_frame(_TAKEN, [tag, reason])
            reactor.call_soon(done, ProtocolError(f"data tag {tag:#x}: {reason}"))
            return
        agent = self._t.agent
        try:
            if self._remote is None:
                if self._remote_md is None:
                    raise ProtocolError("data announced before the peer's NIXL metadata")
                self._remote = self._t.attach(self._remote_md)
            if md is not None:
                agent.load(md)
            addr, dev, cuda = buffer_location(region)

            def finished(error: BaseException | None) -> None:
                self._reading.pop(tag, None)
                self._send_frame(_TAKEN, [tag, None if error is None else str(error)])
                done(error)

            self._reading[tag] = finished
            agent.read(self._remote, (addr, nbytes, dev, cuda), src_addr, src_dev, finished)
        except Exception as e:  # noqa: BLE001  (NIXL raises one type per status)
            self._reading.pop(tag, None)
            error = e if isinstance(e, KVTransferError) else PeerLostError(f"NIXL read: {e}")
            self._send_frame(_TAKEN, [tag, str(error)])
            reactor.call_soon(done, error)

    # -- frames and closing --------------------------------------------------------------

    def _on_frame(self, frame: bytes) -> None:
        if self._closed or not frame:
            return
        kind, rest = frame[0], frame[1:]
        try:
            if kind == _CTRL:
                self.on_ctrl(rest)
                return
            if kind == _AGENT and not self._connecting and self._remote_md is None:
                if len(rest) > MAX_METADATA_BYTES:
                    raise ProtocolError(f"{len(rest)} bytes of agent metadata")
                self._remote_md = bytes(rest)
                return
            if kind in (_READY, _TAKEN):
                try:
                    body = msgpack.unpackb(rest, raw=False)
                except Exception as e:  # noqa: BLE001  (any msgpack failure)
                    raise ProtocolError(f"undecodable frame: {e}") from None
                if kind == _READY and not self._connecting:
                    self._on_ready(body)
                    return
                if kind == _TAKEN and self._connecting:
                    self._on_taken(body)
                    return
            raise ProtocolError(f"unexpected frame kind {kind}")
        except ProtocolError as e:
            logger.warning("kvtransfer: NIXL link to %s: %s; closing it", self.peer, e)
            self._shutdown(PeerLostError(f"connection to {self.peer} failed: {e}"))

    def _on_inner_closed(self, error: BaseException) -> None:
        self._shutdown(error)

    def close(self) -> None:
        self._shutdown(PeerLostError(f"connection to {self.peer} closed locally"))

    def _shutdown(self, error: BaseException) -> None:
        first = not self._closed
        self._closed = True
        if first:
            self._inner.close()
            reactor = self._t.reactor
            for done, regs in self._sends.values():
                if regs is not None:
                    self._t.agent.deregister(regs)
                reactor.call_soon(done, error)
            self._sends.clear()
            for _region, done in self._posted.values():
                reactor.call_soon(done, error)
            self._posted.clear()
            self._ready.clear()
        # reads in flight end (completed, failed, or cancelled before they started moving)
        # before the link lets go of its peer and reports closed: until then a read could
        # still write into the pool
        for finished in list(self._reading.values()):
            self._t.agent.cancel(finished)
        if self._reading:
            if first:
                self._closing_since = time.monotonic()
            elif time.monotonic() - self._closing_since > _TEARDOWN_S and not self._warned:
                self._warned = True
                logger.warning(
                    "kvtransfer: NIXL link to %s: %d read(s) still in flight %.0f s after "
                    "the link closed (a frozen peer?); their transfers settle when they end",
                    self.peer,
                    len(self._reading),
                    _TEARDOWN_S,
                )
            # every ms at first; a peer frozen for long is polled every 50 ms (the agent's own
            # progress polls its reads meanwhile)
            waited = time.monotonic() - self._closing_since
            self._t.reactor.call_later(0.001 if waited < 1.0 else 0.05, self._shutdown, error)
            return
        if self._remote is not None:
            self._t.detach(self._remote)
            self._remote = None
        self._t.links.discard(self)
        if self._started and not self._notified:
            self._notified = True
            self._t.reactor.call_soon(self.on_closed, error)


class NixlTransport(Transport):
    """NIXL data with UCX control, on the UCX transport's reactor (module docstring)."""

    kind = "nixl"
    eager_limit = 0  # every data message is a read: headers always go first

    def __init__(
        self,
        *,
        name: str = "nixl",
        options: dict[str, str] | None = None,
        spin_us: float = 0.0,
        progress_us: int = DEFAULT_PROGRESS_US,
    ):
        nixl_bindings()  # fail before starting threads when NIXL is missing
        self._ucx = UcxTransport(name=name, options=options, spin_us=spin_us)
        self.reactor = self._ucx.reactor
        self.links: set[NixlLink] = set()
        self._attached: dict[str, int] = {}
        self._closed = False
        try:
            self.agent: NixlAgent = self.reactor.run_sync(self._init, name, progress_us)
        except BaseException:
            self._ucx.close()
            raise

    def _init(self, name: str, progress_us: int) -> NixlAgent:
        agent = NixlAgent(f"{name}-{uuid.uuid4().hex[:12]}", progress_us)
        agent.reactor = self.reactor
        self.reactor.add_source(agent)
        return agent

    def register_pool(self, region: Region) -> None:
        addr, dev, cuda = buffer_location(region)
        if not self.agent.covers(addr, region.nbytes, dev, cuda):
            self.agent.register(addr, region.nbytes, dev, cuda)

    def attach(self, metadata: bytes) -> str:
        """Load a peer agent's metadata (reactor thread); counted per link using it."""
        remote = self.agent.load(metadata)
        self._attached[remote] = self._attached.get(remote, 0) + 1
        return remote

    def detach(self, remote: str) -> None:
        left = self._attached.get(remote, 0) - 1
        if left > 0:
            self._attached[remote] = left
            return
        self._attached.pop(remote, None)
        self.agent.forget(remote)

    def listen(
        self,
        host: str,
        port: int,
        on_accept: Callable[[Link], None],
        bind_host: str | None = None,
    ) -> tuple[str, int]:
        def accept(inner: Link) -> None:
            link = NixlLink(self, inner, connecting=False)
            if self._closed:
                link.close()
                return
            self.links.add(link)
            on_accept(link)

        return self._ucx.listen(host, port, accept, bind_host)

    def connect(self, address: ReceiverAddress) -> Link:
        link = NixlLink(self, self._ucx.connect(address), connecting=True)
        self.links.add(link)
        return link

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.reactor.run_teardown(self._teardown, _TEARDOWN_S + 3.0, "NIXL")
        self._ucx.close()

    def _teardown(self) -> None:
        for link in list(self.links):
            link.close()
        deadline = time.monotonic() + _TEARDOWN_S
        while self.agent.outstanding and time.monotonic() < deadline:
            self.agent.progress()
        self.reactor.remove_source(self.agent)
        self.agent.close()
