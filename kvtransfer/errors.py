"""Named exceptions of the KV transfer layer.

Every transfer that does not end in ``DONE`` carries one of these in ``handle.error``; calls
given bad input raise one synchronously. All derive from :class:`KVTransferError`.
"""

from __future__ import annotations


class KVTransferError(Exception):
    """Base class of every error raised or reported by ``kvtransfer``."""


class TransferTimeoutError(KVTransferError):
    """The transfer did not complete before its deadline."""


class TransferCancelledError(KVTransferError):
    """The transfer was cancelled on this side (``handle.cancel()``)."""


class PeerCancelledError(KVTransferError):
    """The other side cancelled the transfer."""


class ChecksumMismatchError(KVTransferError):
    """A received block's xxh3_64 differs from the checksum the sender computed.

    ``block_index`` is the position in the transfer's block list (not a pool block id).
    """

    def __init__(self, transfer_id: str, block_index: int, expected: int, actual: int | None):
        self.transfer_id = transfer_id
        self.block_index = block_index
        self.expected = expected
        self.actual = actual
        got = "unknown (reported by the receiver)" if actual is None else f"{actual:#018x}"
        super().__init__(
            f"transfer {transfer_id!r}: checksum mismatch at block index {block_index}: "
            f"sender computed {expected:#018x}, receiver got {got}"
        )


class PeerLostError(KVTransferError):
    """The connection to the peer failed or closed (peer process died, network error)."""


class HandshakeError(KVTransferError):
    """The connect-time handshake failed (timeout, refusal, malformed reply)."""


class GeometryMismatchError(HandshakeError):
    """The two sides' KV geometries (or checksum settings) differ; the message names both values."""


class StaleAddressError(HandshakeError):
    """The receiver at this address is a different instance than the one that issued it."""


class ProtocolError(KVTransferError):
    """A control message was malformed or not valid in the current state."""


class TransferRejectedError(KVTransferError):
    """The receiver rejected the transfer (unknown id, different block list, bad header).

    ``code`` is the receiver's machine-readable reason (see docs/notes/kvtransfer.md).
    """

    def __init__(self, code: str, reason: str):
        self.code = code
        self.reason = reason
        super().__init__(f"receiver rejected the transfer ({code}): {reason}")


class IncompleteTransferError(KVTransferError, ValueError):
    """``finish()`` was called before every destination position was queued."""


class InvalidAddressError(KVTransferError, ValueError):
    """A receiver address could not be decoded."""


class PoolGeometryError(KVTransferError, ValueError):
    """The KV pool tensor does not match the declared :class:`KVGeometry`."""


class TransportClosedError(KVTransferError):
    """The sender or receiver was closed while the transfer was running."""
