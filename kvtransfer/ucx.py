"""UCX transport on ucxx's low-level API; the only module of the project that imports ``ucxx``.

One UCX context and worker per transport, owned by the transport's reactor thread, which is
the only thread that ever calls into UCX (so UCX needs no locking). The reactor drives the
worker in blocking-progress mode: it calls ``progress`` while there is work, then arms the
worker and sleeps in ``epoll`` on the worker's event fd.

* Control messages travel as length-prefixed frames on the endpoint's UCX stream.
* Block data travels as tagged messages sent from and received into the pools' memory
  (host or CUDA: any ``__array_interface__`` / ``__cuda_array_interface__`` buffer). Above
  ``RNDV_THRESH`` UCX uses its rendezvous protocol, so the data moves only once the receiver
  has posted the matching receive, and with RDMA / NVLink transports it moves zero-copy.
* Endpoints use UCX's peer error handling: a peer that dies fails the endpoint, which cancels
  its outstanding requests and reports through ``Link.on_closed``. (In UCX 1.21 this limits
  same-host traffic to TCP: shared-memory transports do not support peer failure detection.)

UCX settings: :data:`DEFAULT_OPTIONS`, overridden by ``options``, overridden by any
``UCX_*`` environment variable the user set before this module was imported.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import socket
import struct
import time
from collections.abc import Callable
from typing import Any, cast

# Which UCX_* variables the user set: importing ucxx sets defaults of its own (RNDV_THRESH...).
USER_UCX_ENV = frozenset(k for k in os.environ if k.startswith("UCX_"))

import numpy as np
import ucxx._lib.libucxx as ucx_api
from ucxx._lib.arr import Array

from kvtransfer.base import DataCallback, Link, Transport
from kvtransfer.errors import PeerLostError
from kvtransfer.pool import Region
from kvtransfer.protocol import MAX_CTRL_BYTES, ReceiverAddress
from kvtransfer.reactor import Reactor

logger = logging.getLogger("kvtransfer")

#: UCX settings applied unless overridden (see docs/notes/kvtransfer_bench.md for why).
DEFAULT_OPTIONS: dict[str, str] = {
    # Messages above 64 KiB go by rendezvous: the receiver's posted buffer paces the sender
    # (backpressure) and RDMA/NVLink transports move them zero-copy. Smaller ones (one block of
    # a tiny model) go eagerly and arrive with their header: one network hop less.
    "RNDV_THRESH": "65536",
    # TCP: larger segments cut per-fragment overhead of big coalesced messages.
    "TCP_TX_SEG_SIZE": "256k",
    "TCP_RX_SEG_SIZE": "256k",
    # A restarted receiver must be able to listen on its old port at once (SO_REUSEADDR).
    "TCP_CM_REUSEADDR": "y",
    # ucxx sets UCX_MEMTYPE_CACHE, which this UCX no longer knows: do not warn about it.
    "WARN_UNUSED_ENV_VARS": "n",
}

_TEARDOWN_S = 2.0
_FRAME_HEADER = struct.Struct("<II")  # magic, payload length
_FRAME_MAGIC = 0x3154564B  # b"KVT1"


def _parse_size(text: str) -> int:
    """UCX size syntax ("65536", "64k", "1m", "inf"); unknown forms (per-lane lists) give 0."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("b")
    if t in ("inf", "infinity"):
        return 1 << 62
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        return 0


def _ucx_config(options: dict[str, str] | None) -> dict[str, str]:
    cfg = dict(DEFAULT_OPTIONS)
    cfg.update({k.removeprefix("UCX_"): str(v) for k, v in (options or {}).items()})
    return {k: v for k, v in cfg.items() if f"UCX_{k}" not in USER_UCX_ENV}


