"""Transfer metrics: plain counters for the services, Prometheus series when a registry is given.

One :class:`TransferMetrics` per worker (shared by its sender and receiver) registers, in the
registry it is given and nowhere else:

* ``pdserve:kv_transfer_bytes_total{direction}``: block bytes moved (counted per data message);
* ``pdserve:kv_transfer_seconds{direction}``: histogram of transfer durations, successful ones;
* ``pdserve:kv_transfer_failures_total{direction,reason}``: transfers that ended FAILED;
* ``pdserve:kv_transfer_checksum_mismatches_total{direction}``: blocks whose checksum differed;
* ``pdserve:kv_transfer_transfers_total{direction}``: transfers that ended DONE.

``direction`` is ``send`` or ``recv``. Counters are only written on a transport's I/O thread;
reading the plain attributes from any thread is safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Histogram buckets (seconds) for transfer durations: sub-millisecond to a minute.
SECONDS_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

#: ``reason`` label values of the failures counter.
FAILURE_REASONS = (
    "timeout",
    "checksum",
    "peer_lost",
    "handshake",
    "rejected",
    "protocol",
    "peer_cancelled",
    "closed",
)


@dataclass
class TransferCounters:
    """Running totals for one direction; plain attributes for the services to export."""

    transfers_total: int = 0  # transfers that ended DONE
    bytes_total: int = 0  # block bytes moved, successful or not
    seconds_total: float = 0.0  # summed duration of DONE transfers
    failures_total: int = 0  # transfers that ended FAILED
    cancelled_total: int = 0  # transfers cancelled locally (not failures)
    checksum_mismatches_total: int = 0  # blocks whose checksum did not match


class TransferMetrics:
    """Counters per direction, mirrored into Prometheus when ``registry`` is not None.

    Pass the same instance to a worker's sender and receiver; creating two instances on one
    registry raises ``ValueError`` (duplicate series), as prometheus_client does.
    """

    def __init__(self, registry: Any | None = None):
        self.send = TransferCounters()
        self.recv = TransferCounters()
        self._prom: dict[str, Any] | None = None
        if registry is not None:
            from prometheus_client import Counter, Histogram

            self._prom = {
                "bytes": Counter(
                    "pdserve:kv_transfer_bytes",
                    "KV block bytes moved by the transfer layer.",
                    ["direction"],
                    registry=registry,
                ),
                "seconds": Histogram(
                    "pdserve:kv_transfer_seconds",
                    "Duration of successful KV transfers.",
                    ["direction"],
                    buckets=SECONDS_BUCKETS,
                    registry=registry,
                ),
                "failures": Counter(
                    "pdserve:kv_transfer_failures",
                    "KV transfers that failed.",
                    ["direction", "reason"],
                    registry=registry,
                ),
                "mismatches": Counter(
                    "pdserve:kv_transfer_checksum_mismatches",
                    "KV blocks whose xxh3 checksum did not match.",
                    ["direction"],
                    registry=registry,
                ),
                "transfers": Counter(
                    "pdserve:kv_transfer_transfers",
                    "KV transfers that completed.",
                    ["direction"],
                    registry=registry,
                ),
            }

    def counters(self, direction: str) -> TransferCounters:
        if direction not in ("send", "recv"):
            raise ValueError(f"direction must be 'send' or 'recv', got {direction!r}")
        return self.send if direction == "send" else self.recv

    def add_bytes(self, direction: str, nbytes: int) -> None:
        self.counters(direction).bytes_total += nbytes
        if self._prom:
            self._prom["bytes"].labels(direction).inc(nbytes)

    def transfer_done(self, direction: str, seconds: float) -> None:
        c = self.counters(direction)
        c.transfers_total += 1
        c.seconds_total += seconds
        if self._prom:
            self._prom["transfers"].labels(direction).inc()
            self._prom["seconds"].labels(direction).observe(seconds)

    def transfer_failed(self, direction: str, reason: str) -> None:
        if reason not in FAILURE_REASONS:
            raise ValueError(f"unknown failure reason {reason!r}")
        self.counters(direction).failures_total += 1
        if self._prom:
            self._prom["failures"].labels(direction, reason).inc()

    def transfer_cancelled(self, direction: str) -> None:
        self.counters(direction).cancelled_total += 1

    def checksum_mismatches(self, direction: str, blocks: int) -> None:
        self.counters(direction).checksum_mismatches_total += blocks
        if self._prom:
            self._prom["mismatches"].labels(direction).inc(blocks)
