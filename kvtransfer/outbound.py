"""Sender-side records: one connection to a receiver, one outgoing transfer, run coalescing.

Plain bookkeeping with no I/O, owned by the sender's reactor thread;
:class:`~kvtransfer.sender.Sender` drives them.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future
from typing import Any

from kvtransfer.auth import TagCipher
from kvtransfer.base import Link, TransferState
from kvtransfer.errors import KVTransferError
from kvtransfer.handles import SendHandle
from kvtransfer.protocol import TRANSFER_NUMBER_LIMIT, Op, ReceiverAddress

CONNECTING, READY, DEAD = "connecting", "ready", "dead"


class Connection:
    """A connection to one receiver, shared by every transfer to it."""

    def __init__(self, address: ReceiverAddress, link: Link):
        self.address = address
        self.key = (address.kind, address.host, address.port)
        self.link = link
        self.state = CONNECTING
        self.link_id = 0  # assigned by the receiver in hello_ok; part of every data tag
        self.cipher: TagCipher | None = None  # the data tags, from hello_ok's tag key
        self.challenge = b""  # the receiver's nonce
        self.nonce = b""  # ours, sent in hello
        self.transfers: dict[int, OutboundTransfer] = {}  # by transfer number, once opened
        self.waiting: list[OutboundTransfer] = []  # activated before the handshake finished
        self.cancel_on_ready: list[tuple[str, list[int], str]] = []  # gave up while connecting
        self.outbox: list[Op] = []
        self.inflight_msgs = 0  # data messages sent on this connection, not yet completed
        self.parked: list[OutboundTransfer] = []  # have data, wait for inflight_msgs < cap
        self.next_x = 0
        self.handshake_timer: Any = None
        self.connect_waiters: list[Future[None]] = []

    def allocate_x(self) -> int:
        """A transfer number not used by any open transfer on this connection."""
        x = self.next_x
        while x in self.transfers:
            x = (x + 1) % TRANSFER_NUMBER_LIMIT
        self.next_x = (x + 1) % TRANSFER_NUMBER_LIMIT
        return x


class OutboundTransfer:
    """Reactor-side state of one outgoing transfer.

    ``inflight`` counts data sends and ``hashing`` checksum jobs still reading the source
    blocks; the transfer settles only when both are zero.
    """

    def __init__(
        self, transfer_id: str, address: ReceiverAddress, dst: list[int], timeout_s: float
    ):
        self.transfer_id = transfer_id
        self.address = address
        self.dst = dst
        self.timeout_s = timeout_s
        self.handle: SendHandle = None  # type: ignore[assignment]  # set right after creation
        self.conn: Connection | None = None
        self.x: int | None = None
        self.pending: collections.deque[tuple[int, int]] = (
            collections.deque()
        )  # (src block, position)
        self.fin_requested = False
        self.fin_note = b""  # the caller's bytes for the receiver, sent with ``fin``
        self.fin_sent = False
        self.acked = False
        self.active = False  # holds one of the sender's transfer slots
        self.sendable = False  # in the sender's round-robin queue
        self.inflight = 0
        self.hashing = 0
        self.outcome: tuple[TransferState, KVTransferError | None, str | None] | None = None
        self.deadline_timer: Any = None
        self.settle_timer: Any = None

    @property
    def busy(self) -> bool:
        return self.inflight > 0 or self.hashing > 0

    @property
    def ready_to_finish(self) -> bool:
        """``fin`` may go out: everything queued was sent and every checksum is known."""
        return self.fin_requested and not self.fin_sent and not self.pending and self.hashing == 0


def take_run(
    pending: collections.deque[tuple[int, int]], dst: list[int], max_blocks: int
) -> tuple[int, int, int]:
    """Pop the longest prefix of ``pending`` that is one contiguous run in both pools.

    ``pending`` holds ``(source block, position)`` pairs in queueing order; a run continues
    while the next pair's source block, position and destination block (``dst[position]``)
    each follow the previous by one, up to ``max_blocks``. Returns ``(first source block,
    first position, count)``.
    """
    src0, i0 = pending.popleft()
    k = 1
    while pending and k < max_blocks:
        src, i = pending[0]
        if src != src0 + k or i != i0 + k or dst[i] != dst[i0] + k:
            break
        pending.popleft()
        k += 1
    return src0, i0, k
