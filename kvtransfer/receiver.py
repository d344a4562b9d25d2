"""Decode side of the KV transfer protocol, written once against the transport SPI.

``expect`` registers a transfer before the prefill worker is asked to send (no I/O). On the
reactor thread, for each connection (:class:`InboundLink`):

* the receiver speaks first, a ``challenge`` nonce; the sender's first message must be a
  ``hello`` that proves it holds the cluster secret (:mod:`kvtransfer.auth`), sent within
  ``hello_timeout_s``, or the connection is closed; at most ``max_connections`` connections
  are open at once (the next ones are closed at accept);
* the receiver checks the proof first, then geometry, protocol version and checksum setting,
  and answers ``hello_ok`` (the connection's link id and tag key, and its own proof) or
  ``refuse`` naming both sides' values (to an authenticated sender only);
* ``open`` binds a transfer number to an expected transfer; the sender's destination ids must
  equal the expected ones (the receiver only ever writes to blocks it was told to expect);
* each ``data`` header is validated (range, not seen before, contiguous destination run) and a
  receive is posted straight into those pool blocks; at most ``max_posted_receives`` per
  connection are outstanding, later headers wait (which holds back that sender's sends:
  backpressure); a sender that stops sending holds only its own connection's receives, and
  the waiting headers of a transfer that ends are dropped at once (their data discarded);
* on completion each block's xxh3_64 is checked against the header; a mismatch fails that
  transfer only (``fail`` with code ``checksum``); data for unknown, rejected or finished
  transfers is read and discarded so it never lingers in the transport;
* a transfer is DONE when every block verified and ``fin`` arrived (then ``done`` goes back),
  FAILED/CANCELLED once its posted receives have completed, so nothing is written to its
  blocks after the handle turns terminal.

Malformed or out-of-place messages are answered with an ``error`` op and otherwise ignored:
the connection and every other transfer keep going.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import uuid
import weakref
from functools import partial
from typing import Any

from kvtransfer.auth import (
    TagCipher,
    hello_ok_proof,
    hello_proof,
    new_nonce,
    new_tag_key,
    proof_ok,
)
from kvtransfer.base import KVReceiver, Link, TransferState, Transport
from kvtransfer.checksums import Checksummer
from kvtransfer.errors import (
    ChecksumMismatchError,
    KVTransferError,
    PeerCancelledError,
    PeerLostError,
    ProtocolError,
    TransferCancelledError,
    TransferTimeoutError,
    TransportClosedError,
)
from kvtransfer.geometry import KVGeometry
from kvtransfer.handles import RecvHandle, as_int_list
from kvtransfer.inbound import InboundLink, InboundMessage, InboundTransfer
from kvtransfer.lifecycle import TransferEnd
from kvtransfer.metrics import TransferCounters, TransferMetrics
from kvtransfer.pool import PoolView
from kvtransfer.protocol import (
    LINK_ID_LIMIT,
    MAX_BLOCKS_PER_TRANSFER,
    MAX_CTRL_BYTES,
    PRE_AUTH_CTRL_BYTES,
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


class Receiver(TransferEnd, KVReceiver):
    """Receives blocks into ``pool`` over ``transport``; see the module docstring.

    Options: ``secret`` (the cluster secret; ``None``: the empty key, open to anyone who reaches
    the port), ``hello_timeout_s``, ``max_connections``, ``verify_checksums`` (default on; a
    sender with checksums off is then refused), ``max_posted_receives`` (per connection),
    ``settle_timeout_s``, ``checksum_threads`` / ``inline_checksum_bytes`` (messages larger
    than this are verified on those threads, off the I/O thread), ``metrics``. ``host`` is the
    address advertised to senders; ``port`` 0 picks a free port.
    """

    def __init__(
        self,
        transport: Transport,
        pool: Any,
        geometry: KVGeometry,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        verify_checksums: bool = True,
        max_posted_receives: int = 64,
        settle_timeout_s: float = 5.0,
        checksum_threads: int = 1,
        inline_checksum_bytes: int = 1 << 20,
        metrics: TransferMetrics | None = None,
        secret: bytes | None = None,
        bind_host: str | None = None,
        hello_timeout_s: float = 5.0,
        max_connections: int = 256,
    ):
        if max_posted_receives < 1 or max_connections < 1:
            raise ValueError("max_posted_receives and max_connections must be >= 1")
        self._secret = secret
        self._hello_timeout_s = hello_timeout_s
        self._max_connections = max_connections
        self.auth_failures = 0  # handshakes refused for a wrong proof
        self.dropped_connections = 0  # closed at accept (cap) or for never sending hello
        self._geometry = geometry
        self._pool = PoolView(pool, geometry)
        self._transport = transport
        self._reactor = transport.reactor
        self._verify = verify_checksums
        self._max_posted = max_posted_receives
        self._settle_timeout_s = settle_timeout_s
        self._direction = "recv"
        self._metrics = metrics if metrics is not None else TransferMetrics()
        self.receiver_id = uuid.uuid4().hex[:16]
        # Shared with caller threads (guarded by _lock).
        self._lock = threading.Lock()
        self._expected: dict[str, InboundTransfer] = {}  # registered, not yet opened by a sender
        self._ids: set[str] = set()  # every transfer id not yet terminal
        self._closed = False
        # Reactor-thread state.
        self._live: set[InboundTransfer] = set()
        self._links: dict[int, InboundLink] = {}
        self._next_link_id = 1
        self._posted_total = 0  # receives posted on all connections, not yet completed
        self._checksummer = Checksummer(
            self._pool, self._reactor, checksum_threads, inline_checksum_bytes
        )
        self._closing = False
        self.protocol_errors = 0
        self._finalizer = weakref.finalize(self, transport.close)
        self._reactor.run_sync(transport.register_pool, self._pool.region(0, self._pool.num_blocks))
        bound_host, bound_port = self._reactor.run_sync(
            self._transport.listen, host, port, self._on_accept, bind_host
        )
        self._address = ReceiverAddress(transport.kind, bound_host, bound_port, self.receiver_id)
        self._address_bytes = self._address.encode()

    # ---- public API (any thread) -------------------------------------------------------

    @property
    def address_text(self) -> str:
        """The address for people: ``kind://host:port/receiver-id``."""
        return str(self._address)

    @property
    def address(self) -> bytes:
        """Opaque address for senders (msgpack: kind, host, port, receiver instance id)."""
        return self._address_bytes

    @property
    def geometry(self) -> KVGeometry:
        return self._geometry

    @property
    def stats(self) -> TransferCounters:
        return self._metrics.recv

    @property
    def num_connections(self) -> int:
        return len(self._links)

    def expect(self, transfer_id: str, block_ids: list[int], timeout_s: float) -> RecvHandle:
        """Reserve ``block_ids`` of this pool for ``transfer_id`` (call before the sender opens).

        Non-blocking. The handle turns DONE once every block arrived and verified; FAILED on
        ``timeout_s`` expiry, checksum mismatch, protocol violation or a lost sender; CANCELLED
        after ``handle.cancel()``. Raises ``ValueError`` on a transfer id already expected, an
        empty or duplicate block list or ids outside the pool, and
        :class:`TransportClosedError` after :meth:`close`.
        """
        if not isinstance(transfer_id, str) or not transfer_id or len(transfer_id) > 1024:
            raise ValueError("transfer_id must be a non-empty string of at most 1024 chars")
        ids = as_int_list(block_ids, "block_ids", self._pool.num_blocks)
        if not 0 < len(ids) <= MAX_BLOCKS_PER_TRANSFER:
            raise ValueError(
                f"block_ids must hold 1 to {MAX_BLOCKS_PER_TRANSFER} ids, got {len(ids)}"
            )
        if len(set(ids)) != len(ids):
            raise ValueError("block_ids must not repeat a block")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
        t = InboundTransfer(transfer_id, ids, float(timeout_s))
        t.handle = RecvHandle(
            transfer_id, ids, self._reactor.call_soon_threadsafe, partial(self._on_cancel, t)
        )
        with self._lock:
            if self._closed:
                raise TransportClosedError("receiver is closed")
            if transfer_id in self._ids:
                raise ValueError(f"transfer {transfer_id!r} is already expected by this receiver")
            self._ids.add(transfer_id)
            self._expected[transfer_id] = t  # visible to 'open' at once, before _register runs
        self._reactor.call_soon_threadsafe(self._register, t)
        return t.handle

    def close(self) -> None:
        """Fail unfinished transfers with :class:`TransportClosedError`, close connections and
        the listener, stop the I/O thread. Idempotent and bounded."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._reactor.running:
            try:
                self._reactor.run_sync(self._begin_close)
            except (TimeoutError, RuntimeError) as e:
                logger.warning("kvtransfer receiver close: %s", e)
        self._finalizer()  # transport.close(): completes every outstanding receive, stops the reactor
        self._checksummer.close()
        for t in list(self._live):  # the reactor is stopped: nothing can write to the pool now
            if t.outcome is None:
                t.outcome = (
                    TransferState.FAILED,
                    TransportClosedError("receiver closed"),
                    "closed",
                )
            self._finalize(t)

    # ---- transfer lifecycle (reactor thread) ---------------------------------------------

    def _register(self, t: InboundTransfer) -> None:
        if t.outcome is None:
            self._live.add(t)
            t.deadline_timer = self._reactor.call_later(t.timeout_s, self._on_deadline, t)

    def _on_deadline(self, t: InboundTransfer) -> None:
        self._decide(
            t,
            TransferState.FAILED,
            TransferTimeoutError(
                f"transfer {t.transfer_id!r}: {t.verified}/{len(t.ids)} blocks received within {t.timeout_s}s"
                + ("" if t.link is not None else " (the sender never opened it)")
            ),
            "timeout",
            code="timeout",
        )

    def _on_cancel(self, t: InboundTransfer, _handle: RecvHandle) -> None:
        self._decide(
            t,
            TransferState.CANCELLED,
            TransferCancelledError(f"transfer {t.transfer_id!r} cancelled by the receiver"),
            None,
            code="cancelled",
        )

    # ---- lifecycle hooks (kvtransfer/lifecycle.py) -------------------------------------

    def _on_decided(
        self,
        t: InboundTransfer,
        error: KVTransferError | None,
        code: str | None = None,
        index: int | None = None,
    ) -> None:
        """Tell the sender (``code``, and the block ``index`` a checksum failed at)."""
        with self._lock:
            if self._expected.get(t.transfer_id) is t:
                del self._expected[t.transfer_id]
        link = t.link
        if link is not None and any(m.transfer is t for m in link.backlog):
            # Its waiting messages will never be posted: drop them now, without waiting for a
            # receive slot (a transfer waits only for receives really posted), and discard
            # their data as it arrives so the sender's sends complete.
            waiting, link.backlog = link.backlog, collections.deque()
            for m in waiting:
                if m.transfer is t:
                    self._drain(link, m.tag)
                else:
                    link.backlog.append(m)
        if code is not None and link is not None and not link.closed and t.x is not None:
            self._send(link, Fail(t.x, code, str(error)[:1000], index))

    def _outstanding(self, t: InboundTransfer) -> tuple[int, str] | None:
        return None if t.link is None else (t.posted, str(t.link.peer))

    def _break_peer(self, t: InboundTransfer) -> None:
        assert t.link is not None
        t.link.link.close()

    def _detach(self, t: InboundTransfer) -> None:
        link = t.link
        if link is not None and t.x is not None:
            if link.transfers.get(t.x) is t:
                del link.transfers[t.x]
            link.retire(t.x)

    # ---- connections (reactor thread) --------------------------------------------------

    def _on_accept(self, link: Link) -> None:
        if self._closing:
            link.close()
            return
        if len(self._links) >= self._max_connections:
            self.dropped_connections += 1
            logger.warning(
                "kvtransfer: %d connections open (the cap): closing a new one",
                len(self._links),
            )
            link.close()
            return
        link_id = self._next_link_id
        while link_id in self._links or link_id == 0:
            link_id = (link_id + 1) % LINK_ID_LIMIT
        self._next_link_id = (link_id + 1) % LINK_ID_LIMIT
        il = InboundLink(link, link_id)
        self._links[link_id] = il
        link.on_ctrl = partial(self._on_ctrl, il)
        link.on_closed = partial(self._on_link_closed, il)
        link.max_ctrl_bytes = PRE_AUTH_CTRL_BYTES  # until its hello is accepted
        link.start()
        il.nonce = new_nonce()
        self._send(il, Challenge(il.nonce))
        il.hello_timer = self._reactor.call_later(self._hello_timeout_s, self._on_hello_timeout, il)

    def _on_hello_timeout(self, il: InboundLink) -> None:
        if il.ready or il.closed:
            return
        self.dropped_connections += 1
        logger.warning(
            "kvtransfer: %s sent no valid hello within %.1f s: closing the connection",
            il.peer,
            self._hello_timeout_s,
        )
        self._drop(il, "no valid hello in time")

    def _drop(self, il: InboundLink, why: str) -> None:
        """Close a link that never finished its handshake (no transfers), and take it out of
        the table now: the transport reports the close later, from another turn of the
        reactor, and until then the link counted against ``max_connections`` and in
        ``num_connections`` although the peer already saw it closed."""
        self._on_link_closed(il, ConnectionAbortedError(why))
        il.link.close()

    def _on_link_closed(self, il: InboundLink, error: BaseException) -> None:
        if il.closed:
            return
        il.closed = True
        if il.hello_timer is not None:
            il.hello_timer.cancel()
        self._links.pop(il.link_id, None)
        for t in list(il.transfers.values()):
            self._decide(
                t,
                TransferState.FAILED,
                PeerLostError(
                    f"transfer {t.transfer_id!r}: connection from {il.peer} lost: {error}"
                ),
                "peer_lost",
            )

    def _send(self, il: InboundLink, *ops: Op) -> None:
        if not il.closed:
            il.link.send_ctrl(encode_ops(list(ops)))

    def _reject(self, il: InboundLink, reason: str) -> None:
        self.protocol_errors += 1
        logger.warning("kvtransfer: from %s: %s", il.peer, reason)
        self._send(il, Error(reason[:1000]))

    def _on_ctrl(self, il: InboundLink, payload: bytes) -> None:
        try:
            ops = decode_ops(payload)
        except ProtocolError as e:
            self._reject(il, f"malformed control message: {e}")
            return
        for op in ops:
            if il.closed:
                return
            if il.authenticated is False:
                return  # refused: nothing more is read from it
            if not il.ready and not isinstance(op, (Hello, Error)):
                # an honest sender never does this: close rather than answer an unknown peer
                self._reject(il, f"{type(op).__name__.lower()} op before the handshake")
                self._drop(il, "op before the handshake")
                return
            elif isinstance(op, Hello):
                self._on_hello(il, op)
            elif isinstance(op, Open):
                self._on_open(il, op)
            elif isinstance(op, Data):
                self._on_data(il, op)
            elif isinstance(op, Sums):
                self._on_sums(il, op)
            elif isinstance(op, Fin):
                self._on_fin(il, op)
            elif isinstance(op, Cancel):
                t = il.transfers.get(op.x)
                if t is not None:
                    self._decide(
                        t,
                        TransferState.FAILED,
                        PeerCancelledError(
                            f"sender cancelled transfer {t.transfer_id!r}: {op.reason}"
                        ),
                        "peer_cancelled",
                    )
                elif op.x not in il.retired:
                    self._reject(il, f"cancel for unknown transfer number {op.x}")
            elif isinstance(op, Error):
                self.protocol_errors += 1
                logger.warning("kvtransfer: sender %s rejected a message: %s", il.peer, op.reason)
            else:
                self._reject(il, f"unexpected {type(op).__name__.lower()} op from a sender")

    def _on_hello(self, il: InboundLink, op: Hello) -> None:
        if il.ready:
            self._reject(il, "duplicate hello")
            return
        if il.authenticated is None:  # one try per connection
            expected = hello_proof(self._secret, il.nonce, op.nonce, op.sender_id)
            il.authenticated = proof_ok(expected, op.proof)
            if not il.authenticated:
                self.auth_failures += 1
                logger.warning(
                    "kvtransfer: a sender failed the handshake (its cluster secret differs): "
                    "closing the connection"
                )
                self._send(il, Refuse("authentication failed: the cluster secret differs", None))
                # closed shortly, so the refusal gets out first; nothing else is accepted
                self._reactor.call_later(0.2, il.link.close)
                return
        il.peer = f"sender {op.sender_id[:64]}"
        mine = self._geometry.to_wire()
        if op.proto != PROTOCOL_VERSION:
            self._send(
                il,
                Refuse(
                    f"protocol version differs (sender={op.proto}, receiver={PROTOCOL_VERSION})",
                    None,
                ),
            )
            return
        try:
            theirs = KVGeometry.from_wire(op.geometry)
            diffs = theirs.mismatches(self._geometry, local="sender", remote="receiver")
        except ProtocolError:
            diffs = [
                f"{k} (sender={op.geometry.get(k)!r}, receiver={v!r})"
                for k, v in mine.items()
                if op.geometry.get(k) != v
            ] or [f"sender geometry {op.geometry!r}"]
        if not diffs and self._verify and not op.checksums:
            diffs = ["checksums (sender=off, receiver=on)"]
        if diffs:
            self._send(il, Refuse("KV geometry mismatch: " + "; ".join(diffs), mine))
            logger.warning("kvtransfer: refused %s: %s", il.peer, "; ".join(diffs))
            return
        il.ready = True
        il.link.max_ctrl_bytes = MAX_CTRL_BYTES
        if il.hello_timer is not None:
            il.hello_timer.cancel()
        tag_key = new_tag_key()
        il.cipher = TagCipher(tag_key)
        mac = hello_ok_proof(
            self._secret, op.nonce, il.nonce, self.receiver_id, il.link_id, tag_key
        )
        self._send(il, HelloOk(self.receiver_id, il.link_id, tag_key, mac))

    def _on_open(self, il: InboundLink, op: Open) -> None:
        if op.x in il.transfers:
            self._reject(il, f"transfer number {op.x} is already open")
            return
        with self._lock:
            t = self._expected.pop(op.transfer_id, None)
        if t is None:
            il.retire(op.x)
            self._send(
                il,
                Fail(
                    op.x,
                    "unknown_transfer",
                    f"no transfer {op.transfer_id!r} is expected (never, or already ended)",
                ),
            )
            return
        t.link, t.x = il, op.x
        il.transfers[op.x] = t
        if op.dst != t.ids:
            self._decide(
                t,
                TransferState.FAILED,
                ProtocolError(
                    f"transfer {t.transfer_id!r}: sender's destination blocks differ from the expected ones"
                ),
                "protocol",
                code="mismatch",
            )

    def _on_data(self, il: InboundLink, op: Data) -> None:
        assert il.cipher is not None  # ready
        tag = data_tag(il.cipher, il.link_id, op.x, op.index)
        t = il.transfers.get(op.x)
        if t is None or t.outcome is not None:
            if t is None and op.x not in il.retired:
                self._reject(il, f"data for unknown transfer number {op.x}")
            self._drain(il, tag)
            return
        problem = t.header_problem(op)
        if problem is not None:
            self._drain(il, tag)
            self._decide(
                t,
                TransferState.FAILED,
                ProtocolError(f"transfer {t.transfer_id!r}: {problem}"),
                "protocol",
                code="protocol",
            )
            return
        t.seen[op.index : op.index + op.count] = b"\x01" * op.count
        msg = InboundMessage(t, il, tag, op.index, op.count, op.checksums)
        t.messages[op.index] = msg
        il.backlog.append(msg)
        self._post_backlog(il)

    def _on_sums(self, il: InboundLink, op: Sums) -> None:
        t = il.transfers.get(op.x)
        if t is None or t.outcome is not None:
            if t is None and op.x not in il.retired:
                self._reject(il, f"sums for unknown transfer number {op.x}")
            return
        msg = t.messages.get(op.index)
        if msg is None or msg.checksums is not None or len(op.checksums) != msg.count:
            self._decide(
                t,
                TransferState.FAILED,
                ProtocolError(
                    f"transfer {t.transfer_id!r}: checksums for position {op.index} match no data message"
                ),
                "protocol",
                code="protocol",
            )
            return
        msg.checksums = op.checksums
        if not msg.received:
            return  # checked (or, with checking off, counted) once its data arrives
        if self._verify:
            self._start_verification(msg)
        else:  # counted when its data arrived; the handle still reports the sender's sums
            t.handle._checksums[msg.index : msg.index + msg.count] = msg.checksums

    def _drain(self, il: InboundLink, tag: int) -> None:
        if not il.closed:
            il.link.recv_data(tag, None, _ignore)

    def _post_backlog(self, il: InboundLink) -> None:
        """Post receives for ``il``'s waiting messages while it has fewer than
        ``max_posted_receives`` outstanding (it only holds messages of undecided transfers)."""
        while il.backlog and il.posted < self._max_posted and not il.closed:
            msg = il.backlog.popleft()
            t = msg.transfer
            msg.region = self._pool.region(t.ids[msg.index], msg.count)
            il.posted += 1
            t.posted += 1
            self._posted_total += 1
            il.link.recv_data(msg.tag, msg.region, partial(self._on_received, msg))

    def _on_received(self, msg: InboundMessage, error: BaseException | None) -> None:
        t, il = msg.transfer, msg.link
        self._posted_total -= 1
        il.posted -= 1
        t.posted -= 1
        if error is not None:
            self._decide(
                t,
                TransferState.FAILED,
                PeerLostError(f"transfer {t.transfer_id!r}: receiving blocks failed: {error}"),
                "peer_lost",
            )
        else:
            assert msg.region is not None  # set before the receive was posted
            msg.received = True
            self._metrics.add_bytes("recv", msg.region.nbytes)
            t.handle.bytes_received += msg.region.nbytes
            if t.outcome is None and (msg.checksums is not None or not self._verify):
                self._start_verification(msg)
        if t.outcome is not None and not t.busy:
            self._finalize(t)
        self._post_backlog(il)

    def _start_verification(self, msg: InboundMessage) -> None:
        """Check a received message against its checksums (off the I/O thread), then count it."""
        if msg.checksums is None or not self._verify:
            self._verified(msg)
            return
        assert msg.region is not None  # verified only once received
        msg.transfer.verifying += 1
        if self._checksummer.inline(msg.region):
            self._on_checked(msg, self._checksummer.compute(msg.region), None)
        else:
            self._checksummer.submit(msg.region, partial(self._on_checked, msg))

    def _on_checked(
        self, msg: InboundMessage, actual: list[int] | None, error: BaseException | None
    ) -> None:
        t = msg.transfer
        t.verifying -= 1
        if t.outcome is None:
            if error is not None:
                self._decide(
                    t,
                    TransferState.FAILED,
                    KVTransferError(f"checksum computation failed: {error}"),
                    "protocol",
                    code="protocol",
                )
            else:
                # no error: the job delivered them; verification starts only with checksums
                assert actual is not None and msg.checksums is not None
                bad = [j for j in range(msg.count) if actual[j] != msg.checksums[j]]
                if bad:
                    self._metrics.checksum_mismatches("recv", len(bad))
                    j = bad[0]
                    self._decide(
                        t,
                        TransferState.FAILED,
                        ChecksumMismatchError(
                            t.transfer_id, msg.index + j, msg.checksums[j], actual[j]
                        ),
                        "checksum",
                        code="checksum",
                        index=msg.index + j,
                    )
                else:
                    self._verified(msg)
        if t.outcome is not None and not t.busy:
            self._finalize(t)

    def _verified(self, msg: InboundMessage) -> None:
        if msg.counted:  # once per message, in whatever order its data and checksums came
            return
        msg.counted = True
        t = msg.transfer
        if msg.checksums is not None:
            t.handle._checksums[msg.index : msg.index + msg.count] = msg.checksums
        t.verified += msg.count
        t.handle.blocks_done = t.verified
        self._maybe_done(t)

    def _on_fin(self, il: InboundLink, op: Fin) -> None:
        t = il.transfers.get(op.x)
        if t is None or t.outcome is not None:
            if t is None and op.x not in il.retired:
                self._reject(il, f"fin for unknown transfer number {op.x}")
            return
        problem = t.fin_problem(op.count, self._verify)
        if problem is not None:
            self._decide(
                t,
                TransferState.FAILED,
                ProtocolError(f"transfer {t.transfer_id!r}: {problem}"),
                "protocol",
                code="protocol",
            )
            return
        t.fin_count = op.count
        t.handle.note = op.note
        self._maybe_done(t)

    def _maybe_done(self, t: InboundTransfer) -> None:
        if t.outcome is None and t.complete:
            # the handle first: whatever the sender does once it reads ``done`` (P's reply to
            # D's Prefill call) must find it DONE, or D could take the reply's path
            self._decide(t, TransferState.DONE, None, None)
            self._send(t.link, Done(t.x))  # type: ignore[arg-type]

    # ---- shutdown (reactor thread) -----------------------------------------------------

    def _begin_close(self) -> None:
        self._closing = True
        with self._lock:
            pending = list(self._expected.values())
        for t in list(self._live) + pending:
            self._decide(
                t,
                TransferState.FAILED,
                TransportClosedError("receiver closed"),
                "closed",
                code="closed",
            )
        for il in list(self._links.values()):
            il.link.close()


def _ignore(_error: BaseException | None) -> None:
    """Completion of a discarded data message (a truncation error is the expected outcome)."""
