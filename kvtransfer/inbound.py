"""Receiver-side records: one sender connection, one expected transfer, one data message.

Plain bookkeeping with no I/O, owned by the receiver's reactor thread: which positions were
announced, which messages are in flight, which are verified, and whether the transfer may
settle. :class:`~kvtransfer.receiver.Receiver` drives them.
"""

from __future__ import annotations

import collections
from typing import Any

from kvtransfer.auth import TagCipher
from kvtransfer.base import Link, TransferState
from kvtransfer.errors import KVTransferError
from kvtransfer.handles import RecvHandle
from kvtransfer.pool import Region
from kvtransfer.protocol import Data

_RETIRED_MEMORY = 4096  # per connection: recently ended transfer numbers whose late data is drained


class InboundLink:
    """One sender's connection."""

    def __init__(self, link: Link, link_id: int):
        self.link = link
        self.link_id = link_id
        self.ready = False  # handshake accepted
        self.closed = False
        self.transfers: dict[int, InboundTransfer] = {}  # by transfer number
        self.retired: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.peer = "unknown sender"
        self.nonce = b""  # this connection's challenge
        self.authenticated: bool | None = None  # None: no hello yet
        self.hello_timer: Any = None
        self.cipher: TagCipher | None = None  # data tags, from the handshake on
        # This connection's share of posted receives (``max_posted_receives`` each, so a sender
        # that stops sending holds only its own): posted and not yet completed, and the
        # announced messages of undecided transfers waiting for one of them.
        self.posted = 0
        self.backlog: collections.deque[InboundMessage] = collections.deque()

    def retire(self, x: int) -> None:
        """Remember that transfer number ``x`` ended, so its late messages are dropped quietly."""
        self.retired[x] = None
        self.retired.move_to_end(x)
        while len(self.retired) > _RETIRED_MEMORY:
            self.retired.popitem(last=False)


class InboundMessage:
    """One announced data message: blocks ``[index, index + count)`` of a transfer."""

    __slots__ = (
        "checksums",
        "count",
        "counted",
        "index",
        "link",
        "received",
        "region",
        "tag",
        "transfer",
    )

    def __init__(
        self,
        transfer: InboundTransfer,
        link: InboundLink,
        tag: int,
        index: int,
        count: int,
        checksums: list[int] | None,
    ):
        self.transfer = transfer
        self.link = link
        self.tag = tag
        self.index = index
        self.count = count
        self.checksums = checksums  # from the header, or later from a 'sums' op
        self.region: Region | None = None
        self.received = False  # its bytes are in the pool
        self.counted = False  # its blocks are in the transfer's ``verified`` (once, ever)


class InboundTransfer:
    """Reactor-side state of one expected transfer.

    ``posted`` counts receives posted into the pool and not yet completed (not the messages
    still waiting in the connection's backlog: those touch nothing and are dropped when the
    transfer is decided) and ``verifying`` checksum jobs reading the pool; the transfer settles
    only when both are zero, so nothing touches its blocks after the handle turns terminal.
    """

    def __init__(self, transfer_id: str, ids: list[int], timeout_s: float):
        self.transfer_id = transfer_id
        self.ids = ids
        self.timeout_s = timeout_s
        self.handle: RecvHandle = None  # type: ignore[assignment]  # set right after creation
        self.link: InboundLink | None = None
        self.x: int | None = None
        self.seen = bytearray(len(ids))  # a header announced this position
        self.messages: dict[int, InboundMessage] = {}  # by first index
        self.verified = 0
        self.posted = 0
        self.verifying = 0
        self.fin_count: int | None = None
        self.outcome: tuple[TransferState, KVTransferError | None, str | None] | None = None
        self.deadline_timer: Any = None
        self.settle_timer: Any = None

    @property
    def busy(self) -> bool:
        """True while a receive or a checksum job still touches this transfer's blocks."""
        return self.posted > 0 or self.verifying > 0

    def header_problem(self, op: Data) -> str | None:
        """Why the data header ``op`` is invalid for this transfer, or None if it is valid."""
        n, i, k = len(self.ids), op.index, op.count
        if i + k > n:
            return f"data positions [{i}, {i + k}) outside the transfer's {n} blocks"
        if any(self.seen[i : i + k]):
            return f"data positions [{i}, {i + k}) overlap positions already announced"
        first = self.ids[i]
        if any(self.ids[i + j] != first + j for j in range(k)):
            return f"data positions [{i}, {i + k}) are not adjacent in the receiver's pool"
        return None

    def fin_problem(self, count: int, need_checksums: bool) -> str | None:
        """Why ``fin`` with ``count`` blocks cannot end this transfer, or None."""
        if count != len(self.ids):
            return f"sender finished after {count} of {len(self.ids)} blocks"
        if not all(self.seen):
            return f"fin before all {len(self.ids)} blocks were announced"
        if need_checksums and any(m.checksums is None for m in self.messages.values()):
            return "fin before the checksums of every block were sent"
        return None

    @property
    def complete(self) -> bool:
        """``fin`` arrived and every position's message was received and verified (each
        message is counted once, so this cannot hold while a message is still outstanding)."""
        return self.fin_count is not None and self.verified == len(self.ids)
