"""NIXL transport: control over a UCX link, block data pulled with one-sided NIXL READs.

The only module of the project that imports NIXL (``nixl_cu12``, the data plane vLLM's and
Dynamo's disaggregation use, itself built on UCX). NIXL moves bytes from the sender's pool to
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
late, unlike a push design; a receiver frozen past the sender's deadline and settle time could
still read source blocks the sender has since reused, which the per-block checksums catch
(keep them on).

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

import contextlib
import itertools
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack

from kvtransfer.base import DataCallback, Link, Transport
from kvtransfer.errors import KVTransferError, PeerLostError, ProtocolError
from kvtransfer.pool import Region
from kvtransfer.protocol import ReceiverAddress
from kvtransfer.ucx import USER_UCX_ENV, UcxTransport

logger = logging.getLogger("kvtransfer")

_CTRL, _AGENT, _READY, _TAKEN = 0, 1, 2, 3
#: READY announcements a link holds for receives not yet posted; more is a misbehaving peer.
MAX_UNCLAIMED = 4096
#: How long the reactor busy-polls a read before it sleeps between polls (1 ms ticks).
_SPIN_S = 0.005
_TEARDOWN_S = 2.0
DEFAULT_PROGRESS_US = 1000


def _nixl() -> Any:
    """NIXL's bindings (imported on first use; raises ImportError with the install hint)."""
    try:
        from nixl_cu12 import _bindings  # type: ignore[attr-defined]
    except ImportError as e:
        raise ImportError(
            "the 'nixl' KV transport needs NIXL: pip install 'pdserve[nixl]' (nixl-cu12)"
        ) from e
    return _bindings


@contextlib.contextmanager
def _user_ucx_environment() -> Iterator[None]:
    """The environment as the user set it, while NIXL's UCX reads its configuration: importing
    ucxx (the control link) sets UCX_* defaults of its own, and its UCX_RNDV_THRESH=8192 sends
    NIXL's reads through a rendezvous over TCP (9.4 ms for 8 MiB instead of 0.23 ms by CMA)."""
    injected = {
        k: os.environ.pop(k)
        for k in list(os.environ)
        if k.startswith("UCX_") and k not in USER_UCX_ENV
    }
    try:
        yield
    finally:
        os.environ.update(injected)


def _buffer_location(region: Region) -> tuple[int, int, bool]:
    """(address, device id, is_cuda) of a region's buffer."""
    buf = region.buffer
    if region.is_cuda:
        return int(buf.data_ptr()), int(buf.device.index or 0), True
    return int(buf.__array_interface__["data"][0]), 0, False


@dataclass
class _Read:
    handle: Any
    callback: Callable[[BaseException | None], None]
    started: float


