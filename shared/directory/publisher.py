"""The worker side of the directory: mirror the prefix cache's KV events into Redis."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import redis

from shared.directory.lease import WorkerLease
from shared.directory.mirror import EMIT_LUA, EVENTS_MAXLEN, entry_fields
from shared.directory.records import REDIS_ERRORS, ErrorLog, logger, make_member
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

_MAX_OPS_PER_PIPELINE = 10_000

# Write the step sequence number only while the lease exists (never resurrect an expired hash).
_SET_SEQ_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('HSET', KEYS[1], 'seq', ARGV[1]) end
return -1
"""


class KVEventPublisher:
    """Mirrors a worker's prefix cache into the directory, one transaction per engine step.

    Keeps the set of blocks the worker holds (from the events) and the changes Redis has not
    confirmed yet. ``publish`` merges a step's events, then flushes every pending change in one
    MULTI/EXEC (split only beyond 10k commands) together with the step's sequence number and
    one entry per member on the model's event stream (which routers' mirrors follow).
    SADD/SREM are idempotent, so re-sending a change after an unknown outcome is always safe.
    When Redis is down the changes stay pending (call ``publish([])`` periodically to retry);
    past ``max_pending`` changes the publisher starts a new generation and republishes the
    held set instead, so memory stays bounded. Thread-safe; never raises for Redis errors.
    """

    def __init__(
        self, client: redis.Redis, lease: WorkerLease, *, max_pending: int = 1 << 20
    ) -> None:
        self.client = client
        self.lease = lease
        self.keys = lease.keys
        self.model = lease.info.model
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._held: set[bytes] = set()
        self._pending: dict[bytes, bool] = {}  # hash -> should be present
        self._in_redis: set[bytes] = set()  # hashes that may be present under _generation
        self._generation: str | None = None
        self._seq = 0
        self._set_seq = client.register_script(_SET_SEQ_LUA)
        self._emit = client.register_script(EMIT_LUA)
        self._stream = self.keys.events(self.model)
        self._counter = self.keys.events_counter(self.model)
        self._errors = ErrorLog(f"kv events {lease.info.worker_id}")

    @property
    def seq(self) -> int:
        return self._seq

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def publish(self, events: Sequence[KVEvent]) -> bool:
        """Apply one engine step's events; True when Redis now mirrors the held set."""
        with self._lock:
            for ev in events:
                self._apply(ev)
            self._seq += 1
            if len(self._pending) > self.max_pending:
                logger.warning(
                    "%d directory changes pending; starting a new generation", len(self._pending)
                )
                self.lease.renew_generation()
            return self._flush()

    def clear(self) -> bool:
        """Remove every member this worker published (graceful shutdown, before deregister)."""
        return self.publish([AllBlocksCleared()])

    def _apply(self, ev: KVEvent) -> None:
        if isinstance(ev, BlockStored):
            for h in ev.block_hashes:
                self._held.add(h)
                self._pending[h] = True
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                self._held.discard(h)
                if h in self._in_redis:
                    self._pending[h] = False
                else:
                    self._pending.pop(h, None)
        elif isinstance(ev, AllBlocksCleared):
            self._held.clear()
            self._pending = dict.fromkeys(self._in_redis, False)
        else:
            raise TypeError(f"not a KV event: {ev!r}")

    def _flush(self) -> bool:
        if not self.lease.registered:
            return False  # nothing is readable before the lease exists; keep it pending
        gen = self.lease.generation
        stale_member: str | None = None
        stale_hashes: set[bytes] = set()
        if gen != self._generation:  # first flush, or lease lost: republish under the new one
            if self._generation is not None:
                stale_member = make_member(self.lease.info.worker_id, self._generation)
            stale_hashes = self._in_redis
            self._pending = dict.fromkeys(self._held, True)
            self._in_redis = set()
            self._generation = gen
        member = make_member(self.lease.info.worker_id, gen)
        ops: list[tuple[bool, bytes, str]] = []  # (add, block hash, member)
        if stale_member is not None:
            ops += [(False, h, stale_member) for h in stale_hashes]
        ops += [(present, h, member) for h, present in self._pending.items()]
        try:
            for start in range(0, max(len(ops), 1), _MAX_OPS_PER_PIPELINE):
                pipe = self.client.pipeline(transaction=True)
                chunk = ops[start : start + _MAX_OPS_PER_PIPELINE]
                changes: dict[str, tuple[list[bytes], list[bytes]]] = {}
                for add, h, m in chunk:
                    key = self.keys.block(self.model, h)
                    if add:
                        pipe.sadd(key, m)
                    else:
                        pipe.srem(key, m)
                    changes.setdefault(m, ([], []))[0 if add else 1].append(h)
                # the same changes, appended to the model's event stream (routers' mirrors)
                for m, (added, removed) in changes.items():
                    self._emit(
                        keys=[self._stream, self._counter],
                        args=[EVENTS_MAXLEN, *entry_fields(m, added, removed)],
                        client=pipe,
                    )
                if start + _MAX_OPS_PER_PIPELINE >= len(ops):
                    self._set_seq(
                        keys=[self.keys.worker(self.lease.info.worker_id)],
                        args=[self._seq],
                        client=pipe,
                    )
                pipe.execute()
        except REDIS_ERRORS as e:
            self._errors.failed(e)
            self._in_redis.update(h for h, present in self._pending.items() if present)
            return False
        self._errors.ok()
        for h, present in self._pending.items():
            if present:
                self._in_redis.add(h)
            else:
                self._in_redis.discard(h)
        self._pending.clear()
        return True
