"""KV block transfer between prefill and decode workers (UCX, NIXL, or in-process loopback).

Typical use (decode worker D, prefill worker P)::

    # D, at startup
    receiver = create_receiver("ucx", kv_pool, geometry, host="10.0.0.5", metrics=metrics)
    # ... advertise receiver.address (bytes) in the PrefillRequest
    # D, per request, BEFORE calling P
    rh = receiver.expect(transfer_id, dst_block_ids, timeout_s=30)
    # poll rh.state from the engine loop; rh.wait()/await rh elsewhere

    # P, at startup
    sender = create_sender("ucx", kv_pool, geometry, metrics=metrics)
    # P, per request
    sh = sender.open(transfer_id, decode_kv_address, dst_block_ids, timeout_s=30)
    sh.send_blocks([src_block_a, src_block_b], first_index=0)   # as blocks complete
    sh.finish()                                                  # after the last block

The protocol is documented in ``docs/notes/kvtransfer.md``. Only :mod:`kvtransfer.ucx`
imports ``ucxx`` and only :mod:`kvtransfer.nixl_agent` imports NIXL, each only when a sender
or receiver of its kind is created.
"""

from __future__ import annotations

from typing import Any

from kvtransfer.base import (
    CorruptBlocks,
    FaultInjector,
    KVReceiver,
    KVSender,
    Link,
    TransferState,
    Transport,
)
from kvtransfer.errors import (
    ChecksumMismatchError,
    GeometryMismatchError,
    HandshakeError,
    IncompleteTransferError,
    InvalidAddressError,
    KVTransferError,
    PeerCancelledError,
    PeerLostError,
    PoolGeometryError,
    ProtocolError,
    StaleAddressError,
    TransferCancelledError,
    TransferRejectedError,
    TransferTimeoutError,
    TransportClosedError,
)
from kvtransfer.geometry import KVGeometry
from kvtransfer.handles import RecvHandle, SendHandle, TransferHandle
from kvtransfer.loopback import LoopbackNetwork
from kvtransfer.metrics import TransferCounters, TransferMetrics
from kvtransfer.receiver import Receiver
from kvtransfer.sender import Sender


def _make_transport(kind: str, opts: dict[str, Any], role: str) -> Transport:
    name = opts.pop("name", f"{kind}-{role}")
    if kind == "ucx":
        opts.pop("network", None)
        from kvtransfer.ucx import UcxTransport  # the only import of ucxx, deferred

        return UcxTransport(
            name=name,
            options=opts.pop("ucx_options", None),
            spin_us=opts.pop("progress_spin_us", 0.0),
        )
    if kind == "nixl":
        opts.pop("network", None)
        from kvtransfer.nixl import NixlTransport  # NIXL is imported only from here
        from kvtransfer.nixl_agent import progress_us_from_env

        progress_us = opts.pop("nixl_progress_us", None)
        return NixlTransport(
            name=name,
            options=opts.pop("ucx_options", None),
            spin_us=opts.pop("progress_spin_us", 0.0),
            progress_us=progress_us_from_env() if progress_us is None else progress_us,
        )
    if kind == "loopback":
        network = opts.pop("network", None)
        if network is None:
            raise TypeError(
                "create_*('loopback', ...) needs network=LoopbackNetwork() shared by both sides"
            )
        opts.pop("ucx_options", None)
        opts.pop("progress_spin_us", None)
        opts.pop("nixl_progress_us", None)
        from kvtransfer.loopback import LoopbackTransport

        return LoopbackTransport(network, name=name)
    raise ValueError(f"unknown transport kind {kind!r}; use 'ucx', 'nixl' or 'loopback'")


def create_sender(kind: str, pool: Any, geometry: KVGeometry, **opts: Any) -> Sender:
    """Build a sender over ``kind`` ("ucx" | "nixl" | "loopback") for ``pool`` (the prefill KV
    pool).

    Transport options: ``ucx_options`` (dict of UCX settings without the ``UCX_`` prefix;
    ``UCX_*`` environment variables win), ``progress_spin_us`` (busy-poll window of the I/O
    thread), ``nixl_progress_us`` (nixl only: period of NIXL's progress thread in µs, default
    ``PDSERVE_NIXL_PROGRESS_US`` or 10,000),
    ``network`` (loopback only, required), ``name``. Every other option goes to
    :class:`~kvtransfer.sender.Sender` (``checksums``, ``max_active_transfers``,
    ``max_inflight_messages``, ``max_message_bytes``, ``connect_timeout_s``,
    ``settle_timeout_s``, ``checksum_threads``, ``inline_checksum_bytes``, ``metrics``,
    ``fault_injector``).
    """
    transport = _make_transport(kind, opts, "sender")
    try:
        return Sender(transport, pool, geometry, **opts)
    except BaseException:
        transport.close()
        raise


def create_receiver(
    kind: str, pool: Any, geometry: KVGeometry, host: str = "127.0.0.1", port: int = 0, **opts: Any
) -> Receiver:
    """Build a receiver over ``kind`` listening on ``port`` (0: any), advertising ``host``.

    Transport options as for :func:`create_sender`; the rest go to
    :class:`~kvtransfer.receiver.Receiver` (``verify_checksums``, ``max_posted_receives``,
    ``settle_timeout_s``, ``checksum_threads``, ``inline_checksum_bytes``, ``metrics``).
    """
    transport = _make_transport(kind, opts, "receiver")
    try:
        return Receiver(transport, pool, geometry, host=host, port=port, **opts)
    except BaseException:
        transport.close()
        raise


__all__ = [
    "ChecksumMismatchError",
    "CorruptBlocks",
    "FaultInjector",
    "GeometryMismatchError",
    "HandshakeError",
    "IncompleteTransferError",
    "InvalidAddressError",
    "KVGeometry",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "Link",
    "LoopbackNetwork",
    "PeerCancelledError",
    "PeerLostError",
    "PoolGeometryError",
    "ProtocolError",
    "Receiver",
    "RecvHandle",
    "SendHandle",
    "Sender",
    "StaleAddressError",
    "TransferCancelledError",
    "TransferCounters",
    "TransferHandle",
    "TransferMetrics",
    "TransferRejectedError",
    "TransferState",
    "TransferTimeoutError",
    "Transport",
    "TransportClosedError",
    "create_receiver",
    "create_sender",
]