class NixlAgent:
    """One NIXL agent with the UCX backend (reactor thread only, apart from NIXL's own
    progress thread). Tracks the reads it started as a reactor progress source."""

    def __init__(self, name: str, progress_us: int):
        nb = _nixl()
        self._nb = nb
        config = nb.nixlAgentConfig()
        config.useProgThread = progress_us > 0
        config.useListenThread = False
        config.syncMode = nb.NIXL_THREAD_SYNC_NONE
        config.pthrDelay = max(0, progress_us)
        config.captureTelemetry = False
        self.name = name
        with _user_ucx_environment():
            self.agent = nb.nixlAgent(name, config)
            self.agent.createBackend("UCX", {})
        self._ranges: list[tuple[int, int, bool, int, Any]] = []  # lo, hi, cuda, dev, reg list
        self._reads: dict[int, _Read] = {}
        self._keys = itertools.count()
        self._wake_at = 0.0
        self.reactor: Any = None

    # -- memory ------------------------------------------------------------------------

    def _seg(self, cuda: bool) -> Any:
        return self._nb.VRAM_SEG if cuda else self._nb.DRAM_SEG

    def register(self, addr: int, nbytes: int, dev: int, cuda: bool) -> Any:
        regs = self._nb.nixlRegDList(self._seg(cuda), [(addr, nbytes, dev, "")])
        self.agent.registerMem(regs, [])
        self._ranges.append((addr, addr + nbytes, cuda, dev, regs))
        return regs

    def deregister(self, regs: Any) -> None:
        self._ranges = [r for r in self._ranges if r[4] is not regs]
        try:
            self.agent.deregisterMem(regs, [])
        except Exception as e:  # noqa: BLE001  (NIXL raises one type per status)
            logger.debug("kvtransfer: NIXL deregistration failed: %s", e)

    def covers(self, addr: int, nbytes: int, dev: int, cuda: bool) -> bool:
        return any(
            lo <= addr and addr + nbytes <= hi and c == cuda and d == dev
            for lo, hi, c, d, _ in self._ranges
        )

    def metadata(self, regs: Any = None) -> bytes:
        """Full metadata (connection info and every registration), or the partial metadata
        of ``regs`` alone."""
        if regs is None:
            return bytes(self.agent.getLocalMD())
        return bytes(self.agent.getLocalPartialMD(regs, False, []))

    def load(self, metadata: bytes) -> str:
        name = self.agent.loadRemoteMD(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def forget(self, remote: str) -> None:
        try:
            self.agent.invalidateRemoteMD(remote)
        except Exception as e:  # noqa: BLE001  (NIXL raises one type per status)
            logger.debug("kvtransfer: NIXL invalidate %s: %s", remote, e)

    # -- reads (a reactor progress source) ------------------------------------------------

    def read(
        self,
        remote: str,
        dst: tuple[int, int, int, bool],
        src_addr: int,
        src_dev: int,
        callback: Callable[[BaseException | None], None],
    ) -> None:
        """READ ``dst[1]`` bytes at ``src_addr`` of ``remote`` into ``dst`` (addr, nbytes, dev,
        cuda); ``callback(error)`` runs on the reactor once no byte of it can land any more."""
        nb = self._nb
        addr, nbytes, dev, cuda = dst
        local = nb.nixlXferDList(self._seg(cuda), [(addr, nbytes, dev)])
        remote_l = nb.nixlXferDList(self._seg(cuda), [(src_addr, nbytes, src_dev)])
        handle = self.agent.createXferReq(nb.NIXL_READ, local, remote_l, remote, b"", [])
        try:
            status = self.agent.postXferReq(handle, b"")
        except BaseException:
            self._release(handle)
            raise
        if status == nb.NIXL_SUCCESS:
            self._release(handle)
            self.reactor.call_soon(callback, None)
            return
        self._reads[next(self._keys)] = _Read(handle, callback, time.monotonic())

    def _release(self, handle: Any) -> bool:
        """Release a request (cancelling it if in flight); False if NIXL could not."""
        try:
            self.agent.releaseXferReq(handle)
            return True
        except Exception as e:  # noqa: BLE001  (NIXL raises one type per status)
            logger.debug("kvtransfer: NIXL release: %s", e)
            return False

    @property
    def outstanding(self) -> int:
        return len(self._reads)

    def progress(self) -> bool:
        if not self._reads:
            return False
        nb = self._nb
        finished: list[tuple[_Read, BaseException | None]] = []
        for key, r in list(self._reads.items()):
            try:
                status = self.agent.getXferStatus(r.handle)
                if status == nb.NIXL_IN_PROG:
                    continue
                error: BaseException | None = None
                if status != nb.NIXL_SUCCESS:
                    error = PeerLostError(f"NIXL read failed: {status}")
            except Exception as e:  # noqa: BLE001  (NIXL raises one type per status)
                error = PeerLostError(f"NIXL read failed: {type(e).__name__}: {e}")
            if not self._release(r.handle):
                continue  # still active: poll again
            del self._reads[key]
            finished.append((r, error))
        for r, error in finished:
            try:
                r.callback(error)
            except Exception:
                logger.exception("kvtransfer: NIXL read callback failed")
        return bool(finished)

    def cancel(self, callback: Callable[[BaseException | None], None]) -> bool:
        """Cancel the in-flight read completing with ``callback``; True once it can no longer
        write (its callback then runs with a cancellation error), False if NIXL refused."""
        for key, r in self._reads.items():
            if r.callback is callback:
                if not self._release(r.handle):
                    return False
                del self._reads[key]
                self.reactor.call_soon(callback, PeerLostError("read cancelled"))
                return True
        return True

    def arm(self) -> bool:
        if not self._reads:
            return True
        oldest = min(r.started for r in self._reads.values())
        if time.monotonic() - oldest < _SPIN_S:
            return False  # a short read: poll again at once
        now = time.monotonic()
        if self._wake_at <= now:  # no wake-up pending: poll again in 1 ms
            self._wake_at = now + 0.001
            self.reactor.call_later(0.001, _noop)
        return True

    def fileno(self) -> int:
        return -1  # polled, no event fd

    def close(self) -> None:
        for r in self._reads.values():
            self._release(r.handle)
        self._reads.clear()
        for *_, regs in list(self._ranges):
            self.deregister(regs)
        self.agent = None


def _noop() -> None:
    pass


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
        addr, dev, cuda = _buffer_location(region)
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
        _, src_addr, nbytes, src_dev, md = ready
        if region is None:  # discard: nothing is read
            self._send_frame(_TAKEN, [tag, None])
            done(None)
            return
        if nbytes != region.nbytes:
            reason = f"{nbytes} bytes announced for a {region.nbytes}-byte receive"
            self._send_frame(_TAKEN, [tag, reason])
            done(ProtocolError(f"data tag {tag:#x}: {reason}"))
            return
        agent = self._t.agent
        try:
            if self._remote is None:
                if self._remote_md is None:
                    raise ProtocolError("data announced before the peer's NIXL metadata")
                self._remote = self._t.attach(self._remote_md)
            if md is not None:
                agent.load(md)
            addr, dev, cuda = _buffer_location(region)

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
            done(error)

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
        # reads in flight end (cancelled) before the link reports closed
        for finished in list(self._reading.values()):
            self._t.agent.cancel(finished)
        if self._reading:
            self._t.reactor.call_later(0.001, self._shutdown, error)
            return
        if self._started and not self._notified:
            self._notified = True
            if self._remote is not None:
                self._t.detach(self._remote)
                self._remote = None
            self._t.links.discard(self)
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
        _nixl()  # fail before starting threads when NIXL is missing
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
        addr, dev, cuda = _buffer_location(region)
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
        if self.reactor.running:
            try:
                self.reactor.run_sync(self._teardown, timeout=_TEARDOWN_S + 3.0)
            except (TimeoutError, RuntimeError) as e:
                logger.warning("kvtransfer: NIXL teardown: %s", e)
        self._ucx.close()

    def _teardown(self) -> None:
        for link in list(self.links):
            link.close()
        deadline = time.monotonic() + _TEARDOWN_S
        while self.agent.outstanding and time.monotonic() < deadline:
            self.agent.progress()
        self.reactor.remove_source(self.agent)
        self.agent.close()
