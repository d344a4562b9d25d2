"""A NIXL agent for the KV transport: the only module of the project that imports NIXL.

:class:`NixlAgent` wraps NIXL's bindings (``nixl_cu12._bindings``, pinned to 1.5 in
``pyproject.toml``) with what :mod:`kvtransfer.nixl` needs: register memory, exchange agent
metadata, READ from a peer's registered memory, and poll the reads it started as a reactor
progress source. Reactor thread only, apart from NIXL's own progress thread, which runs at a
period of ``progress_us`` (NIXL's default polls without pause and took a whole core of these
2-core machines while idle).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvtransfer.errors import PeerLostError
from kvtransfer.pool import Region
from kvtransfer.ucx import USER_UCX_ENV

logger = logging.getLogger("kvtransfer")

#: How long the reactor busy-polls a read before it sleeps between polls (1 ms ticks).
_SPIN_S = 0.005
#: Period of NIXL's progress thread. This side's reads are polled by the reactor, and on one
#: host (CMA) or over RDMA a read needs nothing from the peer, so the thread mostly sets up
#: connections; over TCP it also serves the peer's reads of this pool, one period per step.
#: 1 ms cost the 2-core machines 10-20 % of 1P+1D throughput on long prompts (wake-ups taken
#: from the engines), 10 ms did not (docs/benchmarks.md); PDSERVE_NIXL_PROGRESS_US overrides.
DEFAULT_PROGRESS_US = 10000
PROGRESS_ENV = "PDSERVE_NIXL_PROGRESS_US"


def progress_us_from_env() -> int:
    """``PDSERVE_NIXL_PROGRESS_US`` if set (a positive integer), else the default."""
    raw = os.environ.get(PROGRESS_ENV, "").strip()
    if not raw:
        return DEFAULT_PROGRESS_US
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{PROGRESS_ENV}={raw!r}: expected a positive number of microseconds")
    return value


def nixl_bindings() -> Any:
    """NIXL's bindings (imported on first use; raises ImportError with the install hint)."""
    try:
        from nixl_cu12 import _bindings  # type: ignore[attr-defined]
    except ImportError as e:
        raise ImportError(
            "the 'nixl' KV transport needs NIXL: pip install 'pdserve[nixl]' (nixl-cu12)"
        ) from e
    return _bindings


@contextlib.contextmanager
def _user_ucx_environment() -> Iterator[None]:
    """The environment as the user set it, while NIXL's UCX reads its configuration: importing
    ucxx (the control link) sets UCX_* defaults of its own, and its UCX_RNDV_THRESH=8192 sends
    NIXL's reads through a rendezvous over TCP (9.4 ms for 8 MiB instead of 0.23 ms by CMA)."""
    injected = {
        k: os.environ.pop(k)
        for k in list(os.environ)
        if k.startswith("UCX_") and k not in USER_UCX_ENV
    }
    try:
        yield
    finally:
        os.environ.update(injected)


def buffer_location(region: Region) -> tuple[int, int, bool]:
    """(address, device id, is_cuda) of a region's buffer."""
    buf = region.buffer
    if region.is_cuda:
        return int(buf.data_ptr()), int(buf.device.index or 0), True
    return int(buf.__array_interface__["data"][0]), 0, False


@dataclass
class _Read:
    handle: Any
    callback: Callable[[BaseException | None], None]
    started: float