_WILDCARDS = frozenset({"", "0.0.0.0", "::", "*"})
_EP_ATTR_LOCAL_SOCKADDR = 1 << 1  # UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR
_EP_ATTR_SOCKADDR_OFFSET = 8 + 32  # ucp_ep_attr_t: field_mask, name[UCP_ENTITY_NAME_MAX]
_ucp: Any = None


def _bind_addresses(host: str) -> frozenset[str] | None:
    """The local addresses a listener given ``host`` may accept connections on (None: any)."""
    if host.strip("[]") in _WILDCARDS:
        return None
    try:
        return frozenset({str(ipaddress.ip_address(host.strip("[]")))})
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError as e:
        raise OSError(f"UCX listener: cannot resolve --host {host!r}: {e}") from e
    return frozenset(str(ipaddress.ip_address(i[4][0])) for i in infos)


def _local_address(endpoint: Any) -> str | None:
    """The local IP a connection from the listener arrived on (``ucp_ep_query``); ucxx does
    not expose it, so libucp is called directly. None if UCX cannot tell."""
    global _ucp
    if _ucp is None:
        _ucp = ctypes.CDLL("libucp.so.0")  # already loaded by ucxx: the same library
        _ucp.ucp_ep_query.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        _ucp.ucp_ep_query.restype = ctypes.c_int
    attr = ctypes.create_string_buffer(4096)  # larger than any ucp_ep_attr_t
    struct.pack_into("<Q", attr, 0, _EP_ATTR_LOCAL_SOCKADDR)
    if _ucp.ucp_ep_query(endpoint.handle, attr) != 0:
        return None
    off = _EP_ATTR_SOCKADDR_OFFSET
    (family,) = struct.unpack_from("<H", attr, off)
    if family == socket.AF_INET:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.IPv4Address(
            attr.raw[off + 4 : off + 8]
        )
    elif family == socket.AF_INET6:
        ip = ipaddress.IPv6Address(attr.raw[off + 8 : off + 24])
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
    else:
        return None
    return str(ip)


# (ucxx request, callback(request, error), objects kept alive until completion)
_Tracked = tuple[Any, Callable[[Any, BaseException | None], None], Any]


class _Worker:
    """The UCX worker as a reactor progress source, plus request completion tracking."""

    def __init__(self, config: dict[str, str]):
        self.context = ucx_api.UCXContext(config)
        self.worker = ucx_api.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        # (request, callback(error), objects kept alive until completion)
        self._requests: list[_Tracked] = []
        self._dirty = False

    def track(
        self, request: Any, callback: Callable[[Any, BaseException | None], None], keep: Any = None
    ) -> None:
        self._requests.append((request, callback, keep))
        self._dirty = True

    @property
    def outstanding(self) -> int:
        return len(self._requests)

    def progress(self) -> bool:
        made = False
        while self.worker.progress_once():
            made = True
        if (made or self._dirty) and self._requests:
            self._dirty = False
            done: list[_Tracked] = []
            still: list[_Tracked] = []
            for entry in self._requests:
                (done if entry[0].completed else still).append(entry)
            self._requests = still
            for request, callback, _keep in done:
                try:
                    request.check_error()
                    error = None
                except Exception as e:  # noqa: BLE001  (ucxx raises one type per UCX status)
                    error = e
                try:
                    callback(request, error)
                except Exception:
                    logger.exception("kvtransfer: UCX completion callback failed")
            made = made or bool(done)
        return made

    def arm(self) -> bool:
        return cast(bool, self.worker.arm())

    def fileno(self) -> int:
        return cast(int, self.worker.epoll_file_descriptor)


