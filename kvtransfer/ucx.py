"""UCX transport on ucxx's low-level API; the only module of the project that imports ``ucxx``.

One UCX context and worker per transport, owned by the transport's reactor thread, which is
the only thread that ever calls into UCX (so UCX needs no locking). The reactor drives the
worker in blocking-progress mode: it calls ``progress`` while there is work, then arms the
worker and sleeps in ``epoll`` on the worker's event fd.

* Control messages travel as UCX active messages (any size, no pre-posted buffer).
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

import logging
import os
import time
from typing import Any, Callable

# Which UCX_* variables the user set: importing ucxx sets defaults of its own (RNDV_THRESH...).
_USER_UCX_ENV = frozenset(k for k in os.environ if k.startswith("UCX_"))

import numpy as np  # noqa: E402
import ucxx._lib.libucxx as ucx_api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

from kvtransfer.base import DataCallback, Link, Transport  # noqa: E402
from kvtransfer.errors import PeerLostError  # noqa: E402
from kvtransfer.pool import Region  # noqa: E402
from kvtransfer.protocol import ReceiverAddress  # noqa: E402
from kvtransfer.reactor import Reactor  # noqa: E402

logger = logging.getLogger("kvtransfer")

#: UCX settings applied unless overridden (see docs/notes/kvtransfer_bench.md for why).
DEFAULT_OPTIONS: dict[str, str] = {
    # Blocks are >= 8 KiB in practice: send them with rendezvous so the receiver's posted
    # buffer paces the sender (backpressure) and RDMA/NVLink transports move them zero-copy.
    "RNDV_THRESH": "8192",
    # TCP: larger segments cut per-fragment overhead of big coalesced messages.
    "TCP_TX_SEG_SIZE": "256k",
    "TCP_RX_SEG_SIZE": "256k",
    # ucxx sets UCX_MEMTYPE_CACHE, which this UCX no longer knows: do not warn about it.
    "WARN_UNUSED_ENV_VARS": "n",
}

_TEARDOWN_S = 2.0


def _ucx_config(options: dict[str, str] | None) -> dict[str, str]:
    cfg = dict(DEFAULT_OPTIONS)
    cfg.update({k.removeprefix("UCX_"): str(v) for k, v in (options or {}).items()})
    return {k: v for k, v in cfg.items() if f"UCX_{k}" not in _USER_UCX_ENV}


class _Worker:
    """The UCX worker as a reactor progress source, plus request completion tracking."""

    def __init__(self, config: dict[str, str]):
        self.context = ucx_api.UCXContext(config)
        self.worker = ucx_api.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        # (request, callback(error), objects kept alive until completion)
        self._requests: list[tuple[Any, Callable[[Any, BaseException | None], None], Any]] = []
        self._dirty = False

    def track(self, request: Any, callback: Callable[[Any, BaseException | None], None], keep: Any = None) -> None:
        self._requests.append((request, callback, keep))
        self._dirty = True

    def untrack(self, request: Any) -> None:
        """Stop tracking ``request`` (its callback will not run)."""
        self._requests = [e for e in self._requests if e[0] is not request]

    @property
    def outstanding(self) -> int:
        return len(self._requests)

    def progress(self) -> bool:
        made = False
        while self.worker.progress_once():
            made = True
        if (made or self._dirty) and self._requests:
            self._dirty = False
            done, still = [], []
            for entry in self._requests:
                (done if entry[0].completed else still).append(entry)
            self._requests = still
            for request, callback, _keep in done:
                try:
                    request.check_error()
                    error = None
                except Exception as e:  # ucxx raises one exception type per UCX status
                    error = e
                try:
                    callback(request, error)
                except Exception:
                    logger.exception("kvtransfer: UCX completion callback failed")
            made = made or bool(done)
        return made

    def arm(self) -> bool:
        return self.worker.arm()

    def fileno(self) -> int:
        return self.worker.epoll_file_descriptor


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
        self._am_request: Any = None
        if endpoint is not None:
            endpoint.set_close_callback(self._on_endpoint_error)

    @property
    def alive(self) -> bool:
        return not self._closed

    def start(self) -> None:
        self._started = True
        if self._closed:
            self._schedule_notify(self._pending_error or PeerLostError(f"connection to {self.peer} closed"))
            return
        self._post_am_recv()

    # -- control ------------------------------------------------------------------------

    def _post_am_recv(self) -> None:
        if self._closed:
            return
        try:
            request = self._ep.am_recv()
        except Exception as e:
            self._fail(e)
            return
        self._am_request = request
        self._transport.worker.track(request, self._on_am)

    def _on_am(self, request: Any, error: BaseException | None) -> None:
        self._am_request = None
        if error is not None:
            self._fail(error)
            return
        buffer = request.recv_buffer
        payload = b"" if buffer is None else bytes(memoryview(buffer).cast("B"))
        self._post_am_recv()
        if not self._closed:
            self.on_ctrl(payload)

    def send_ctrl(self, payload: bytes) -> None:
        if self._closed:
            return
        data = np.frombuffer(payload, dtype=np.uint8)
        try:
            request = self._ep.am_send(Array(data))
        except Exception as e:
            self._fail(e)
            return
        self._transport.worker.track(request, _ignore_completion, (data, payload))

    # -- data ---------------------------------------------------------------------------

    def send_data(self, tag: int, region: Region, done: DataCallback) -> None:
        self._submit(lambda arr: self._ep.tag_send(arr, ucx_api.UCXXTag(tag)), region.buffer, done, region)

    def recv_data(self, tag: int, region: Region | None, done: DataCallback) -> None:
        if region is None:
            # Discard: a 1-byte receive consumes the whole message (UCX reports truncation).
            scratch = np.zeros(1, dtype=np.uint8)
            self._submit(lambda arr: self._ep.tag_recv(arr, ucx_api.UCXXTag(tag)), scratch,
                         lambda _error: done(None), None)
        else:
            self._submit(lambda arr: self._ep.tag_recv(arr, ucx_api.UCXXTag(tag)), region.buffer, done, region)

    def _submit(self, op: Callable[[Any], Any], buffer: Any, done: DataCallback, keep: Any) -> None:
        reactor = self._transport.reactor
        if self._closed:
            reactor.call_soon(done, PeerLostError(f"connection to {self.peer} is closed"))
            return
        try:
            arr = Array(buffer)
            request = op(arr)
        except Exception as e:
            reactor.call_soon(done, PeerLostError(f"UCX refused the operation: {type(e).__name__}: {e}"))
            return
        self._transport.worker.track(request, lambda _req, error: done(error), (arr, buffer, keep))

    # -- closing ------------------------------------------------------------------------

    def _on_endpoint_error(self) -> None:
        """UCX error callback. It runs inside worker progress, where touching the endpoint
        deadlocks, so only schedule the handling."""
        self._transport.reactor.call_soon(self._after_endpoint_error)

    def _after_endpoint_error(self) -> None:
        reason = "endpoint closed"
        if self._ep is not None:
            try:
                self._ep.raise_on_error()
            except Exception as e:
                reason = f"{type(e).__name__}: {e}"
        self._fail(PeerLostError(f"connection to {self.peer} failed: {reason}"))

    def _fail(self, error: BaseException) -> None:
        if not isinstance(error, PeerLostError):
            error = PeerLostError(f"connection to {self.peer} failed: {type(error).__name__}: {error}")
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
        ep = self._ep
        if ep is None:
            return
        try:
            ep.remove_close_callback()
            # Blocking close (bounded by 10 ms per attempt) also cancels the endpoint's
            # outstanding tag and active-message receives; their callbacks run on the next
            # progress. The non-blocking close leaves active-message receives pending.
            ep.close_blocking(period=10_000_000, max_attempts=1)
        except Exception as e:
            logger.debug("kvtransfer: closing UCX endpoint to %s: %s", self.peer, e)
        if self._am_request is not None:
            # An errored endpoint does not always cancel its active-message receive; nothing
            # arrives on a closed link, so stop waiting for it.
            self._transport.worker.untrack(self._am_request)
            self._am_request = None

    def _schedule_notify(self, error: BaseException) -> None:
        if self._started and not self._notified:
            self._notified = True
            self._transport.reactor.call_soon(self.on_closed, error)
        elif not self._started:
            self._pending_error = error

    def _drop(self) -> None:
        self._ep = None


def _ignore_completion(_request: Any, _error: BaseException | None) -> None:
    pass


class UcxTransport(Transport):
    """UCX connections driven by a reactor thread of its own (see the module docstring)."""

    kind = "ucx"

    def __init__(self, *, name: str = "ucx", options: dict[str, str] | None = None, spin_us: float = 0.0):
        self.config = _ucx_config(options)
        self.reactor = Reactor(name, spin_s=spin_us * 1e-6)
        self.reactor.start()
        self._listener: Any = None
        self._on_accept: Callable[[Link], None] | None = None
        self._links: set[UcxLink] = set()
        self._closed = False
        try:
            self.worker: _Worker = self.reactor.run_sync(self._init)
        except BaseException:
            self.reactor.stop()
            raise

    def _init(self) -> _Worker:
        worker = _Worker(self.config)
        self.reactor.add_source(worker)
        return worker

    def listen(self, host: str, port: int, on_accept: Callable[[Link], None]) -> tuple[str, int]:
        """Listen on ``port`` on all interfaces (UCX binds the wildcard address); ``host`` is
        what senders are told to connect to."""
        if self._listener is not None:
            raise RuntimeError("this transport already listens")
        self._on_accept = on_accept
        self._listener = ucx_api.UCXListener.create(self.worker.worker, port, self._on_connection,
                                                    deliver_endpoint=True)
        return host, self._listener.port

    def _on_connection(self, endpoint: Any) -> None:
        """UCX listener callback (runs inside worker progress)."""
        link = UcxLink(self, endpoint, "sender")
        if self._closed or self._on_accept is None:
            link.close()
            return
        self._links.add(link)
        self.reactor.call_soon(self._on_accept, link)

    def connect(self, address: ReceiverAddress) -> Link:
        try:
            endpoint = ucx_api.UCXEndpoint.create(self.worker.worker, address.host, address.port, True)
        except Exception as e:
            link = UcxLink(self, None, f"receiver {address}")
            link._pending_error = PeerLostError(f"cannot connect to {address}: {type(e).__name__}: {e}")
            return link
        link = UcxLink(self, endpoint, f"receiver {address}")
        self._links.add(link)
        return link

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.reactor.running:
            try:
                self.reactor.run_sync(self._teardown, timeout=_TEARDOWN_S + 3.0)
            except (TimeoutError, RuntimeError) as e:
                logger.warning("kvtransfer: UCX teardown: %s", e)
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
        if os.environ.get("KVX_DEBUG"):
            print("outstanding", [(type(r).__name__, cb) for r, cb, k in self.worker._requests])
        if self.worker.outstanding:
            self.worker.worker.cancel_inflight_requests(period=10**8, max_attempts=5)
            end = time.monotonic() + 0.5
            while self.worker.outstanding and time.monotonic() < end:
                self.worker.progress()
        for link in self._links:
            link._drop()
        self._links.clear()
        self.reactor.remove_source(self.worker)
        # Release the UCX objects here, on the thread that used them.
        self.worker._requests = []
        self.worker.worker = None
        self.worker.context = None
