"""Handles returned by ``sender.open`` and ``receiver.expect``.

A handle is read from any thread without blocking (``state``, ``error``, byte and block
counters), waited on with :meth:`TransferHandle.wait` (threads) or ``await handle`` (asyncio),
and cancelled with :meth:`TransferHandle.cancel`. Its fields are written only by the transport's
reactor thread; the engine-facing calls (``send_blocks``, ``finish``, ``cancel``) validate their
input on the caller's thread, enqueue work for the reactor and return at once.
"""

from __future__ import annotations

import asyncio
import operator
import threading
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future
from typing import Any

from kvtransfer.base import TransferState
from kvtransfer.errors import IncompleteTransferError, KVTransferError
from kvtransfer.protocol import MAX_FIN_NOTE_BYTES


def as_int_list(values: Sequence[int], name: str, upper: int) -> list[int]:
    """Validate a list of block ids / positions: ints in ``[0, upper)``."""
    try:
        out = [int(v) for v in values]
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a sequence of ints") from None
    for orig, v in zip(values, out):
        if isinstance(orig, bool) or v != orig or not 0 <= v < upper:
            raise ValueError(f"{name} holds {orig!r}, not an int in [0, {upper})")
    return out


class TransferHandle:
    """Common part of :class:`SendHandle` and :class:`RecvHandle`."""

    def __init__(
        self,
        transfer_id: str,
        num_blocks: int,
        post: Callable[..., None],
        on_cancel: Callable[[Any], None],
    ):
        self.transfer_id = transfer_id
        self.num_blocks = num_blocks
        self.started_at = time.monotonic()
        self.finished_at: float | None = None
        self._state = TransferState.PENDING
        self._error: KVTransferError | None = None
        self._event = threading.Event()
        self._future: Future[TransferState] = Future()
        self._post = post  # enqueue work on the reactor thread (non-blocking)
        self._on_cancel = on_cancel
        self._checksums: list[int | None] = [None] * num_blocks

    @property
    def state(self) -> TransferState:
        """PENDING, then exactly one of DONE / FAILED / CANCELLED."""
        return self._state

    @property
    def error(self) -> KVTransferError | None:
        """Why the transfer did not complete; None while PENDING and when DONE."""
        return self._error

    @property
    def done(self) -> bool:
        """True once the state is terminal."""
        return self._state.terminal

    @property
    def seconds(self) -> float:
        """Time from open/expect to the terminal state (or to now while PENDING)."""
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        return end - self.started_at

    @property
    def checksums(self) -> list[int | None]:
        """xxh3_64 of each block in block order; None where not yet moved or checksums are off."""
        return list(self._checksums)

    def cancel(self) -> None:
        """Abandon the transfer (non-blocking); the state becomes CANCELLED once in-flight
        operations have settled. No effect on a terminal handle."""
        if not self._state.terminal:
            self._post(self._on_cancel, self)

    def wait(self, timeout: float | None = None) -> TransferState:
        """Block until terminal or ``timeout`` seconds passed; returns the state (never raises)."""
        self._event.wait(timeout)
        return self._state

    def raise_for_state(self) -> None:
        """Raise :attr:`error` if the transfer failed or was cancelled."""
        if self._error is not None:
            raise self._error

    def __await__(self) -> Generator[Any, None, TransferState]:
        """``await handle`` returns the terminal state without blocking the event loop. A
        waiter that gives up (a timeout, a cancelled task) leaves the handle's own future
        alone: ``wrap_future`` alone would cancel it, and the transfer could then never settle
        it (nor a later waiter see it)."""
        return asyncio.shield(asyncio.wrap_future(self._future)).__await__()

    # ---- reactor thread ----------------------------------------------------------------

    def _settle(self, state: TransferState, error: KVTransferError | None) -> None:
        if self._state.terminal:
            return
        self.finished_at = time.monotonic()
        self._error = error
        self._state = state
        self._event.set()
        self._future.set_result(state)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.transfer_id!r} {self._state.value} blocks={self.num_blocks}>"