class UcxLink(Link):
    """A UCX endpoint with error handling; see :class:`kvtransfer.base.Link`."""

    def __init__(self, transport: UcxTransport, endpoint: Any, peer: str):
        self._transport = transport
        self._ep = endpoint
        self.peer = peer
        self._closed = endpoint is None
        self._notified = False
        self._started = False
        self._pending_error: BaseException | None = None
        if endpoint is not None:
            endpoint.set_close_callback(self._on_endpoint_error)

    @property
    def alive(self) -> bool:
        return not self._closed

    def start(self) -> None:
        self._started = True
        if self._closed:
            self._schedule_notify(
                self._pending_error or PeerLostError(f"connection to {self.peer} closed")
            )
            return
        self._post_header_recv()

    # -- control ------------------------------------------------------------------------
    # Control messages are frames on the endpoint's UCX stream: an 8-byte header (magic,
    # payload length) then the msgpack payload. The stream belongs to this endpoint alone, so
    # no state outlives it (ucxx 0.52 keys active-message receives by endpoint handle, and a
    # stale receive of a closed endpoint can swallow the messages of a new endpoint that reuses
    # the handle value). A frame with a bad header desynchronises the stream: the link closes.

    def _post_header_recv(self) -> None:
        if self._closed:
            return
        header = np.zeros(_FRAME_HEADER.size, dtype=np.uint8)
        self._stream_recv(header, lambda error: self._on_header(header, error))

    def _stream_recv(
        self, buffer: np.ndarray, done: Callable[[BaseException | None], None]
    ) -> None:
        if self._closed:
            return
        try:
            arr = Array(buffer)
            request = self._ep.stream_recv(arr)
        except Exception as e:  # noqa: BLE001  (any UCX failure ends this link)
            self._fail(e)
            return
        self._transport.worker.track(request, lambda _req, error: done(error), (arr, buffer))

    def _on_header(self, header: np.ndarray, error: BaseException | None) -> None:
        if error is not None:
            self._fail(error)
            return
        magic, length = _FRAME_HEADER.unpack(header.tobytes())
        if magic != _FRAME_MAGIC or not 0 < length <= min(MAX_CTRL_BYTES, self.max_ctrl_bytes):
            self._fail(
                PeerLostError(
                    f"bad control frame header from {self.peer} "
                    f"(magic {magic:#x}, length {length}): closing the connection"
                )
            )
            return
        body = np.empty(length, dtype=np.uint8)
        self._stream_recv(body, lambda err: self._on_body(body, err))

    def _on_body(self, body: np.ndarray, error: BaseException | None) -> None:
        if error is not None:
            self._fail(error)
            return
        self._post_header_recv()
        if not self._closed:
            self.on_ctrl(body.tobytes())

    def send_ctrl(self, payload: bytes) -> None:
        if self._closed:
            return
        frame = np.frombuffer(
            _FRAME_HEADER.pack(_FRAME_MAGIC, len(payload)) + payload, dtype=np.uint8
        )
        try:
            arr = Array(frame)
            request = self._ep.stream_send(arr)
        except Exception as e:  # noqa: BLE001  (any UCX failure ends this link)
            self._fail(e)
            return
        self._transport.worker.track(request, _ignore_completion, (arr, frame))

    # -- data ---------------------------------------------------------------------------

    def send_data(self, tag: int, region: Region, done: DataCallback) -> None:
        self._submit(
            lambda arr: self._ep.tag_send(arr, ucx_api.UCXXTag(tag)), region.buffer, done, region
        )

    def recv_data(self, tag: int, region: Region | None, done: DataCallback) -> None:
        if region is None:
            # Discard: a 1-byte receive consumes the whole message (UCX reports truncation).
            scratch = np.zeros(1, dtype=np.uint8)
            self._submit(
                lambda arr: self._ep.tag_recv(arr, ucx_api.UCXXTag(tag)),
                scratch,
                lambda _error: done(None),
                None,
            )
        else:
            self._submit(
                lambda arr: self._ep.tag_recv(arr, ucx_api.UCXXTag(tag)),
                region.buffer,
                done,
                region,
            )

    def _submit(self, op: Callable[[Any], Any], buffer: Any, done: DataCallback, keep: Any) -> None:
        reactor = self._transport.reactor
        if self._closed:
            reactor.call_soon(done, PeerLostError(f"connection to {self.peer} is closed"))
            return
        try:
            arr = Array(buffer)
            request = op(arr)
        except Exception as e:  # noqa: BLE001  (any UCX failure ends this link)
            reactor.call_soon(
                done, PeerLostError(f"UCX refused the operation: {type(e).__name__}: {e}")
            )
            return
        self._transport.worker.track(request, lambda _req, error: done(error), (arr, buffer, keep))

    # -- closing ------------------------------------------------------------------------

    def _on_endpoint_error(self) -> None:
        """UCX error callback. It runs inside worker progress, where touching the endpoint
        deadlocks, so only schedule the handling."""
        self._transport.reactor.call_soon(self._after_endpoint_error)

    def _after_endpoint_error(self) -> None:
        self._fail(
            PeerLostError(f"connection to {self.peer} failed: {self._endpoint_error() or 'closed'}")
        )

    def _endpoint_error(self) -> str | None:
        """The endpoint's own error (e.g. connection refused / reset), if it has one."""
        if self._ep is None:
            return None
        try:
            self._ep.raise_on_error()
        except Exception as e:  # noqa: BLE001  (ucxx raises one type per UCX status)
            return f"{type(e).__name__}: {e}"
        return None

    def _fail(self, error: BaseException) -> None:
        if not isinstance(error, PeerLostError):
            # A failed request usually just reflects the endpoint's failure: report the latter.
            reason = self._endpoint_error() or f"{type(error).__name__}: {error}"
            error = PeerLostError(f"connection to {self.peer} failed: {reason}")
        if not self._closed:
            self._closed = True
            self._close_endpoint()
        self._schedule_notify(error)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_endpoint()
        self._schedule_notify(PeerLostError(f"connection to {self.peer} closed locally"))

    def _close_endpoint(self) -> None:
        ep, self._ep = self._ep, None
        self._transport._links.discard(self)
        if ep is None:
            return
        try:
            ep.remove_close_callback()
            # Blocking close (bounded by 10 ms per attempt) also cancels the endpoint's
            # outstanding requests; their callbacks run on the next progress. The endpoint
            # object is released here, on the reactor thread.
            ep.close_blocking(period=10_000_000, max_attempts=1)
        except Exception as e:  # noqa: BLE001  (any UCX failure ends this link)
            logger.debug("kvtransfer: closing UCX endpoint to %s: %s", self.peer, e)
        worker = self._transport.worker
        try:
            # When the endpoint failed first (a peer that died), ucxx's error handler moved its
            # outstanding requests to the worker's to-cancel list, which only the worker's own
            # progress thread drains (not used here) and close_blocking no longer sees: cancel
            # them now, or a receive posted for the dead peer never completes and its transfer
            # never settles.
            worker.worker.cancel_inflight_requests(period=0, max_attempts=1)
        except Exception as e:  # noqa: BLE001  (any UCX failure ends this link)
            logger.debug("kvtransfer: cancelling requests of %s: %s", self.peer, e)
        # Cancelled requests complete inside the calls above, not in a later progress: make
        # the next progress pass look for completions even if UCX reports no progress.
        worker._dirty = True

    def _schedule_notify(self, error: BaseException) -> None:
        if self._started and not self._notified:
            self._notified = True
            self._transport.reactor.call_soon(self.on_closed, error)
        elif not self._started:
            self._pending_error = error


