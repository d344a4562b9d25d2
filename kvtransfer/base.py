"""The transfer interface: what services call, and what a transport must provide.

Two layers:

* **Public API** (:class:`KVSender`, :class:`KVReceiver`, the handles in
  :mod:`kvtransfer.handles`): what the prefill and decode services use. Built by
  :func:`kvtransfer.create_sender` / :func:`kvtransfer.create_receiver`.
* **Transport SPI** (:class:`Transport`, :class:`Link`): connections, control messages and
  tagged data messages. Three implementations: UCX (:mod:`kvtransfer.ucx`, the only module
  that imports ``ucxx``), NIXL (:mod:`kvtransfer.nixl`: control over UCX, data by one-sided
  reads) and an in-process loopback (:mod:`kvtransfer.loopback`). The protocol state
  machines (:mod:`kvtransfer.sender`, :mod:`kvtransfer.receiver`) are written once against
  the SPI, so the loopback exercises exactly the code that runs over UCX and NIXL.

Every SPI method is called on the transport's reactor thread and every callback it makes runs
there too.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtransfer.geometry import KVGeometry
    from kvtransfer.handles import RecvHandle, SendHandle
    from kvtransfer.metrics import TransferCounters
    from kvtransfer.pool import Region
    from kvtransfer.protocol import ReceiverAddress
    from kvtransfer.reactor import Reactor


class TransferState(str, enum.Enum):
    """Lifecycle of one transfer as seen by one side.

    ``PENDING`` until a terminal state. A terminal state is entered only once no further byte
    of this transfer can be read from (sender) or written to (receiver) the pool.
    """

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self is not TransferState.PENDING


class FaultInjector:
    """Test hook consulted by the sender for each block it sends; the default injects nothing."""

    def corrupt(self, transfer_id: str, block_index: int) -> bool:
        """Return True to send block ``block_index`` with one byte flipped (checksum unchanged)."""
        return False


class CorruptBlocks(FaultInjector):
    """Corrupt exactly the listed ``(transfer_id, block_index)`` pairs."""

    def __init__(self, targets: set[tuple[str, int]]):
        self.targets = set(targets)

    def corrupt(self, transfer_id: str, block_index: int) -> bool:
        return (transfer_id, block_index) in self.targets


DataCallback = Callable[["BaseException | None"], None]


class Link(ABC):
    """One connection between a sender and a receiver (reactor thread only).

    The owner sets :attr:`on_ctrl` and :attr:`on_closed`, then calls :meth:`start`.
    :attr:`on_closed` is called exactly once, from a later reactor callback, when the connection
    fails or is closed (by the peer or by :meth:`close`); every data operation still outstanding
    then completes with an error, and operations started afterwards fail the same way.
    """

    on_ctrl: Callable[[bytes], None]
    on_closed: Callable[[BaseException], None]
    #: the largest control message accepted from the peer; a larger one closes the link (the
    #: receiver lowers it until the peer's hello is accepted)
    max_ctrl_bytes: int = 16 << 20  # protocol.MAX_CTRL_BYTES

    @property
    @abstractmethod
    def alive(self) -> bool: ...

    @abstractmethod
    def start(self) -> None:
        """Begin delivering control messages to :attr:`on_ctrl`."""

    @abstractmethod
    def send_ctrl(self, payload: bytes) -> None:
        """Send one control message (ordered, reliable); failures surface via :attr:`on_closed`."""

    @abstractmethod
    def send_data(self, tag: int, region: Region, done: DataCallback) -> None:
        """Send ``region``'s bytes as the data message ``tag``; ``done(error)`` on completion.

        ``region`` must stay untouched until ``done`` runs.
        """

    @abstractmethod
    def recv_data(self, tag: int, region: Region | None, done: DataCallback) -> None:
        """Receive the data message ``tag`` into ``region`` (``None``: read and discard it)."""

    @abstractmethod
    def close(self) -> None:
        """Close the connection; idempotent. Outstanding operations complete with errors."""


class Transport(ABC):
    """Connections of one kind (UCX or loopback), driven by one :class:`Reactor`."""

    kind: str
    reactor: Reactor
    #: Data messages up to this size travel eagerly (no rendezvous); 0 when not applicable.
    eager_limit: int = 0

    @abstractmethod
    def listen(
        self,
        host: str,
        port: int,
        on_accept: Callable[[Link], None],
        bind_host: str | None = None,
    ) -> tuple[str, int]:
        """Accept connections at ``host:port`` (port 0 picks one) arriving on ``bind_host``
        (default ``host``; a wildcard: any address); returns the address advertised."""

    def register_pool(self, region: Region) -> None:
        """Make ``region`` (a whole KV pool) available to the transport's data path before any
        link uses it (reactor thread). Transports that need no registration ignore it."""
        return None

    @abstractmethod
    def connect(self, address: ReceiverAddress) -> Link:
        """Start connecting; returns at once. A failed connect reports through ``on_closed``."""

    @abstractmethod
    def close(self) -> None:
        """Close every connection and the listener, then stop the reactor; idempotent, bounded."""


class KVSender(ABC):
    """Prefill side: pushes blocks of its pool into receivers' pools."""

    @abstractmethod
    def open(
        self, transfer_id: str, remote_address: bytes, dst_block_ids: list[int], timeout_s: float
    ) -> SendHandle: ...

    @abstractmethod
    def connect(self, remote_address: bytes, timeout_s: float = 5.0) -> None: ...

    @property
    @abstractmethod
    def stats(self) -> TransferCounters: ...

    @abstractmethod
    def close(self) -> None: ...


class KVReceiver(ABC):
    """Decode side: reserves pool blocks for a transfer and receives them in place."""

    @property
    @abstractmethod
    def address(self) -> bytes: ...

    @property
    @abstractmethod
    def geometry(self) -> KVGeometry: ...

    @abstractmethod
    def expect(self, transfer_id: str, block_ids: list[int], timeout_s: float) -> RecvHandle: ...

    @property
    @abstractmethod
    def stats(self) -> TransferCounters: ...

    @abstractmethod
    def close(self) -> None: ...
