"""Per-block checksums computed off the I/O thread.

Hashing a coalesced run (megabytes, or a device-to-host copy first for CUDA pools) would stall
every transfer sharing the reactor, so :class:`Checksummer` runs ``PoolView.checksums`` on a
small thread pool (xxhash releases the GIL) and hands each result back on the reactor thread.
Small host regions (up to ``inline_bytes``, 1 MiB by default) are hashed in place instead:
two thread hand-offs cost more than hashing them.
The sender hashes a run while UCX moves it; the receiver verifies one message while the next
arrives.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from kvtransfer.pool import PoolView, Region
from kvtransfer.reactor import Reactor

ChecksumCallback = Callable[["list[int] | None", "BaseException | None"], None]


class Checksummer:
    """xxh3_64 of each block of a region, computed on ``threads`` worker threads.

    :meth:`submit` is called on the reactor thread; ``callback(checksums, error)`` runs there
    too. The region must stay valid until the callback has run.
    """

    def __init__(
        self, pool: PoolView, reactor: Reactor, threads: int = 1, inline_bytes: int = 1 << 20
    ):
        if threads < 1:
            raise ValueError("checksum threads must be >= 1")
        self._pool = pool
        self._inline_bytes = inline_bytes
        self._reactor = reactor
        self._executor = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix=f"{reactor.name}-xxh3"
        )

    def inline(self, region: Region) -> bool:
        """True when hashing ``region`` on the I/O thread is cheaper than a thread hand-off
        (small host regions); the caller then calls :meth:`compute` directly."""
        return not region.is_cuda and region.nbytes <= self._inline_bytes

    def compute(self, region: Region) -> list[int]:
        return self._pool.checksums(region)

    def submit(self, region: Region, callback: ChecksumCallback) -> None:
        future = self._executor.submit(self._pool.checksums, region)
        future.add_done_callback(
            lambda f: self._reactor.call_soon_threadsafe(_deliver, f, callback)
        )

    def close(self) -> None:
        """Wait for running jobs (each hashes one region) and stop the threads."""
        self._executor.shutdown(wait=True, cancel_futures=True)


def _deliver(future: Future[list[int]], callback: ChecksumCallback) -> None:
    if future.cancelled():
        callback(None, RuntimeError("checksum job cancelled"))
    elif future.exception() is not None:
        callback(None, future.exception())
    else:
        callback(future.result(), None)
