"""The Redis worker registry and prefix-hash directory (workers write, routers read).

Keys (``docs/architecture.md``, "KV events and the Redis directory"; prefix default ``pds:``):

- ``{p}worker:{worker_id}`` HASH with the fields of :class:`WorkerInfo` (``role``, ``model``,
  ``grpc``, ``ucx``, ``metrics``, ``block_size``, ``num_blocks``, ``max_model_len``), of
  :class:`WorkerLoad` (``free_blocks``, ``running``, ``waiting``), ``generation`` and ``seq``.
  A lease: every heartbeat rewrites it with a TTL of a few seconds; it vanishes when the worker
  stops heartbeating.
- ``{p}workers:{role}`` SET of worker ids (may hold dead ids; readers drop them lazily).
- ``{p}kvev:{model}`` STREAM of every block-set change (member, hashes added and removed),
  numbered without holes from the counter ``{p}kvevn:{model}``; trimmed to ~10k entries.
  Routers follow it to keep a copy of the block sets in process (:class:`DirectoryMirror`).
- ``{p}blk:{model}:{block_hash_hex}`` SET of ``{worker_id}:{generation}`` members: the workers
  whose prefix cache holds that block. A member counts only while the worker's lease exists and
  carries the same generation; anything else is stale, ignored by readers and removed lazily
  (atomically re-checked server-side, so a live member is never removed).

Modules: ``records`` (keys, records, clients), ``lease`` (:class:`WorkerLease`), ``publisher``
(:class:`KVEventPublisher`), ``reader`` (:class:`DirectoryReader`), ``mirror``
(:class:`DirectoryMirror`), ``embedded``
(:class:`EmbeddedRedis`). Writers use the synchronous ``redis`` client from a worker's
background thread, never from the engine loop; Redis failures never raise into the worker
(every call returns ``False``, logs rate-limited, and keeps what it must retry). Readers use
``redis.asyncio``. No torch import: the router imports this package.
"""

from shared.directory.embedded import EmbeddedRedis, find_redis_server
from shared.directory.lease import WorkerLease
from shared.directory.mirror import DirectoryMirror
from shared.directory.publisher import KVEventPublisher
from shared.directory.reader import DirectoryReader, PrefixMatch
from shared.directory.records import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_LEASE_TTL_S,
    DEFAULT_PREFIX,
    ROLE_DECODE,
    ROLE_PREFILL,
    ROLES,
    DirectoryError,
    DirectoryKeys,
    WorkerInfo,
    WorkerLoad,
    WorkerRecord,
    connect_async,
    connect_sync,
    make_member,
    new_generation,
    parse_member,
)

__all__ = [
    "DEFAULT_HEARTBEAT_S",
    "DEFAULT_LEASE_TTL_S",
    "DEFAULT_PREFIX",
    "ROLES",
    "ROLE_DECODE",
    "ROLE_PREFILL",
    "DirectoryError",
    "DirectoryKeys",
    "DirectoryMirror",
    "DirectoryReader",
    "EmbeddedRedis",
    "KVEventPublisher",
    "PrefixMatch",
    "WorkerInfo",
    "WorkerLease",
    "WorkerLoad",
    "WorkerRecord",
    "connect_async",
    "connect_sync",
    "find_redis_server",
    "make_member",
    "new_generation",
    "parse_member",
]
