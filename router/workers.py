"""The router's view of the worker pools: registry snapshot, static overrides, local health.

A background task refreshes the snapshot from the Redis registry every
``refresh_interval_s`` (leases expire after a few seconds, so a dead worker leaves the snapshot
within one lease period). ``--decode-workers`` / ``--prefill-workers`` replace discovery for
their role: those addresses are matched to registry records when Redis knows them (so prefix
matching still works), otherwise polled with the gRPC ``Stats`` call. A worker whose call
failed is kept out of routing for ``cooldown_s`` even while its lease lives on. If Redis is
unreachable the last snapshot stays in use.

Also owns the gRPC channels (one per address, closed when the worker leaves and nothing is in
flight on it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import grpc

from shared.directory import (
    ROLE_DECODE,
    ROLE_PREFILL,
    DirectoryReader,
    WorkerInfo,
    WorkerLoad,
    WorkerRecord,
)
from shared.pauses import PauseLog
from shared.proto import pdserve_pb2 as pb
from shared.proto import pdserve_pb2_grpc as pb_grpc
from shared.proto.channel_options import CLIENT_OPTIONS
from shared.proto.mux import DEFAULT_STALL_TIMEOUT_S, MuxClient
from shared.security import ClusterSecurity

logger = logging.getLogger(__name__)

# keepalive (a frozen worker fails its streams within seconds) and short reconnect backoff
_CHANNEL_OPTIONS = CLIENT_OPTIONS
#: How long the pool keeps the state of a worker id the registry stopped listing.
FORGET_AFTER_S = 600.0


class WorkerPool:
    """Live, healthy workers per role, with in-flight counts and cooldowns. One per app."""

    def __init__(
        self,
        *,
        model: str,
        reader: DirectoryReader | None,
        static_decode: Sequence[str] = (),
        static_prefill: Sequence[str] = (),
        static_block_size: int = 16,
        refresh_interval_s: float = 0.5,
        cooldown_s: float = 5.0,
        rpc_timeout_s: float = 1.0,
        registry_grace_s: float = 3.0,
        security: ClusterSecurity | None = None,
        mux_stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
    ) -> None:
        if reader is None and not static_decode:
            raise ValueError("without a Redis registry, static decode workers are required")
        self.model = model
        self.reader = reader
        self.security = security or ClusterSecurity()
        self.static = {ROLE_DECODE: tuple(static_decode), ROLE_PREFILL: tuple(static_prefill)}
        self.static_block_size = static_block_size
        self.refresh_interval_s = refresh_interval_s
        self.cooldown_s = cooldown_s
        self.rpc_timeout_s = rpc_timeout_s
        self.registry_grace_s = registry_grace_s
        self.mux_stall_timeout_s = mux_stall_timeout_s  # --worker-stall-timeout
        self._role_empty_since: dict[str, float] = {}
        self._records: dict[str, WorkerRecord] = {}
        self._restarts: dict[str, int] = {}  # new generations seen per worker id
        self._cooldown: dict[str, float] = {}
        self._cooldown_gen: dict[str, str] = {}  # the generation that failed, where known
        self._inflight: dict[str, int] = {}
        self._inflight_by_address: dict[str, int] = {}
        self._backlog: dict[str, int] = {}  # worker id -> prompt tokens sent to prefill
        # requests this router saw leave each worker's queue (on a prefill worker: the
        # prefill's first token, failure or cancel; on a decode worker: the stream's end), and
        # the count at the refresh before the one that first saw the current load report: the
        # ones after it may still be counted as running/waiting in that report
        self._left: dict[str, int] = {}
        self._left_at_refresh: dict[str, int] = {}
        self._left_before_report: dict[str, int] = {}
        self._decoding: dict[str, int] = {}  # worker id -> streams past their first token
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, _MemberStub] = {}
        self._muxes: dict[str, MuxClient] = {}
        self._wrong_model: set[str] = set()
        # worker ids no longer registered -> since when: their state above is forgotten after
        # FORGET_AFTER_S with nothing in flight (workers restarted under new ids, replaced pods)
        self._gone_since: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        # this router's own pauses (SIGSTOP, a paused VM): a worker's call that failed because
        # the router did not run is not the worker's failure (``GenerationStream.events``)
        self.pauses = PauseLog()
        self._pause_task: asyncio.Task[None] | None = None
        self.last_refresh_ok: float | None = None
        self.last_error: str | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        await self.refresh()
        self._pause_task = asyncio.create_task(self.pauses.run(), name="router-pauses")
        self._task = asyncio.create_task(self._loop(), name="worker-pool-refresh")

    async def close(self) -> None:
        if self._pause_task is not None:
            self._pause_task.cancel()
            await asyncio.gather(self._pause_task, return_exceptions=True)
            self._pause_task = None
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if me is not None and me.cancelling():  # our caller's cancellation: pass it on
                    raise
            self._task = None
        channels, self._channels = self._channels, {}
        self._stubs.clear()
        muxes, self._muxes = self._muxes, {}
        await asyncio.gather(*(m.close() for m in muxes.values()), return_exceptions=True)
        await asyncio.gather(
            *(ch.close(grace=None) for ch in channels.values()), return_exceptions=True
        )

    async def _loop(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        while True:
            await asyncio.sleep(self.refresh_interval_s)
            try:
                await self.refresh()
            except Exception:  # never let the refresher die
                if task.cancelling():
                    raise asyncio.CancelledError from None
                logger.exception("worker refresh failed")
            # Python 3.11's asyncio.wait_for (redis-py's socket writes) swallows a cancellation
            # that lands as the inner write completes: honour it here, or close() waits forever
            if task.cancelling():
                raise asyncio.CancelledError

    async def refresh(self) -> None:
        """Re-read the registry (and poll static workers); keeps the old view on failure."""
        registry: list[WorkerRecord] | None = None
        if self.reader is not None:
            try:
                async with asyncio.timeout(self.rpc_timeout_s * 2):
                    registry = await self.reader.live_workers()
            except Exception as e:  # noqa: BLE001 - Redis down or slow: keep the last snapshot
                if self.last_error is None:
                    logger.warning(
                        "cannot read the worker registry (%r); using the last snapshot", e
                    )
                self.last_error = f"registry unavailable: {e!r}"
        if registry is None and self.reader is not None and not any(self.static.values()):
            return
        records: list[WorkerRecord] = []
        previous = [r for r in self._records.values() if r.generation]  # registry-backed only
        listed: set[str] = set()  # every id the registry lists, serving this model or not
        for r in registry if registry is not None else previous:
            listed.add(r.worker_id)
            if r.info.model != self.model:
                if r.worker_id not in self._wrong_model:
                    self._wrong_model.add(r.worker_id)
                    logger.warning(
                        "worker %s serves model %r, not %r; ignoring it",
                        r.worker_id,
                        r.info.model,
                        self.model,
                    )
                continue
            if not self.static[r.info.role] or r.info.grpc in self.static[r.info.role]:
                records.append(r)
        if registry is not None:
            records += self._bridge_wiped_roles(records)
        if any(self.static.values()):
            known = {r.info.grpc for r in records}
            polls = [
                self._poll_static(role, addr)
                for role, addrs in self.static.items()
                for addr in addrs
                if addr not in known
            ]
            records += [r for r in await asyncio.gather(*polls) if r is not None]
        for r in records:  # a new generation of a known worker: it restarted (or re-registered)
            old = self._records.get(r.worker_id)
            if old is not None and old.generation and r.generation != old.generation:
                self._restarts[r.worker_id] = self._restarts.get(r.worker_id, 0) + 1
                logger.info(
                    "worker %s registered again (generation %s, restart %d)",
                    r.worker_id,
                    r.generation,
                    self._restarts[r.worker_id],
                )
        for r in records:
            # a cooldown is for the process that failed: a new generation under the same id
            # (a restart; its registration says it serves) is routable at once (it was kept
            # out for up to --worker-cooldown: 503s when it is the only decode worker)
            failed_gen = self._cooldown_gen.get(r.worker_id)
            if failed_gen is not None and r.generation and r.generation != failed_gen:
                self._cooldown.pop(r.worker_id, None)
                self._cooldown_gen.pop(r.worker_id, None)
            old = self._records.get(r.worker_id)
            if old is None or (old.generation, old.seq) != (r.generation, r.seq) or not r.seq:
                self._left_before_report[r.worker_id] = self._left_at_refresh.get(r.worker_id, 0)
            self._left_at_refresh[r.worker_id] = self._left.get(r.worker_id, 0)
        self._records = {r.worker_id: r for r in records}
        if registry is not None or self.reader is None:
            self._forget_departed(listed | set(self._records))
            self.last_refresh_ok = time.monotonic()
            if self.last_error is not None and registry is not None:
                logger.info("worker registry reachable again")
            self.last_error = None
        await self._close_unused_channels()

    def _bridge_wiped_roles(self, records: list[WorkerRecord]) -> list[WorkerRecord]:
        """Registry-backed workers to keep although the registry no longer lists them.

        When a whole role vanishes at once (Redis restarted empty or was flushed, while the
        workers live on and re-register within a heartbeat), keep that role's previous
        workers for ``registry_grace_s`` instead of answering 503 meanwhile. A single worker
        that disappears is dropped at once, and failed calls still cool a worker down.
        """
        now = time.monotonic()
        kept: list[WorkerRecord] = []
        for role in (ROLE_DECODE, ROLE_PREFILL):
            if any(r.info.role == role for r in records):
                self._role_empty_since.pop(role, None)
                continue
            previous = [r for r in self._records.values() if r.info.role == role and r.generation]
            if not previous:
                continue
            since = self._role_empty_since.setdefault(role, now)
            if since == now:
                logger.warning(
                    "the registry lists no %s worker any more; keeping the last %d for "
                    "%.1f s in case Redis lost its data",
                    role,
                    len(previous),
                    self.registry_grace_s,
                )
            if now - since < self.registry_grace_s:
                kept += previous
        return kept

    async def _poll_static(self, role: str, address: str) -> WorkerRecord | None:
        stub_cls = pb_grpc.DecodeWorkerStub if role == ROLE_DECODE else pb_grpc.PrefillWorkerStub
        try:
            stats = await stub_cls(self.channel(address)).Stats(
                pb.StatsRequest(), timeout=self.rpc_timeout_s, metadata=self.security.call_metadata
            )
        except grpc.aio.AioRpcError as e:
            logger.debug("static %s worker %s: %s", role, address, e.code())
            return None
        wid = stats.worker_id or address
        info = WorkerInfo(
            worker_id=wid,
            role=role,
            model=self.model,
            grpc=address,
            block_size=self.static_block_size,
            num_blocks=stats.num_blocks,
        )
        return WorkerRecord(
            info, WorkerLoad(stats.free_blocks, stats.running, stats.waiting), "", 0
        )

    def _forget_departed(self, present: set[str]) -> None:
        """Drop the per-worker state of ids the registry stopped listing, once they have
        been gone ``FORGET_AFTER_S`` with nothing in flight (a worker that comes back sooner
        keeps its restart count and cooldown). Before, every id that ever served stayed in
        seven tables for the router's lifetime: with ids per process (the default) or per
        pod, a long-lived router's tables grew with every restart."""
        now = time.monotonic()
        for wid in present:
            self._gone_since.pop(wid, None)
        known = (
            set(self._restarts)
            | set(self._cooldown)
            | set(self._inflight)
            | set(self._left)
            | set(self._left_at_refresh)
            | self._wrong_model
        )
        for wid in known - present:
            since = self._gone_since.setdefault(wid, now)
            if now - since < FORGET_AFTER_S or self._inflight.get(wid):
                continue
            for table in (
                self._restarts,
                self._cooldown,
                self._cooldown_gen,
                self._inflight,
                self._left,
                self._left_at_refresh,
                self._left_before_report,
            ):
                table.pop(wid, None)
            self._wrong_model.discard(wid)
            del self._gone_since[wid]
        for a in [a for a, n in self._inflight_by_address.items() if not n]:
            if a not in self._channels:
                del self._inflight_by_address[a]

    async def _close_unused_channels(self) -> None:
        wanted = {r.info.grpc for r in self._records.values()}
        stale = [
            a for a in self._channels if a not in wanted and not self._inflight_by_address.get(a)
        ]
        for a in stale:
            ch = self._channels.pop(a)
            self._stubs.pop(a, None)
            mux = self._muxes.pop(a, None)
            if mux is not None:
                await mux.close()
            await ch.close(grace=None)

    # ---- queries --------------------------------------------------------------------------
    def restarts(self, worker_id: str) -> int:
        """How often this worker id came back with a new generation (a restart, or a lease
        that lapsed while it lived), as this router saw it."""
        return self._restarts.get(worker_id, 0)

    def records(self, role: str | None = None) -> list[WorkerRecord]:
        return [r for r in self._records.values() if role is None or r.info.role == role]

    def healthy(
        self, role: str, exclude: set[str] | frozenset[str] = frozenset()
    ) -> list[WorkerRecord]:
        """Live workers of ``role`` not cooling down after a failure and not in ``exclude``."""
        now = time.monotonic()
        return [
            r
            for r in self._records.values()
            if r.info.role == role
            and r.worker_id not in exclude
            and self._cooldown.get(r.worker_id, 0.0) <= now
        ]

    def inflight(self, worker_id: str) -> int:
        return self._inflight.get(worker_id, 0)

    def prefill_backlog(self, worker_id: str) -> int:
        return self._backlog.get(worker_id, 0)

    def decoding(self, worker_id: str) -> int:
        return self._decoding.get(worker_id, 0)

    def add_backlog(self, worker_id: str, tokens: int) -> None:
        """``tokens`` (negative to take back) of prompt sent to ``worker_id`` to prefill."""
        _adjust(self._backlog, worker_id, tokens)
        if tokens < 0 and self._role(worker_id) == ROLE_PREFILL:
            self._left[worker_id] = self._left.get(worker_id, 0) + 1

    def _role(self, worker_id: str) -> str | None:
        r = self._records.get(worker_id)
        return r.info.role if r is not None else None

    def reported_queue(self, record: WorkerRecord) -> tuple[int, int]:
        """A worker's reported (running, waiting), less the requests this router saw leave
        it since that report may have been taken: prefills that reached their first token,
        failed or were cancelled on a prefill worker; streams that ended on a decode worker.

        Reports lag up to a heartbeat plus a refresh (~1.5 s): without this, a prompt sent
        right after another one finished on an idle prefill worker saw it busy and was
        prefilled on the decode worker instead; and a decode worker that had just finished
        its only request still looked busy, so the next short prompt of a one-at-a-time
        client went through a prefill worker instead of the idle decode worker's own
        prefill (``policy.idle``). May undercount other routers' work by the requests that
        left within one refresh interval; the router's own counts are exact."""
        wid = record.worker_id
        gone = self._left.get(wid, 0) - self._left_before_report.get(wid, 0)
        running, waiting = record.load.running, record.load.waiting
        busy = max(0, running + waiting - gone)  # the policy weighs only the sum
        return min(running, busy), busy - min(running, busy)

    def add_decoding(self, worker_id: str, delta: int) -> None:
        _adjust(self._decoding, worker_id, delta)

    # ---- bookkeeping ------------------------------------------------------------------------
    def acquire(self, record: WorkerRecord) -> None:
        self._inflight[record.worker_id] = self._inflight.get(record.worker_id, 0) + 1
        a = record.info.grpc
        self._inflight_by_address[a] = self._inflight_by_address.get(a, 0) + 1

    def release(self, record: WorkerRecord) -> None:
        wid, a = record.worker_id, record.info.grpc
        if record.info.role == ROLE_DECODE:
            self._left[wid] = self._left.get(wid, 0) + 1
        self._inflight[wid] = max(0, self._inflight.get(wid, 0) - 1)
        self._inflight_by_address[a] = max(0, self._inflight_by_address.get(a, 0) - 1)

    def mark_failed(
        self,
        worker_id: str,
        reason: str,
        cooldown_s: float | None = None,
        generation: str | None = None,
    ) -> None:
        """Keep ``worker_id`` out of routing for a while (its lease may outlive it); only the
        incarnation ``generation`` (the record the failed call went to; by default the one
        known now): a new one that registers under the same id ends the cooldown."""
        if generation is None and (known := self._records.get(worker_id)) is not None:
            generation = known.generation
        if generation:
            self._cooldown_gen[worker_id] = generation
        else:
            self._cooldown_gen.pop(worker_id, None)
        logger.warning(
            "worker %s failed (%s); cooling down for %.1f s",
            worker_id,
            reason,
            self.cooldown_s if cooldown_s is None else cooldown_s,
        )
        self._cooldown[worker_id] = time.monotonic() + (
            self.cooldown_s if cooldown_s is None else cooldown_s
        )

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self.security.aio_channel(address, _CHANNEL_OPTIONS)
            self._channels[address] = ch
        return ch

    def decode_stub(self, address: str) -> Any:
        """A DecodeWorker stub whose every call carries the cluster token."""
        stub = self._stubs.get(address)
        if stub is None:
            # grpc_tools generates the stub's __init__ without annotations
            raw = pb_grpc.DecodeWorkerStub(self.channel(address))  # type: ignore[no-untyped-call]
            stub = self._stubs[address] = _MemberStub(raw, self.security.call_metadata)
        return stub

    def decode_mux(self, address: str) -> MuxClient:
        """The shared ``GenerateMux`` call to the decode worker at ``address`` (it carries
        every request this router streams from it; ``shared/proto/mux.py``)."""
        mux = self._muxes.get(address)
        if mux is None:
            stub = self.decode_stub(address)  # its calls carry the cluster token
            mux = self._muxes[address] = MuxClient(
                lambda: stub.GenerateMux(None),
                address,
                stall_timeout_s=self.mux_stall_timeout_s,
                pauses=self.pauses,
            )
        return mux


class _MemberStub:
    """A generated stub whose calls all carry ``metadata`` (the cluster token)."""

    def __init__(self, stub: Any, metadata: tuple[tuple[str, str], ...]):
        self._stub = stub
        self._metadata = metadata

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        if not self._metadata:
            return method
        md = self._metadata

        def call(request: Any, **kw: Any) -> Any:
            return method(request, metadata=md, **kw)

        return call


def _adjust(counts: dict[str, int], key: str, delta: int) -> None:
    """Add ``delta`` to ``counts[key]``, dropping the key when it reaches zero."""
    n = counts.get(key, 0) + delta
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)
