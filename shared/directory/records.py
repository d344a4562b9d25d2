"""Directory keys, member names, worker records, Redis clients and error logging."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, fields

import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shared.hashing import HASH_BYTES

logger = logging.getLogger("shared.directory")

DEFAULT_PREFIX = "pds:"
ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
ROLES = (ROLE_PREFILL, ROLE_DECODE)
DEFAULT_LEASE_TTL_S = 3.0
DEFAULT_HEARTBEAT_S = 1.0
_ERROR_LOG_INTERVAL_S = 10.0
REDIS_ERRORS = (redis.RedisError, OSError)


class DirectoryError(RuntimeError):
    """A directory record is malformed, or the embedded Redis could not start or stop."""


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
        """A SCAN MATCH pattern for the model's block keys: the prefix and the name escaped
        (a served name like ``m[v2]`` matched none of its own keys). It still matches another
        model's keys when that name extends this one after a ``:`` (``llama3``,
        ``llama3:8b``): readers keep only :meth:`block_hash_of` keys."""
        return f"{_glob_escape(self.prefix)}blk:{_glob_escape(model)}:*"

    def block_hash_of(self, model: str, key: str) -> bytes | None:
        """The block hash a key names, or None if it is not one of ``model``'s block keys."""
        head = self.block(model, b"")
        tail = key[len(head) :] if key.startswith(head) else ""
        if len(tail) != 2 * HASH_BYTES:
            return None
        try:
            return bytes.fromhex(tail)
        except ValueError:
            return None

    def events(self, model: str) -> str:
        """The model's stream of directory changes (``mirror.py``)."""
        return f"{self.prefix}kvev:{model}"

    def events_counter(self, model: str) -> str:
        """The number of the stream's last entry. A namespace of its own: ``kvev:{model}:n``
        was the event stream of a model named ``{model}:n``."""
        return f"{self.prefix}kvevn:{model}"


def _glob_escape(text: str) -> str:
    """``text`` matched literally by a Redis glob pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


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
    quantization: str = ""  # weight scheme, e.g. "awq (w4a16, group 128, asymmetric)"; "" dense

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
        d = {as_str(k): as_str(v) for k, v in h.items()}
        try:
            info = WorkerInfo(
                worker_id=worker_id,
                role=d["role"],
                model=d["model"],
                grpc=d["grpc"],
                block_size=int(d["block_size"]),
                num_blocks=int(d["num_blocks"]),
                ucx=d.get("ucx", ""),
                metrics=d.get("metrics", ""),
                max_model_len=int(d.get("max_model_len") or 0),
                quantization=d.get("quantization", ""),
            )
            load = WorkerLoad(
                free_blocks=int(d.get("free_blocks") or 0),
                running=int(d.get("running") or 0),
                waiting=int(d.get("waiting") or 0),
            )
            return cls(info, load, d["generation"], int(d.get("seq") or 0))
        except (KeyError, ValueError) as e:
            raise DirectoryError(f"malformed lease for worker {worker_id!r}: {e!r}") from e


def as_str(x: str | bytes) -> str:
    return x.decode() if isinstance(x, bytes) else x


def info_fields(info: WorkerInfo) -> dict[str, str]:
    return {f.name: str(getattr(info, f.name)) for f in fields(info) if f.name != "worker_id"}


def load_fields(load: WorkerLoad) -> dict[str, str]:
    return {f.name: str(getattr(load, f.name)) for f in fields(load)}


def connect_sync(url: str, timeout_s: float = 1.0) -> redis.Redis:
    """A worker-side client: string replies, bounded socket timeouts, one quick retry."""
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1),
    )


def connect_async(url: str, timeout_s: float = 1.0, max_connections: int = 64) -> aioredis.Redis:
    """A router-side client: string replies, bounded timeouts, a bounded connection pool.

    The pool *blocks* (up to ``timeout_s``) when all connections are busy instead of failing:
    a burst of hundreds of requests then queues for a connection for a millisecond or two
    rather than losing its prefix lookup to ``MaxConnectionsError``.
    """
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        decode_responses=True,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        max_connections=max_connections,
        timeout=timeout_s,
        retry=aioredis.retry.Retry(NoBackoff(), 1),
    )
    return aioredis.Redis(connection_pool=pool)


class ErrorLog:
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
