"""KV cache events: what a worker's prefix cache gained or lost, for the Redis directory.

The block pool emits them (it alone knows when a block gets or loses its hash); the engine
drains them once per step; the services publish each step's batch to Redis in one pipeline
(``shared/directory/publisher.py``). Plain data, no torch, msgpack-friendly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks whose KV became reusable (hashes in chain order, parent first)."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks evicted (their hashes no longer resolve in this worker's cache)."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (reset, restart)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