class SendHandle(TransferHandle):
    """Prefill side of one transfer: queue source blocks as they are computed, then finish.

    Positions are indices into ``dst_block_ids`` (the receiver's pool block for each block of
    the transfer). Every position must be queued exactly once before :meth:`finish`.
    """

    def __init__(
        self,
        transfer_id: str,
        dst_block_ids: list[int],
        num_src_blocks: int,
        post: Callable[..., None],
        on_cancel: Callable[[Any], None],
        on_blocks: Callable[..., None],
        on_finish: Callable[..., None],
    ):
        super().__init__(transfer_id, len(dst_block_ids), post, on_cancel)
        self.dst_block_ids = tuple(dst_block_ids)
        self._num_src_blocks = num_src_blocks
        self._on_blocks = on_blocks
        self._on_finish = on_finish
        self._lock = threading.Lock()
        self._queued = bytearray(len(dst_block_ids))
        self._num_queued = 0
        self._finished = False
        self.bytes_sent = 0
        self.blocks_sent = 0

    def send_blocks(self, src_block_ids: Sequence[int], first_index: int) -> None:
        """Queue ``src_block_ids`` for positions ``first_index .. first_index + len - 1``.

        Non-blocking: the blocks go out from the reactor thread, adjacent ones coalesced into
        one message. The caller must not modify or free the source blocks until the handle is
        terminal, and their contents must be final in memory (on CUDA: producing stream
        synchronised). Raises ``ValueError``/``TypeError`` on ids outside the pool, positions
        outside the transfer, a position queued twice, or a call after :meth:`finish`. After
        the handle is terminal, valid calls are ignored.
        """
        src = as_int_list(src_block_ids, "src_block_ids", self._num_src_blocks)
        if isinstance(first_index, bool):
            raise TypeError("first_index must be an int, got a bool")
        first_index = operator.index(first_index)
        n = len(self.dst_block_ids)
        if first_index < 0 or first_index + len(src) > n:
            raise ValueError(
                f"positions [{first_index}, {first_index + len(src)}) outside transfer of {n} blocks"
            )
        if not src:
            return
        with self._lock:
            if self._finished:
                raise ValueError(f"transfer {self.transfer_id!r}: send_blocks() after finish()")
            positions = range(first_index, first_index + len(src))
            dup = [i for i in positions if self._queued[i]]
            if dup:
                raise ValueError(
                    f"transfer {self.transfer_id!r}: positions {dup[:8]} already queued"
                )
            for i in positions:
                self._queued[i] = 1
            self._num_queued += len(src)
        if not self._state.terminal:
            self._post(self._on_blocks, self, src, first_index)

    def finish(self, note: bytes = b"") -> None:
        """Declare that every position has been queued (non-blocking); idempotent (a later
        call's ``note`` is ignored).

        ``note`` (at most ``MAX_FIN_NOTE_BYTES``) reaches the receiver's handle
        (:attr:`RecvHandle.note`) with the transfer's end, before it turns DONE. Raises
        :class:`IncompleteTransferError` if some position was never queued.
        """
        if not isinstance(note, bytes) or len(note) > MAX_FIN_NOTE_BYTES:
            raise ValueError(f"note must be at most {MAX_FIN_NOTE_BYTES} bytes")
        with self._lock:
            if self._finished:
                return
            if self._num_queued != len(self.dst_block_ids):
                missing = [i for i, q in enumerate(self._queued) if not q]
                raise IncompleteTransferError(
                    f"transfer {self.transfer_id!r}: finish() with {len(missing)} of "
                    f"{len(self.dst_block_ids)} positions never queued (first: {missing[:8]})"
                )
            self._finished = True
        if not self._state.terminal:
            self._post(self._on_finish, self, note)


class RecvHandle(TransferHandle):
    """Decode side of one transfer: ``block_ids`` of this pool are filled in place.

    ``blocks_done`` counts blocks received *and* verified. Once the state is terminal, no byte
    of this transfer will be written to the pool any more.
    """

    def __init__(
        self,
        transfer_id: str,
        block_ids: list[int],
        post: Callable[..., None],
        on_cancel: Callable[[Any], None],
    ):
        super().__init__(transfer_id, len(block_ids), post, on_cancel)
        self.block_ids = tuple(block_ids)
        self.bytes_received = 0
        self.blocks_done = 0
        #: the sender's ``finish(note)`` bytes; set (reactor thread) before the handle turns DONE
        self.note = b""
