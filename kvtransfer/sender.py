"""Prefill side of the KV transfer protocol, written once against the transport SPI.

The engine thread calls :meth:`Sender.open` and the handle's ``send_blocks``/``finish``; all of
them validate, enqueue work for the reactor thread and return. On the reactor thread:

* one :class:`Connection` per receiver instance (host, port, receiver id), reused across
  transfers, opened with a ``hello`` handshake that the receiver accepts or refuses (geometry,
  checksum setting) and that proves the instance: an address naming an instance that no
  longer listens there fails only its own transfers (:class:`StaleAddressError`), and a
  connection to an instance that restarted is closed once the new one is proven;
* per receiver, at most ``max_active_transfers`` transfers run at once, the others wait in
  FIFO order (their deadline keeps running), and at most ``max_inflight_messages`` data
  messages are outstanding; a rendezvous-sized data send completes only once the receiver has
  posted the matching receive, so a slow receiver holds back its own transfers (backpressure)
  and no one else's: a frozen decode worker cannot take the slots of the healthy ones;
* queued positions are coalesced into runs adjacent in both the source and destination pools,
  each run sent as one ``data`` header plus one tagged data message straight from the pool;
* a transfer is DONE when all its sends completed and the receiver acknowledged with
  ``done``; FAILED/CANCELLED once its outstanding sends have settled (no further reads of
  the source blocks).
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import uuid
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from typing import Any

from kvtransfer.auth import TagCipher, hello_ok_proof, hello_proof, new_nonce, proof_ok
from kvtransfer.base import FaultInjector, KVSender, Link, TransferState, Transport
from kvtransfer.checksums import Checksummer
from kvtransfer.errors import (
    ChecksumMismatchError,
    GeometryMismatchError,
    HandshakeError,
    KVTransferError,
    PeerCancelledError,
    PeerLostError,
    ProtocolError,
    StaleAddressError,
    TransferCancelledError,
    TransferRejectedError,
    TransferTimeoutError,
    TransportClosedError,
)
from kvtransfer.geometry import KVGeometry
from kvtransfer.handles import SendHandle, as_int_list
from kvtransfer.lifecycle import TransferEnd
from kvtransfer.metrics import TransferCounters, TransferMetrics
from kvtransfer.outbound import CONNECTING, DEAD, READY, Connection, OutboundTransfer, take_run
from kvtransfer.pool import PoolView
from kvtransfer.protocol import (
    MAX_BLOCKS_PER_TRANSFER,
    PROTOCOL_VERSION,
    Cancel,
    Challenge,
    Data,
    Done,
    Error,
    Fail,
    Fin,
    Hello,
    HelloOk,
    Op,
    Open,
    ReceiverAddress,
    Refuse,
    Sums,
    data_tag,
    decode_ops,
    encode_ops,
)

logger = logging.getLogger("kvtransfer")


class Sender(TransferEnd, KVSender):
    """Pushes blocks of ``pool`` to receivers over ``transport``; see the module docstring.

    Options: ``checksums`` (send xxh3_64 per block, default on), ``max_active_transfers``,
    ``max_inflight_messages``, ``max_message_bytes`` (coalescing cap, at least one block),
    ``connect_timeout_s`` (handshake), ``settle_timeout_s`` (how long a failed transfer waits
    for its outstanding sends before the connection is closed to force them),
    ``checksum_threads`` / ``inline_checksum_bytes`` (runs larger than this are hashed on
    those threads, overlapping the transfer), ``metrics``,
    ``fault_injector`` (tests only).
    """

    def __init__(
        self,
        transport: Transport,
        pool: Any,
        geometry: KVGeometry,
        *,
        checksums: bool = True,
        max_active_transfers: int = 64,
        max_inflight_messages: int = 64,
        max_message_bytes: int = 64 << 20,
        connect_timeout_s: float = 5.0,
        settle_timeout_s: float = 5.0,
        checksum_threads: int = 1,
        inline_checksum_bytes: int = 1 << 20,
        metrics: TransferMetrics | None = None,
        fault_injector: FaultInjector | None = None,
        secret: bytes | None = None,
    ):
        if max_active_transfers < 1 or max_inflight_messages < 1:
            raise ValueError("max_active_transfers and max_inflight_messages must be >= 1")
        self.geometry = geometry
        self._pool = PoolView(pool, geometry)
        self._transport = transport
        self._reactor = transport.reactor
        self._checksums = checksums
        self._max_active = max_active_transfers
        self._max_inflight = max_inflight_messages
        self._max_blocks_per_msg = max(1, max_message_bytes // geometry.block_bytes)
        self._connect_timeout_s = connect_timeout_s
        self._settle_timeout_s = settle_timeout_s
        self._direction = "send"
        self._metrics = metrics if metrics is not None else TransferMetrics()
        self._faults = fault_injector
        self._secret = secret
        self.sender_id = uuid.uuid4().hex[:16]
        # Shared with caller threads (guarded by _lock): ids of transfers not yet terminal.
        self._lock = threading.Lock()
        self._ids: set[str] = set()
        self._closed = False
        self._drained = threading.Event()
        # Reactor-thread state.
        # By the full address: a connection whose handshake is under way for one instance of a
        # receiver never stands in for another instance at the same host and port.
        self._conns: dict[ReceiverAddress, Connection] = {}
        self._live: set[OutboundTransfer] = set()  # started and not yet settled
        # Per destination (a receiver's kind, host, port): transfer slots and their queues, so a
        # frozen receiver holds only its own share; in-flight messages are per connection.
        self._active: collections.Counter[tuple[Any, ...]] = collections.Counter()
        self._slot_queues: dict[tuple[Any, ...], collections.deque[OutboundTransfer]] = {}
        self._sendable: collections.deque[OutboundTransfer] = collections.deque()
        self._dirty: list[Connection] = []
        self._pump_scheduled = False
        self._in_pump = False
        self._closing = False
        self._checksummer = (
            Checksummer(self._pool, self._reactor, checksum_threads, inline_checksum_bytes)
            if checksums
            else None
        )
        self.connections_opened = 0
        self.protocol_errors = 0
        self._finalizer = weakref.finalize(self, transport.close)
        self._reactor.run_sync(transport.register_pool, self._pool.region(0, self._pool.num_blocks))

    # ---- public API (any thread) -------------------------------------------------------

    @property
    def stats(self) -> TransferCounters:
        return self._metrics.send

    @property
    def active_transfers(self) -> int:
        """Transfers holding a slot (at most ``max_active_transfers`` per receiver)."""
        return sum(self._active.values())

    @property
    def queued_transfers(self) -> int:
        """Transfers waiting for a slot of their receiver."""
        return sum(len(q) for q in self._slot_queues.values())

    def open(
        self, transfer_id: str, remote_address: bytes, dst_block_ids: list[int], timeout_s: float
    ) -> SendHandle:
        """Start a transfer into ``dst_block_ids`` of the receiver at ``remote_address``.

        Non-blocking: connecting (or reusing the cached connection), the handshake and the
        sends happen on the reactor thread. ``timeout_s`` bounds the whole transfer, including
        waiting for a slot; on expiry the handle becomes FAILED with
        :class:`TransferTimeoutError`. Raises ``ValueError`` on a duplicate ``transfer_id``
        or bad ids, :class:`InvalidAddressError` on a bad address, and
        :class:`TransportClosedError` after :meth:`close`.
        """
        address = ReceiverAddress.decode(remote_address)
        if address.kind != self._transport.kind:
            raise ValueError(
                f"address is for a {address.kind} receiver, this sender uses {self._transport.kind}"
            )
        if not isinstance(transfer_id, str) or not transfer_id or len(transfer_id) > 1024:
            raise ValueError("transfer_id must be a non-empty string of at most 1024 chars")
        dst = as_int_list(dst_block_ids, "dst_block_ids", 1 << 62)
        if not 0 < len(dst) <= MAX_BLOCKS_PER_TRANSFER:
            raise ValueError(
                f"dst_block_ids must hold 1 to {MAX_BLOCKS_PER_TRANSFER} ids, got {len(dst)}"
            )
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
        with self._lock:
            if self._closed:
                raise TransportClosedError("sender is closed")
            if transfer_id in self._ids:
                raise ValueError(f"transfer {transfer_id!r} is already in progress on this sender")
            self._ids.add(transfer_id)
        t = OutboundTransfer(transfer_id, address, dst, float(timeout_s))
        t.handle = SendHandle(
            transfer_id,
            dst,
            self._pool.num_blocks,
            self._reactor.call_soon_threadsafe,
            partial(self._on_cancel, t),
            partial(self._on_blocks, t),
            partial(self._on_finish, t),
        )
        self._reactor.call_soon_threadsafe(self._start, t)
        return t.handle

    def connect(self, remote_address: bytes, timeout_s: float = 5.0) -> None:
        """Connect and handshake now (blocking), e.g. at startup to surface a geometry mismatch.

        Raises :class:`GeometryMismatchError`, :class:`StaleAddressError`,
        :class:`HandshakeError` or :class:`PeerLostError`; returns once the connection is ready.
        """
        address = ReceiverAddress.decode(remote_address)
        if self._closed:
            raise TransportClosedError("sender is closed")
        fut: Future[None] = Future()
        self._reactor.call_soon_threadsafe(self._connect_cmd, address, fut)
        try:
            fut.result(timeout_s)
        except FutureTimeout:
            raise HandshakeError(f"no handshake with {address} within {timeout_s}s") from None

    def close(self) -> None:
        """Fail every unfinished transfer with :class:`TransportClosedError`, close all
        connections and stop the I/O thread. Idempotent; bounded by ``settle_timeout_s``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._reactor.running:
            try:
                self._reactor.run_sync(self._begin_close)
                self._drained.wait(self._settle_timeout_s)
            except (TimeoutError, RuntimeError) as e:
                logger.warning("kvtransfer sender close: %s", e)
        self._finalizer()  # transport.close(): completes every outstanding send, stops the reactor
        if self._checksummer is not None:
            self._checksummer.close()
        self._force_close()  # the reactor is stopped: nothing can read the pool now

    # ---- transfer lifecycle (reactor thread) ---------------------------------------------

    def _start(self, t: OutboundTransfer) -> None:
        self._live.add(t)
        if self._closing:
            self._decide(
                t, TransferState.FAILED, TransportClosedError("sender is closed"), "closed"
            )
            return
        t.deadline_timer = self._reactor.call_later(t.timeout_s, self._on_deadline, t)
        key = _dest(t.address)
        if self._active[key] < self._max_active:
            self._activate(t)
        else:
            self._slot_queues.setdefault(key, collections.deque()).append(t)

    def _activate(self, t: OutboundTransfer) -> None:
        t.active = True
        self._active[_dest(t.address)] += 1
        conn = self._get_conn(t.address)
        t.conn = conn
        if conn.state == READY:
            self._attach(conn, t)
        else:
            conn.waiting.append(t)

    def _attach(self, conn: Connection, t: OutboundTransfer) -> None:
        x = t.x = conn.allocate_x()
        conn.transfers[x] = t
        self._queue_op(conn, Open(x, t.transfer_id, t.dst))
        if t.pending or t.fin_requested:
            self._mark_sendable(t)

    def _on_blocks(
        self, t: OutboundTransfer, _handle: SendHandle, src: list[int], first: int
    ) -> None:
        if t.outcome is None:
            t.pending.extend(zip(src, range(first, first + len(src))))
            self._mark_sendable(t)

    def _on_finish(self, t: OutboundTransfer, _handle: SendHandle, note: bytes = b"") -> None:
        if t.outcome is None:
            t.fin_requested = True
            t.fin_note = note
            self._mark_sendable(t)

    def _on_cancel(self, t: OutboundTransfer, _handle: SendHandle) -> None:
        self._decide(
            t,
            TransferState.CANCELLED,
            TransferCancelledError(f"transfer {t.transfer_id!r} cancelled by the sender"),
            None,
            notify=True,
        )

    def _on_deadline(self, t: OutboundTransfer) -> None:
        h = t.handle
        self._decide(
            t,
            TransferState.FAILED,
            TransferTimeoutError(
                f"transfer {t.transfer_id!r} to {t.address} did not complete within {t.timeout_s}s "
                f"({h.blocks_sent}/{h.num_blocks} blocks sent, "
                f"{'finished' if t.fin_sent else 'not finished'}, {'acknowledged' if t.acked else 'no ack'})"
            ),
            "timeout",
            notify=True,
        )

    # ---- lifecycle hooks (kvtransfer/lifecycle.py) -------------------------------------

    def _on_decided(
        self, t: OutboundTransfer, error: KVTransferError | None, notify: bool = False
    ) -> None:
        t.pending.clear()
        queue = self._slot_queues.get(_dest(t.address))
        if queue is not None and t in queue:
            queue.remove(t)
        conn = t.conn
        if notify and conn is not None and conn.state == READY and t.x is not None:
            self._queue_op(conn, Cancel(t.x, str(error)[:1000]))
        elif notify and conn is not None and conn.state == CONNECTING and t in conn.waiting:
            # The receiver is waiting for this transfer: tell it as soon as we can talk.
            conn.cancel_on_ready.append((t.transfer_id, t.dst, str(error)[:1000]))

    def _maybe_done(self, t: OutboundTransfer) -> None:
        if t.outcome is None and t.acked and t.fin_sent and not t.busy:
            self._decide(t, TransferState.DONE, None, None)
        elif t.outcome is not None and not t.busy:
            self._finalize(t)

    def _outstanding(self, t: OutboundTransfer) -> tuple[int, str] | None:
        return None if t.conn is None else (t.inflight, str(t.address))

    def _break_peer(self, t: OutboundTransfer) -> None:
        assert t.conn is not None
        self._fail_conn(
            t.conn, PeerLostError(f"receiver {t.address} stopped consuming data"), "peer_lost"
        )

    def _detach(self, t: OutboundTransfer) -> None:
        conn = t.conn
        if conn is not None:
            if t.x is not None and conn.transfers.get(t.x) is t:
                del conn.transfers[t.x]
            if t in conn.waiting:
                conn.waiting.remove(t)

    def _after_finalize(self, t: OutboundTransfer) -> None:
        if t.active:
            t.active = False
            key = _dest(t.address)
            self._active[key] -= 1
            queue = self._slot_queues.get(key)
            while queue and self._active[key] < self._max_active and not self._closing:
                self._activate(queue.popleft())
            if not queue:
                self._slot_queues.pop(key, None)
            if not self._active[key]:
                del self._active[key]
        with self._lock:
            drained = self._closing and not self._ids
        if drained:
            self._drained.set()

    # ---- sending (reactor thread) ------------------------------------------------------

    def _mark_sendable(self, t: OutboundTransfer) -> None:
        if not t.sendable and t.conn is not None and t.conn.state == READY and t.x is not None:
            t.sendable = True
            self._sendable.append(t)
            self._schedule_pump()

    def _queue_op(self, conn: Connection, op: Op) -> None:
        if not conn.outbox:
            self._dirty.append(conn)
        conn.outbox.append(op)
        self._schedule_pump()

    def _schedule_pump(self) -> None:
        if not self._pump_scheduled and not self._in_pump:
            self._pump_scheduled = True
            self._reactor.call_soon(self._pump)

    def _pump(self) -> None:
        """Turn queued positions into data messages (within the in-flight cap), post the data
        sends, then flush each connection's control ops as one message."""
        self._pump_scheduled = False
        self._in_pump = True
        try:
            self._pump_once()
        finally:
            self._in_pump = False

    def _pump_once(self) -> None:
        sends = []
        # Each iteration either sends one message (bounded by each connection's in-flight
        # cap), parks a transfer whose connection is at its cap (until one of that
        # connection's messages completes), or drops a transfer from the round-robin queue,
        # so the loop ends; a receiver that stops consuming stalls only its own transfers.
        while self._sendable:
            t = self._sendable.popleft()
            t.sendable = False
            conn = t.conn
            if t.outcome is not None or conn is None or conn.state != READY:
                continue
            if t.pending:
                if conn.inflight_msgs >= self._max_inflight:
                    conn.parked.append(t)
                    continue
                sends.append(self._build_message(t))
            if t.pending:
                t.sendable = True
                self._sendable.append(t)
            elif t.ready_to_finish:
                t.fin_sent = True
                self._queue_op(t.conn, Fin(t.x, len(t.dst), t.fin_note))  # type: ignore[arg-type]
        # Eager (small) messages go before their headers: they then wait in the receiver's
        # unexpected queue and complete as soon as the header is read (one wake-up, not two).
        # Rendezvous (large) ones go after, so the header is not stuck behind megabytes of data
        # and the receiver posts its buffer while the data starts to flow.
        eager = self._transport.eager_limit
        for link, tag, region, done in sends:
            if region.nbytes <= eager:
                link.send_data(tag, region, done)
        dirty, self._dirty = self._dirty, []
        for conn in dirty:
            ops, conn.outbox = conn.outbox, []
            if ops and conn.state != DEAD:
                conn.link.send_ctrl(encode_ops(ops))
        for link, tag, region, done in sends:
            if region.nbytes > eager:
                link.send_data(tag, region, done)

    def _build_message(self, t: OutboundTransfer) -> tuple[Link, int, Any, Any]:
        """One data message for the next run of ``t``; checksums of a small run go in its
        header, those of a large run are computed while it moves and follow in a 'sums' op."""
        src0, i0, k = take_run(t.pending, t.dst, self._max_blocks_per_msg)
        region = self._pool.region(src0, k)
        to_send = region
        if self._faults is not None:
            bad = [j for j in range(k) if self._faults.corrupt(t.transfer_id, i0 + j)]
            if bad:
                to_send = self._pool.corrupted_copy(region, bad)
        conn = t.conn
        assert conn is not None and t.x is not None
        checksums = None
        if self._checksummer is not None and self._checksummer.inline(region):
            checksums = self._checksummer.compute(region)
            t.handle._checksums[i0 : i0 + k] = checksums
        self._queue_op(conn, Data(t.x, i0, k, checksums))
        if self._checksummer is not None and checksums is None:
            t.hashing += 1
            self._checksummer.submit(region, partial(self._on_hashed, t, i0))
        t.inflight += 1
        conn.inflight_msgs += 1
        assert conn.cipher is not None  # ready
        tag = data_tag(conn.cipher, conn.link_id, t.x, i0)
        return conn.link, tag, to_send, partial(self._on_sent, t, conn, k, region.nbytes)

    def _on_hashed(
        self,
        t: OutboundTransfer,
        first: int,
        checksums: list[int] | None,
        error: BaseException | None,
    ) -> None:
        t.hashing -= 1
        if error is not None:
            self._decide(
                t,
                TransferState.FAILED,
                KVTransferError(f"checksum computation failed: {error}"),
                "protocol",
                notify=True,
            )
        elif t.outcome is None:
            assert checksums is not None  # a checksum job without error delivers them
            t.handle._checksums[first : first + len(checksums)] = checksums
            if t.conn is not None and t.conn.state == READY:
                self._queue_op(t.conn, Sums(t.x, first, checksums))  # type: ignore[arg-type]
            if t.ready_to_finish:
                self._mark_sendable(t)
        self._maybe_done(t)

    def _on_sent(
        self,
        t: OutboundTransfer,
        conn: Connection,
        blocks: int,
        nbytes: int,
        error: BaseException | None,
    ) -> None:
        t.inflight -= 1
        conn.inflight_msgs -= 1
        if conn.parked:  # room on this connection again
            parked, conn.parked = conn.parked, []
            for p in parked:
                self._mark_sendable(p)
        if error is None:
            t.handle.bytes_sent += nbytes
            t.handle.blocks_sent += blocks
            self._metrics.add_bytes("send", nbytes)
        else:
            self._decide(
                t,
                TransferState.FAILED,
                PeerLostError(
                    f"transfer {t.transfer_id!r}: sending to {t.address} failed: {error}"
                ),
                "peer_lost",
            )
        self._maybe_done(t)
        if self._sendable:
            self._schedule_pump()

    # ---- connections (reactor thread) --------------------------------------------------

    def _get_conn(self, address: ReceiverAddress) -> Connection:
        """The connection to the receiver instance ``address`` names: the cached one, or a new
        one whose handshake proves that instance (or fails its transfers with
        :class:`StaleAddressError`). A connection to another instance at the same host and
        port is left alone here: which of the two is current only a handshake tells, and
        :meth:`_on_ready` replaces the older one once the new instance is proven."""
        conn = self._conns.get(address)
        if conn is not None and conn.state != DEAD:
            return conn
        link = self._transport.connect(address)
        conn = Connection(address, link)
        self._conns[address] = conn
        self.connections_opened += 1
        link.on_ctrl = partial(self._on_ctrl, conn)
        link.on_closed = partial(self._on_link_closed, conn)
        link.start()  # the receiver speaks first: its challenge, answered in _handle_op
        conn.handshake_timer = self._reactor.call_later(
            self._connect_timeout_s, self._on_handshake_timeout, conn
        )
        return conn

    def _connect_cmd(self, address: ReceiverAddress, fut: Future[None]) -> None:
        if self._closing:
            fut.set_exception(TransportClosedError("sender is closed"))
            return
        conn = self._get_conn(address)
        if conn.state == READY:
            fut.set_result(None)
        else:
            conn.connect_waiters.append(fut)

    def _on_handshake_timeout(self, conn: Connection) -> None:
        if conn.state == CONNECTING:
            self._fail_conn(
                conn,
                HandshakeError(
                    f"no handshake reply from receiver {conn.address} within {self._connect_timeout_s}s"
                ),
                "handshake",
            )

    def _on_link_closed(self, conn: Connection, error: BaseException) -> None:
        what = "could not connect to" if conn.state == CONNECTING else "lost connection to"
        self._fail_conn(
            conn, PeerLostError(f"{what} receiver {conn.address}: {error}"), "peer_lost"
        )

    def _fail_conn(self, conn: Connection, error: KVTransferError, reason: str) -> None:
        """Mark ``conn`` dead, fail every transfer on it and close the link."""
        if conn.state == DEAD:
            return
        conn.state = DEAD
        if self._conns.get(conn.address) is conn:
            del self._conns[conn.address]
        if conn.handshake_timer is not None:
            conn.handshake_timer.cancel()
        for t in list(conn.waiting) + list(conn.transfers.values()):
            self._decide(t, TransferState.FAILED, error, reason)
        for fut in conn.connect_waiters:
            if not fut.done():
                fut.set_exception(error)
        conn.connect_waiters.clear()
        conn.outbox.clear()
        conn.link.close()

    def _on_ctrl(self, conn: Connection, payload: bytes) -> None:
        try:
            ops = decode_ops(payload)
        except ProtocolError as e:
            self._protocol_error(conn, f"malformed control message: {e}")
            return
        for op in ops:
            if conn.state == DEAD:
                return
            self._handle_op(conn, op)

    def _handle_op(self, conn: Connection, op: Op) -> None:
        if isinstance(op, Challenge) and conn.state == CONNECTING and not conn.nonce:
            if op.proto != PROTOCOL_VERSION:
                self._fail_conn(
                    conn,
                    HandshakeError(
                        f"receiver speaks protocol {op.proto}, sender {PROTOCOL_VERSION}"
                    ),
                    "handshake",
                )
                return
            conn.nonce, conn.challenge = new_nonce(), op.nonce
            mac = hello_proof(self._secret, op.nonce, conn.nonce, self.sender_id)
            self._queue_op(
                conn,
                Hello(self.geometry.to_wire(), self._checksums, self.sender_id, conn.nonce, mac),
            )
        elif isinstance(op, HelloOk) and conn.state == CONNECTING and conn.nonce:
            expected = hello_ok_proof(
                self._secret, conn.nonce, conn.challenge, op.receiver_id, op.link_id, op.tag_key
            )
            if not proof_ok(expected, op.proof):
                self._fail_conn(
                    conn,
                    HandshakeError(
                        f"receiver {conn.address} failed the handshake: its cluster secret differs"
                    ),
                    "handshake",
                )
            elif op.proto != PROTOCOL_VERSION:
                self._fail_conn(
                    conn,
                    HandshakeError(
                        f"receiver speaks protocol {op.proto}, sender {PROTOCOL_VERSION}"
                    ),
                    "handshake",
                )
            elif op.receiver_id != conn.address.receiver_id:
                self._fail_conn(
                    conn,
                    StaleAddressError(
                        f"receiver at {conn.address.host}:{conn.address.port} is instance {op.receiver_id}, "
                        f"the address names {conn.address.receiver_id}: it restarted, ask for a fresh address"
                    ),
                    "handshake",
                )
            else:
                self._on_ready(conn, op)
        elif isinstance(op, Refuse) and conn.state == CONNECTING:
            cls = GeometryMismatchError if op.geometry is not None else HandshakeError
            self._fail_conn(
                conn,
                cls(f"receiver {conn.address} refused the connection: {op.reason}"),
                "handshake",
            )
        elif isinstance(op, Done) and conn.state == READY:
            t = conn.transfers.get(op.x)
            if t is None:
                logger.debug("kvtransfer: 'done' for finished transfer number %d", op.x)
            elif not t.fin_sent:
                self._protocol_error(conn, f"'done' for transfer number {op.x} before its 'fin'")
            else:
                t.acked = True
                self._maybe_done(t)
        elif isinstance(op, Fail) and conn.state == READY:
            t = conn.transfers.get(op.x)
            if t is not None:
                self._decide(t, TransferState.FAILED, *self._remote_failure(t, op))
        elif isinstance(op, Error):
            self.protocol_errors += 1
            logger.warning(
                "kvtransfer: receiver %s rejected a message: %s", conn.address, op.reason
            )
        else:
            self._protocol_error(
                conn,
                f"unexpected {type(op).__name__.lower()} op from the receiver "
                f"(connection {conn.state})",
            )

    def _on_ready(self, conn: Connection, op: HelloOk) -> None:
        conn.state = READY
        conn.link_id = op.link_id
        conn.cipher = TagCipher(op.tag_key)
        conn.handshake_timer.cancel()
        # Its host and port now answer as this instance: a ready connection to another one
        # there is to an instance that restarted (its death not yet noticed), so its
        # transfers cannot complete.
        for old in [c for c in self._conns.values() if c.key == conn.key and c is not conn]:
            if old.state == READY:
                self._fail_conn(
                    old,
                    PeerLostError(
                        f"receiver at {conn.address.host}:{conn.address.port} restarted "
                        f"(instance {old.address.receiver_id} -> {conn.address.receiver_id})"
                    ),
                    "peer_lost",
                )
        for transfer_id, dst, reason in conn.cancel_on_ready:
            x = conn.allocate_x()
            self._queue_op(conn, Open(x, transfer_id, dst))
            self._queue_op(conn, Cancel(x, reason))
        conn.cancel_on_ready.clear()
        waiting, conn.waiting = conn.waiting, []
        for t in waiting:
            if t.outcome is None:
                self._attach(conn, t)
        for fut in conn.connect_waiters:
            if not fut.done():
                fut.set_result(None)
        conn.connect_waiters.clear()

    def _remote_failure(self, t: OutboundTransfer, op: Fail) -> tuple[KVTransferError, str]:
        if op.code == "checksum" and op.index is not None and op.index < len(t.dst):
            self._metrics.checksum_mismatches("send", 1)
            expected = t.handle._checksums[op.index]
            return ChecksumMismatchError(t.transfer_id, op.index, expected or 0, None), "checksum"
        if op.code == "timeout":
            return TransferTimeoutError(
                f"receiver timed out transfer {t.transfer_id!r}: {op.reason}"
            ), "timeout"
        if op.code == "cancelled":
            return PeerCancelledError(
                f"receiver cancelled transfer {t.transfer_id!r}: {op.reason}"
            ), "peer_cancelled"
        if op.code == "closed":
            return PeerLostError(f"receiver closed: {op.reason}"), "peer_lost"
        return TransferRejectedError(op.code, op.reason), "rejected"

    def _protocol_error(self, conn: Connection, reason: str) -> None:
        self.protocol_errors += 1
        logger.warning("kvtransfer: from receiver %s: %s", conn.address, reason)
        if conn.state != DEAD:
            self._queue_op(conn, Error(reason[:1000]))

    # ---- shutdown (reactor thread) -----------------------------------------------------

    def _begin_close(self) -> None:
        self._closing = True
        for t in list(self._live):
            self._decide(
                t,
                TransferState.FAILED,
                TransportClosedError("sender closed"),
                "closed",
                notify=True,
            )
        self._pump()  # deliver the cancels before closing the connections
        for conn in list(self._conns.values()):
            self._fail_conn(conn, TransportClosedError("sender closed"), "closed")
        with self._lock:
            if not self._ids:
                self._drained.set()

    def _force_close(self) -> None:
        """Settle whatever is left once the transport is destroyed (called from close())."""
        for t in list(self._live):
            if t.outcome is None:
                t.outcome = (TransferState.FAILED, TransportClosedError("sender closed"), "closed")
            self._finalize(t)


def _dest(address: ReceiverAddress) -> tuple[Any, ...]:
    """The receiver a transfer goes to (what slots and their queues are counted by)."""
    return (address.kind, address.host, address.port)
