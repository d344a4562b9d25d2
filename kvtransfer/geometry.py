"""The KV-cache geometry both ends of a transfer must agree on.

A worker's KV pool is one tensor ``kv[num_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim]`` (2 = K, V), block-major, so block ``b`` is the contiguous byte range
``[b * block_bytes, (b + 1) * block_bytes)``. Two workers can exchange blocks only when every
field of :class:`KVGeometry` is equal; the handshake compares them and names each difference.

No torch or UCX import here: the router and the services' config code use this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvtransfer.errors import ProtocolError

#: Bytes per element of each supported KV dtype (canonical names are torch's, without "torch.").
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

# Spellings seen in configs and CLI flags (vLLM's --kv-cache-dtype among them).
_DTYPE_ALIASES: dict[str, str] = {
    "float": "float32",
    "fp32": "float32",
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}

#: Layouts this code can move. A new layout gets a new name; never reuse one.
LAYOUTS: tuple[str, ...] = ("block_major_v1",)

_INT_FIELDS = ("block_size", "num_layers", "num_kv_heads", "head_dim")
_ALL_FIELDS = ("model", "dtype", "layout", *_INT_FIELDS)


def canonical_dtype(name: str) -> str:
    """Return the canonical KV dtype name for ``name`` (``"torch.bfloat16"``, ``"fp8"``, ...).

    Raises ``ValueError`` for a dtype the transfer layer does not know, ``TypeError`` for a
    non-string.
    """
    if not isinstance(name, str):
        raise TypeError(f"KV dtype must be a string, got {type(name).__name__}")
    key = name.strip().lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise ValueError(f"unsupported KV dtype {name!r}; supported: {known}")
    return key


@dataclass(frozen=True, kw_only=True)
class KVGeometry:
    """Shape and identity of a KV pool block; equal geometries can exchange blocks.

    ``dtype`` is normalised to its canonical name (``"fp8"`` becomes ``"float8_e4m3fn"``).
    Construction raises ``ValueError`` on an unknown dtype or layout or a non-positive size.
    """

    model: str
    dtype: str
    layout: str = "block_major_v1"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("KVGeometry.model must be a non-empty string")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if self.layout not in LAYOUTS:
            raise ValueError(f"unsupported KV layout {self.layout!r}; supported: {LAYOUTS}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVGeometry.{name} must be a positive int, got {value!r}")

    @property
    def dtype_bytes(self) -> int:
        """Bytes per KV element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: ``(num_layers, 2, block_size, num_kv_heads, head_dim)``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: ``num_layers * 2 * block_size * num_kv_heads * head_dim * dtype_bytes``."""
        return math.prod(self.block_shape) * self.dtype_bytes

    def mismatches(
        self, other: KVGeometry, *, local: str = "local", remote: str = "remote"
    ) -> list[str]:
        """Describe every field that differs, as ``"dtype (sender=bfloat16, receiver=float16)"``.

        An empty list means the two geometries are compatible.
        """
        out = []
        for name in _ALL_FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                out.append(f"{name} ({local}={mine}, {remote}={theirs})")
        return out

    def to_wire(self) -> dict[str, Any]:
        """Plain-dict form sent in the handshake."""
        return {name: getattr(self, name) for name in _ALL_FIELDS}

    @classmethod
    def from_wire(cls, data: Any) -> KVGeometry:
        """Parse the handshake form; raises :class:`ProtocolError` when it is malformed."""
        if not isinstance(data, dict) or set(data) != set(_ALL_FIELDS):
            raise ProtocolError(
                f"geometry must be a map with keys {sorted(_ALL_FIELDS)}, got {data!r}"
            )
        try:
            return cls(**data)
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"invalid geometry {data!r}: {e}") from e
