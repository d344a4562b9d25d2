"""Chained block hashes shared by the engines and the router.

Contract (docs/architecture.md, "Block hashes"):

    h[-1] = 16 zero bytes
    h[i]  = xxh3_128(h[i-1] || tokens_le_u32(block i), seed)

Only full blocks are hashed. ``seed`` is derived from the model identity (the served model
name) and an optional namespace (a LoRA adapter or a tenant), so two models never share cache
entries. This module must not import torch: the router imports it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

HASH_BYTES = 16
ROOT_HASH = bytes(HASH_BYTES)


def hash_seed(model: str, namespace: str | None = None) -> int:
    """The 64-bit xxh3 seed for ``model`` (and ``namespace``, when given)."""
    key = model.encode() + b"\x00" + (namespace or "").encode()
    return xxhash.xxh3_64_intdigest(key)


def hash_block(parent: bytes, tokens: Sequence[int], seed: int) -> bytes:
    """Hash of one full block whose predecessor's hash is ``parent``."""
    payload = parent + struct.pack(f"<{len(tokens)}I", *tokens)
    return xxhash.xxh3_128_digest(payload, seed=seed)


def block_hashes(
    tokens: Sequence[int],
    block_size: int,
    seed: int,
    parent: bytes = ROOT_HASH,
    start_block: int = 0,
) -> list[bytes]:
    """Hashes of every full block of ``tokens``, starting at block ``start_block``.

    ``parent`` must be the hash of block ``start_block - 1`` (``ROOT_HASH`` for block 0), which
    lets callers extend a sequence's hash list incrementally as tokens arrive.
    """
    out: list[bytes] = []
    n_full = len(tokens) // block_size
    for i in range(start_block, n_full):
        parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size], seed)
        out.append(parent)
    return out
