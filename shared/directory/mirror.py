"""The router's in-process copy of the prefix directory, kept current from a Redis stream.

Every directory write a worker makes (``publisher.py``) also appends one entry to the model's
event stream ``{p}kvev:{model}`` in the same MULTI/EXEC: the member, the block hashes it added
and removed (hex, concatenated). A server-side script numbers the entries from the counter
``{p}kvevn:{model}`` as it appends them, so the numbers have no holes and a reader can tell
when it missed one. :class:`DirectoryMirror` loads the block sets once (``SCAN``), then tails the
stream with a blocking ``XREAD`` and applies each entry, so a routing decision reads a local
dict instead of making a round trip to Redis (``DirectoryReader.prefix_match``).

Consistency. A resync first appends a marker entry (number ``n0`` at id ``L``), then reads every
block set, then replays the stream from ``L``. Each entry sets (block, member) pairs to present
or absent, and the last entry touching a pair wins, so replaying everything after ``L`` onto a
snapshot taken after ``L`` gives the current state whatever the snapshot saw of those entries.
The stream is trimmed (``MAXLEN ~``): a reader that falls behind the trim sees a hole in the
numbers (or, right after the snapshot, finds its marker gone) and resyncs. A counter that goes
back (Redis restarted empty) does the same. Until the first sync completes, and while a resync
runs, :meth:`DirectoryMirror.prefix_match` returns ``None`` and the caller asks Redis instead.

Members are ``{worker_id}:{generation}`` as in the block sets; lookups count only the members
the caller says are live, as the Redis-side scan does. Entries of stale members are not written
when the janitor removes them, so the mirror drops members that have been neither live nor
written for a while (:meth:`prune`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis

from shared.directory.reader import PrefixMatch
from shared.directory.records import REDIS_ERRORS, DirectoryKeys, logger, make_member
from shared.hashing import HASH_BYTES

#: entries kept in a model's event stream (approximately: ``XADD MAXLEN ~``)
EVENTS_MAXLEN = 10_000

# Append one entry to the event stream, numbered from the counter. KEYS[1] the stream, KEYS[2]
# the counter; ARGV[1] MAXLEN, then field/value pairs. Returns {number, id}.
EMIT_LUA = """
local n = redis.call('INCR', KEYS[2])
local args = {KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'n', n}
for i = 2, #ARGV do args[#args + 1] = ARGV[i] end
local id = redis.call('XADD', unpack(args))
return {n, id}
"""


def entry_fields(member: str, added: Iterable[bytes], removed: Iterable[bytes]) -> list[str]:
    """The field/value pairs of one event entry (the ARGV tail of :data:`EMIT_LUA`)."""
    return ["m", member, "a", b"".join(added).hex(), "r", b"".join(removed).hex()]


class _Resync(Exception):
    """The mirror lost track of the stream; load it again."""


class _TrimmedDuringLoad(_Resync):
    """More entries came during a load than the stream keeps: load again after a pause."""


class DirectoryMirror:
    """A local copy of one model's block sets, fed by the directory's event stream.

    ``client`` must allow commands that block for ``block_ms`` (its socket timeout longer) and
    should be its own connection pool (``XREAD BLOCK`` holds a connection). Run :meth:`run` as a
    task; cancel it to stop. ``live_members`` (optional) returns the members currently live, for
    :meth:`prune`.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        keys: DirectoryKeys,
        model: str,
        *,
        live_members: Callable[[], set[str] | None] | None = None,
        block_ms: int = 1000,
        batch: int = 1000,
        scan_count: int = 1000,
        prune_interval_s: float = 30.0,
        retry_s: float = 1.0,
    ) -> None:
        self.client = client
        self.keys = keys
        self.model = model
        self.stream = keys.events(model)
        self.counter = keys.events_counter(model)
        self.live_members = live_members
        self.block_ms = block_ms
        self.batch = batch
        self.scan_count = scan_count
        self.prune_interval_s = prune_interval_s
        self.retry_s = retry_s
        self._emit = client.register_script(EMIT_LUA)
        # block hash -> members holding it: a tuple (of str), which the cyclic collector stops
        # tracking, not a set, which it walks at every full collection (150k sets: 20 ms of
        # the router's event loop per collection; as tuples 2 ms)
        self._blocks: dict[bytes, tuple[str, ...]] = {}
        self._by_member: dict[str, set[bytes]] = {}  # member -> block hashes
        self._touched: dict[str, float] = {}  # member -> when last written or loaded
        self._synced = False
        self._last_id = "0-0"
        self._last_n = 0
        self._was_behind = False  # the last idle read found the counter ahead
        self._pruned_at = time.monotonic()
        self.resyncs = 0  # completed loads
        self.entries = 0  # entries applied
        self.last_error: str | None = None

    # ---- reading ------------------------------------------------------------------------
    @property
    def synced(self) -> bool:
        return self._synced

    @property
    def position(self) -> int:
        """Number of the last event applied (0 before the first load)."""
        return self._last_n

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def prefix_match(
        self, block_hashes: Sequence[bytes], live: Mapping[str, str]
    ) -> PrefixMatch | None:
        """Leading blocks of ``block_hashes`` each live worker holds (``live``: worker_id ->
        generation), as :meth:`DirectoryReader.prefix_match` computes it server-side; ``None``
        while the mirror is not in sync. ``stale`` is always empty (the janitor finds those)."""
        if not self._synced:
            return None
        counts = dict.fromkeys(live, 0)
        if not block_hashes or not live:
            return PrefixMatch(counts, [])
        owner = {make_member(wid, gen): wid for wid, gen in live.items()}
        active = list(owner)
        blocks = self._blocks
        stop = len(block_hashes)
        for i, h in enumerate(block_hashes):
            holders = blocks.get(h)
            if holders is None:
                stop = i
                break
            still = [m for m in active if m in holders]
            if len(still) != len(active):
                for m in active:
                    if m not in holders:
                        counts[owner[m]] = i
                active = still
                if not active:
                    break
        for m in active:
            counts[owner[m]] = stop
        return PrefixMatch(counts, [])

    # ---- keeping current ----------------------------------------------------------------
    async def run(self) -> None:
        """Load, then follow the stream; on any loss of track or Redis error, load again."""
        task = asyncio.current_task()
        assert task is not None
        while True:
            try:
                await self._resync()
                while True:
                    await self._tail_once()
                    # redis-py may swallow a cancellation that races a blocking read's own
                    # timeout (and retry the read): honour it here
                    if task.cancelling():
                        raise asyncio.CancelledError
                    self._maybe_prune()
            except asyncio.CancelledError:
                self._synced = False
                raise
            except Exception as e:
                self._synced = False
                if task.cancelling():  # a cancellation turned into a Redis error: stop anyway
                    raise asyncio.CancelledError from e
                await self._failed(e)

    async def _failed(self, e: Exception) -> None:
        """Log why the mirror lost track; wait before loading again unless it only fell
        behind the stream."""
        if isinstance(e, _Resync):
            logger.info("directory mirror: %s; loading it again", e)
            if isinstance(e, _TrimmedDuringLoad):
                await asyncio.sleep(self.retry_s)
            return
        if isinstance(e, REDIS_ERRORS):
            if self.last_error is None:
                logger.warning(
                    "directory mirror: Redis unavailable (%r); routing asks Redis directly", e
                )
            self.last_error = repr(e)
        else:  # never let the mirror die: fall back and start over
            logger.error("directory mirror failed; loading it again", exc_info=e)
        await asyncio.sleep(self.retry_s)

    async def _resync(self) -> None:
        self._synced = False
        n0, marker = await self._emit(
            keys=[self.stream, self.counter], args=[EVENTS_MAXLEN, "m", ""]
        )
        n0, marker = int(n0), str(marker)
        blocks: dict[bytes, tuple[str, ...]] = {}
        cursor = 0
        while True:
            cursor, keys = await self.client.scan(
                cursor, match=self.keys.block_pattern(self.model), count=self.scan_count
            )
            if keys:
                pipe = self.client.pipeline(transaction=False)
                for k in keys:
                    pipe.smembers(k)
                for k, members in zip(keys, await pipe.execute(), strict=True):
                    h = self.keys.block_hash_of(self.model, str(k))
                    if members and h is not None:  # (None: another model's key)
                        blocks[h] = tuple(sorted({str(m) for m in members}))
            if int(cursor) == 0:
                break
        # nothing after the marker may have been trimmed while the sets were read
        if not await self.client.xrange(self.stream, marker, marker):
            raise _TrimmedDuringLoad("the stream was trimmed past the load's start")
        by_member: dict[str, set[bytes]] = {}
        for h, members in blocks.items():
            for m in members:
                by_member.setdefault(m, set()).add(h)
        now = time.monotonic()
        self._blocks, self._by_member = blocks, by_member
        self._touched = dict.fromkeys(by_member, now)
        self._last_id, self._last_n = marker, n0
        self._was_behind = False
        self.resyncs += 1
        if self.last_error is not None:
            logger.info("directory mirror: Redis reachable again")
            self.last_error = None
        self._synced = True
        logger.info(
            "directory mirror for %r: %d blocks of %d members loaded",
            self.model,
            len(blocks),
            len(by_member),
        )

    async def _tail_once(self) -> None:
        reply = await self.client.xread(
            {self.stream: self._last_id}, count=self.batch, block=self.block_ms
        )
        if not reply:
            # idle: an empty read also happens when Redis restarted empty and the stream's new
            # ids are below ours; the counter tells. Ahead once may be an entry written since
            # the read returned: ahead twice in a row is not.
            n = await self.client.get(self.counter)
            behind = n is not None and int(n) > self._last_n
            if n is None or int(n) < self._last_n or (behind and self._was_behind):
                raise _Resync(f"the event counter is at {n}, the mirror at {self._last_n}")
            self._was_behind = behind
            return
        self._was_behind = False
        for _stream, entries in reply:
            for entry_id, fields in entries:
                n = int(fields["n"])
                if n != self._last_n + 1:
                    raise _Resync(f"event {n} follows {self._last_n}")
                self._apply(fields)
                self._last_id, self._last_n = str(entry_id), n
                self.entries += 1

    def _apply(self, fields: Mapping[str, Any]) -> None:
        member = str(fields.get("m", ""))
        if not member:  # a resync marker
            return
        self._touched[member] = time.monotonic()
        held = self._by_member.setdefault(member, set())
        removed = bytes.fromhex(str(fields.get("r", "")))
        blocks = self._blocks
        for i in range(0, len(removed), HASH_BYTES):
            h = removed[i : i + HASH_BYTES]
            self._drop_holder(h, member)
            held.discard(h)
        added = bytes.fromhex(str(fields.get("a", "")))
        for i in range(0, len(added), HASH_BYTES):
            h = added[i : i + HASH_BYTES]
            holders = blocks.get(h)
            if holders is None:
                blocks[h] = (member,)
            elif member not in holders:
                blocks[h] = (*holders, member)
            held.add(h)
        if not held:
            del self._by_member[member]
            del self._touched[member]

    def _drop_holder(self, h: bytes, member: str) -> None:
        holders = self._blocks.get(h)
        if holders is not None and member in holders:
            rest = tuple(m for m in holders if m != member)
            if rest:
                self._blocks[h] = rest
            else:
                del self._blocks[h]

    def _maybe_prune(self) -> None:
        now = time.monotonic()
        if self.live_members is None or now - self._pruned_at < self.prune_interval_s:
            return
        self._pruned_at = now
        live = self.live_members()
        if live is not None:
            self.prune(live, now - self.prune_interval_s)

    def prune(self, live: set[str], idle_since: float) -> int:
        """Drop the blocks of members that are not ``live`` and were not written since
        ``idle_since`` (a monotonic time): a restarted worker's old generation, or a worker
        that stopped. Returns the number of members dropped."""
        gone = [
            m for m in self._by_member if m not in live and self._touched.get(m, 0) < idle_since
        ]
        for m in gone:
            for h in self._by_member.pop(m):
                self._drop_holder(h, m)
            self._touched.pop(m, None)
        if gone:
            logger.debug("directory mirror: dropped %d members no longer live", len(gone))
        return len(gone)