def _ignore_completion(_request: Any, _error: BaseException | None) -> None:
    pass


class UcxTransport(Transport):
    """UCX connections driven by a reactor thread of its own (see the module docstring)."""

    kind = "ucx"

    def __init__(
        self, *, name: str = "ucx", options: dict[str, str] | None = None, spin_us: float = 0.0
    ):
        self.config = _ucx_config(options)
        self.eager_limit = _parse_size(
            self.config.get("RNDV_THRESH") or os.environ.get("UCX_RNDV_THRESH", "8192")
        )
        self.reactor = Reactor(name, spin_s=spin_us * 1e-6)
        self.reactor.start()
        self._listener: Any = None
        self._on_accept: Callable[[Link], None] | None = None
        self._links: set[UcxLink] = set()
        self._closed = False
        self._bind: frozenset[str] | None = None
        self.refused_off_host = 0  # connections that arrived on an address not bound
        try:
            self.worker: _Worker = self.reactor.run_sync(self._init)
        except BaseException:
            self.reactor.stop()
            raise

    def _init(self) -> _Worker:
        worker = _Worker(self.config)
        self.reactor.add_source(worker)
        return worker

    def listen(
        self,
        host: str,
        port: int,
        on_accept: Callable[[Link], None],
        bind_host: str | None = None,
    ) -> tuple[str, int]:
        """Listen on ``port``; ``host`` is what senders are told to connect to, ``bind_host``
        (default ``host``) the address connections must arrive on. ucxx 0.52 can only listen
        on the wildcard address, so a connection that arrives on any other local address is
        closed at accept, before anything is read from it; a wildcard ``bind_host`` accepts
        all."""
        if self._listener is not None:
            raise RuntimeError("this transport already listens")
        self._bind = _bind_addresses(host if bind_host is None else bind_host)
        self._on_accept = on_accept
        try:
            self._listener = ucx_api.UCXListener.create(
                self.worker.worker, port, self._on_connection, deliver_endpoint=True
            )
        except Exception as e:  # ucxx reports bind failures with its own exception types
            raise OSError(f"UCX cannot listen on port {port}: {type(e).__name__}: {e}") from e
        return host, self._listener.port

    def _on_connection(self, endpoint: Any) -> None:
        """UCX listener callback (runs inside worker progress)."""
        link = UcxLink(self, endpoint, "sender")
        if self._closed or self._on_accept is None:
            link.close()
            return
        if self._bind is not None:
            local = _local_address(endpoint)
            if local is None or local not in self._bind:
                self.refused_off_host += 1
                logger.warning(
                    "kvtransfer: closed a UCX connection that arrived on %s (bound to %s)",
                    local or "an unknown address",
                    ", ".join(sorted(self._bind)),
                )
                link.close()
                return
        self._links.add(link)
        self.reactor.call_soon(self._on_accept, link)

    def connect(self, address: ReceiverAddress) -> Link:
        try:
            endpoint = ucx_api.UCXEndpoint.create(
                self.worker.worker, address.host, address.port, True
            )
        except Exception as e:  # noqa: BLE001  (any UCX failure ends this link)
            link = UcxLink(self, None, f"receiver {address}")
            link._pending_error = PeerLostError(
                f"cannot connect to {address}: {type(e).__name__}: {e}"
            )
            return link
        link = UcxLink(self, endpoint, f"receiver {address}")
        self._links.add(link)
        return link

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.reactor.run_teardown(self._teardown, _TEARDOWN_S + 3.0, "UCX")
        self.reactor.stop()

    def _teardown(self) -> None:
        """Close endpoints, complete every request (callbacks run), then release UCX objects
        on this thread."""
        self._listener = None
        for link in list(self._links):
            link.close()
        deadline = time.monotonic() + _TEARDOWN_S
        while self.worker.outstanding and time.monotonic() < deadline:
            self.worker.progress()
        if self.worker.outstanding:
            self.worker.worker.cancel_inflight_requests(period=10**8, max_attempts=5)
            self.worker._dirty = True  # completed inside the call: look for them
            end = time.monotonic() + 0.5
            while self.worker.outstanding and time.monotonic() < end:
                self.worker.progress()
        self._links.clear()
        self.reactor.remove_source(self.worker)
        # Release the UCX objects here, on the thread that used them.
        self.worker._requests = []
        self.worker.worker = None
        self.worker.context = None