class NixlAgent:
    """One NIXL agent with the UCX backend (reactor thread only, apart from NIXL's own
    progress thread). Tracks the reads it started as a reactor progress source."""

    def __init__(self, name: str, progress_us: int):
        if progress_us < 1:
            raise ValueError(
                f"nixl_progress_us must be >= 1 (NIXL's reads need its progress thread), got {progress_us}"
            )
        nb = nixl_bindings()
        self._nb = nb
        config = nb.nixlAgentConfig()
        config.useProgThread = True
        config.useListenThread = False
        config.syncMode = nb.NIXL_THREAD_SYNC_NONE
        config.pthrDelay = progress_us
        config.captureTelemetry = False
        self.name = name
        with _user_ucx_environment():
            self.agent = nb.nixlAgent(name, config)
            self.agent.createBackend("UCX", {})
        self._ranges: list[tuple[int, int, bool, int, Any]] = []  # lo, hi, cuda, dev, reg list
        self._reads: dict[int, _Read] = {}
        self._keys = itertools.count()
        self._wake_at = 0.0
        self.reactor: Any = None

    # -- memory ------------------------------------------------------------------------

    def _seg(self, cuda: bool) -> Any:
        return self._nb.VRAM_SEG if cuda else self._nb.DRAM_SEG

    def register(self, addr: int, nbytes: int, dev: int, cuda: bool) -> Any:
        regs = self._nb.nixlRegDList(self._seg(cuda), [(addr, nbytes, dev, "")])
        self.agent.registerMem(regs, [])
        self._ranges.append((addr, addr + nbytes, cuda, dev, regs))
        return regs

    def deregister(self, regs: Any) -> None:
        self._ranges = [r for r in self._ranges if r[4] is not regs]
        try:
            self.agent.deregisterMem(regs, [])
        except Exception as e:  # noqa: BLE001  (NIXL raises one type per status)
            logger.debug("kvtransfer: NIXL deregistration failed: %s", e)

    def covers(self, addr: int, nbytes: int, dev: int, cuda: bool) -> bool:
        return any(
            lo <= addr and addr + nbytes <= hi and c == cuda and d == dev
            for lo, hi, c, d, _ in self._ranges
        )

    def metadata(self, regs: Any = None) -> bytes:
        """Full metadata (connection info and every registration), or the partial metadata
        of ``regs`` alone."""
        if regs is None:
            return bytes(self.agent.getLocalMD())
        return bytes(self.agent.getLocalPartialMD(regs, False, []))

    def load(self, metadata: bytes) -> str:
        name = self.agent.loadRemoteMD(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def forget(self, remote: str) -> None:
        try:
            self.agent.invalidateRemoteMD(remote)
        except Exception as e:  # noqa: BLE001  (NIXL raises one type per status)
            logger.debug("kvtransfer: NIXL invalidate %s: %s", remote, e)

    # -- reads (a reactor progress source) ------------------------------------------------

    def read(
        self,
        remote: str,
        dst: tuple[int, int, int, bool],
        src_addr: int,
        src_dev: int,
        callback: Callable[[BaseException | None], None],
    ) -> None:
        """READ ``dst[1]`` bytes at ``src_addr`` of ``remote`` into ``dst`` (addr, nbytes, dev,
        cuda); ``callback(error)`` runs on the reactor once no byte of it can land any more."""
        nb = self._nb
        addr, nbytes, dev, cuda = dst
        local = nb.nixlXferDList(self._seg(cuda), [(addr, nbytes, dev)])
        remote_l = nb.nixlXferDList(self._seg(cuda), [(src_addr, nbytes, src_dev)])
        handle = self.agent.createXferReq(nb.NIXL_READ, local, remote_l, remote, b"", [])
        try:
            status = self.agent.postXferReq(handle, b"")
        except BaseException:
            self._release(handle)
            raise
        if status == nb.NIXL_SUCCESS:
            self._release(handle)
            self.reactor.call_soon(callback, None)
            return
        self._reads[next(self._keys)] = _Read(handle, callback, time.monotonic())

    def _release(self, handle: Any) -> bool:
        """Release a request (cancelling it if in flight); False if NIXL could not."""
        try:
            self.agent.releaseXferReq(handle)
            return True
        except Exception as e:  # noqa: BLE001  (NIXL raises one type per status)
            logger.debug("kvtransfer: NIXL release: %s", e)
            return False

    @property
    def outstanding(self) -> int:
        return len(self._reads)

    def progress(self) -> bool:
        if not self._reads:
            return False
        nb = self._nb
        finished: list[tuple[_Read, BaseException | None]] = []
        for key, r in list(self._reads.items()):
            try:
                status = self.agent.getXferStatus(r.handle)
                if status == nb.NIXL_IN_PROG:
                    continue
                error: BaseException | None = None
                if status != nb.NIXL_SUCCESS:
                    error = PeerLostError(f"NIXL read failed: {status}")
            except Exception as e:  # noqa: BLE001  (NIXL raises one type per status)
                error = PeerLostError(f"NIXL read failed: {type(e).__name__}: {e}")
            if not self._release(r.handle):
                continue  # still active: poll again
            del self._reads[key]
            finished.append((r, error))
        for r, error in finished:
            try:
                r.callback(error)
            except Exception:
                logger.exception("kvtransfer: NIXL read callback failed")
        return bool(finished)

    def cancel(self, callback: Callable[[BaseException | None], None]) -> bool:
        """Cancel the read completing with ``callback``; True once it can no longer write (its
        callback then runs with a cancellation error). False while it is still in flight, or
        if NIXL refused to release it: then it stays polled and its callback runs when it ends.

        A read in flight is never released: NIXL's release returned success for one whose
        bytes still landed afterwards (over TCP, a read from a frozen peer went on once the
        peer ran again), after its transfer had settled and its blocks could belong to
        another request. A read ends by itself when its peer dies (UCX fails it)."""
        nb = self._nb
        for key, r in self._reads.items():
            if r.callback is callback:
                try:
                    if self.agent.getXferStatus(r.handle) == nb.NIXL_IN_PROG:
                        return False
                except Exception as e:  # noqa: BLE001  (NIXL raises one type per status)
                    logger.debug("kvtransfer: NIXL status of a cancelled read: %s", e)
                if not self._release(r.handle):
                    return False
                del self._reads[key]
                self.reactor.call_soon(callback, PeerLostError("read cancelled"))
                return True
        return True

    def arm(self) -> bool:
        if not self._reads:
            return True
        oldest = min(r.started for r in self._reads.values())
        now = time.monotonic()
        if now - oldest < _SPIN_S:
            return False  # a short read: poll again at once
        if self._wake_at <= now:  # no wake-up pending: poll again in 1 ms
            self._wake_at = now + 0.001
            self.reactor.call_later(0.001, _noop)
        return True

    def fileno(self) -> int:
        return -1  # polled, no event fd

    def close(self) -> None:
        for r in self._reads.values():
            self._release(r.handle)
        self._reads.clear()
        for *_, regs in list(self._ranges):
            self.deregister(regs)
        self.agent = None


def _noop() -> None:
    pass
