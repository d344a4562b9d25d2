"""The lifecycle both ends of a transfer share: decide, wait for what still touches the pool,
finalize (reactor thread only).

1. :meth:`TransferEnd._decide` fixes the outcome once (DONE, FAILED or CANCELLED, with the
   error and the metrics reason) and tells the peer (each end its own way: the sender sends
   ``cancel``, the receiver ``fail``);
2. while the transfer is ``busy`` (sends, receives or checksum jobs still read or write its
   blocks) it waits; past ``settle_timeout_s`` with sends or receives still outstanding the end
   breaks the connection, which makes the transport complete them with errors (checksum jobs
   alone end by themselves: it waits for them);
3. :meth:`TransferEnd._finalize` then settles the handle: from that moment no byte of the
   transfer touches the pool (the contract the services' KV pins rely on), and the metrics,
   the live set and the id set drop it.

Subclasses (:class:`~kvtransfer.sender.Sender`, :class:`~kvtransfer.receiver.Receiver`)
provide the attributes listed on :class:`TransferEnd` and four hooks.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from kvtransfer.base import TransferState
from kvtransfer.errors import KVTransferError
from kvtransfer.metrics import TransferMetrics

logger = logging.getLogger("kvtransfer")

Outcome = tuple[TransferState, "KVTransferError | None", "str | None"]


class Transfer(Protocol):
    """What the lifecycle reads of a transfer record (``OutboundTransfer`` / ``InboundTransfer``)."""

    transfer_id: str
    handle: Any
    outcome: Outcome | None
    deadline_timer: Any
    settle_timer: Any

    @property
    def busy(self) -> bool: ...


class TransferEnd:
    """Mixin: the decide → settle → finalize lifecycle. Needs ``_direction`` ("send" |
    "recv"), ``_reactor``, ``_settle_timeout_s``, ``_metrics``, ``_live`` (records not yet
    settled), ``_lock`` and ``_ids`` (ids not yet terminal, shared with caller threads)."""

    _direction: str
    _reactor: Any
    _settle_timeout_s: float
    _metrics: TransferMetrics
    _live: set[Any]
    _lock: threading.Lock
    _ids: set[str]

    # ---- hooks -------------------------------------------------------------------------
    def _on_decided(self, t: Any, error: KVTransferError | None, *args: Any, **notify: Any) -> None:
        """The outcome was just fixed: stop queued work, tell the peer (``notify``: the end's
        own options; each end declares its own keywords, hence the gradual ``*args, **notify``)."""

    def _outstanding(self, t: Any) -> tuple[int, str] | None:
        """(operations still outstanding, the peer's name) to report when they do not settle,
        or None when there is no connection to break."""
        return None

    def _break_peer(self, t: Any) -> None:
        """Close the connection so that the outstanding operations complete with errors."""

    def _detach(self, t: Any) -> None:
        """Remove ``t`` from the connection's tables, just before its handle settles."""

    def _after_finalize(self, t: Any) -> None:
        """``t``'s handle is terminal and its id released."""

    # ---- the lifecycle -----------------------------------------------------------------
    def _decide(
        self,
        t: Any,
        state: TransferState,
        error: KVTransferError | None,
        reason: str | None,
        **notify: Any,
    ) -> None:
        """Fix the outcome of ``t`` (once); it settles once nothing touches its blocks."""
        if t.outcome is not None:
            return
        t.outcome = (state, error, reason)
        self._on_decided(t, error, **notify)
        if not t.busy:
            self._finalize(t)
        elif t.settle_timer is None:
            t.settle_timer = self._reactor.call_later(
                self._settle_timeout_s, self._on_settle_timeout, t
            )

    def _on_settle_timeout(self, t: Any) -> None:
        outstanding = self._outstanding(t)
        if t.handle.done or outstanding is None:
            return
        count, peer = outstanding
        if count == 0:
            # Only checksum jobs still read its blocks: local work that ends by itself (and
            # settles the transfer then). Breaking the connection would not end them sooner,
            # and would fail every other transfer on it.
            return
        logger.warning(
            "kvtransfer: %d %s operations of transfer %r did not settle within %.1fs; "
            "closing the connection with %s",
            count,
            self._direction,
            t.transfer_id,
            self._settle_timeout_s,
            peer,
        )
        self._break_peer(t)

    def _finalize(self, t: Any) -> None:
        if t.handle.done:
            return
        state, error, reason = t.outcome
        for timer in (t.deadline_timer, t.settle_timer):
            if timer is not None:
                timer.cancel()
        self._detach(t)
        self._live.discard(t)
        t.handle._settle(state, error)  # the handles' reactor-side API
        if state is TransferState.DONE:
            self._metrics.transfer_done(self._direction, t.handle.seconds)
        elif state is TransferState.CANCELLED:
            self._metrics.transfer_cancelled(self._direction)
        else:
            self._metrics.transfer_failed(self._direction, reason or "protocol")
        with self._lock:
            self._ids.discard(t.transfer_id)
        self._after_finalize(t)
