"""Byte-level view of a worker's KV pool: block regions, checksums, copies.

The pool is one block-major tensor ``kv[num_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim]`` of any KV dtype, so the transfer layer treats it as ``num_blocks * block_bytes`` raw
bytes: block ``b`` is ``bytes[b * block_bytes : (b + 1) * block_bytes]`` and a run of adjacent
ids is one contiguous region. Accepted pool objects:

* a contiguous ``torch.Tensor`` on the CPU or a CUDA device (torch is never imported here: a
  tensor can only exist if its caller imported torch);
* anything exposing ``__array_interface__`` (host memory, e.g. numpy);
* anything exposing ``__cuda_array_interface__`` (device memory, e.g. CuPy; needs torch to
  compute checksums).

A :class:`Region` hands the transport a 1-D uint8 buffer object that aliases the pool (numpy
array for host memory, torch CUDA tensor for device memory): no staging copy is ever made,
except when a fault-injection hook asks for a corrupted copy.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import xxhash

from kvtransfer.errors import PoolGeometryError
from kvtransfer.geometry import KVGeometry


@dataclass(frozen=True)
class Region:
    """Blocks ``[first_block, first_block + count)`` of a pool as one contiguous byte buffer.

    ``buffer`` is a 1-D uint8 object exposing ``__array_interface__`` (host) or
    ``__cuda_array_interface__`` (device) that aliases the pool memory; ``nbytes`` is its size.
    """

    first_block: int
    count: int
    nbytes: int
    buffer: Any
    is_cuda: bool


def _torch_module() -> Any:  # torch, if the caller imported it (never imported here)
    return sys.modules.get("torch")


def _is_torch_tensor(obj: Any) -> bool:
    torch = _torch_module()
    return torch is not None and isinstance(obj, torch.Tensor)


class PoolView:
    """Validated raw-byte view of a KV pool; all offsets are in blocks.

    Construction raises :class:`PoolGeometryError` if the pool is not contiguous, its size is
    not a whole number of blocks, or a typed 6-D tensor's dtype/shape disagree with the geometry.
    The view never copies or frees the pool; the owner keeps it alive.
    """

    def __init__(self, pool: Any, geometry: KVGeometry):
        self.geometry = geometry
        self.block_bytes = geometry.block_bytes
        if _is_torch_tensor(pool):
            self._flat, self.is_cuda = self._from_torch(pool, geometry)
        elif hasattr(pool, "__cuda_array_interface__"):
            torch = _torch_module()
            if torch is None:
                import torch
            self._flat, self.is_cuda = self._from_torch(
                torch.as_tensor(pool, device="cuda"), geometry
            )
        elif hasattr(pool, "__array_interface__") or isinstance(pool, np.ndarray):
            arr = np.asarray(pool)
            if not arr.flags.c_contiguous:
                raise PoolGeometryError("KV pool must be C-contiguous")
            if not arr.flags.writeable:
                raise PoolGeometryError("KV pool must be writeable")
            self._flat, self.is_cuda = arr.reshape(-1).view(np.uint8), False
        else:
            raise PoolGeometryError(
                f"KV pool must be a torch.Tensor or expose __array_interface__ / "
                f"__cuda_array_interface__, got {type(pool).__name__}"
            )
        nbytes = int(self._flat.shape[0])
        if nbytes == 0 or nbytes % self.block_bytes:
            raise PoolGeometryError(
                f"KV pool has {nbytes} bytes, not a positive multiple of block_bytes={self.block_bytes}"
            )
        self.num_blocks = nbytes // self.block_bytes

    @staticmethod
    def _from_torch(t: Any, geometry: KVGeometry) -> tuple[Any, bool]:
        torch = _torch_module()
        if not t.is_contiguous():
            raise PoolGeometryError("KV pool tensor must be contiguous")
        dtype_name = str(t.dtype).removeprefix("torch.")
        if t.dtype not in (torch.uint8, torch.int8) and dtype_name != geometry.dtype:
            raise PoolGeometryError(
                f"KV pool dtype {dtype_name} differs from geometry dtype {geometry.dtype}"
            )
        if t.dim() == 6 and tuple(t.shape[1:]) != geometry.block_shape:
            raise PoolGeometryError(
                f"KV pool shape {tuple(t.shape)} does not match [num_blocks, *{geometry.block_shape}]"
            )
        flat = t.reshape(-1).view(torch.uint8)  # raw bytes; numpy has no bf16 / fp8
        if t.is_cuda:
            return flat, True
        if t.device.type != "cpu":
            raise PoolGeometryError(f"KV pool on unsupported device {t.device}")
        return flat.numpy(), False  # aliases the tensor's memory

    def _check_range(self, first_block: int, count: int) -> None:
        if count <= 0 or first_block < 0 or first_block + count > self.num_blocks:
            raise IndexError(
                f"blocks [{first_block}, {first_block + count}) outside pool of {self.num_blocks}"
            )

    def region(self, first_block: int, count: int) -> Region:
        """The bytes of blocks ``[first_block, first_block + count)``, aliasing the pool."""
        self._check_range(first_block, count)
        lo, hi = first_block * self.block_bytes, (first_block + count) * self.block_bytes
        return Region(first_block, count, hi - lo, self._flat[lo:hi], self.is_cuda)

    def host_bytes(self, region: Region) -> np.ndarray:
        """Host uint8 array with the region's bytes (a view for host pools, a copy for device)."""
        if region.is_cuda:
            return cast(np.ndarray, region.buffer.cpu().numpy())
        return cast(np.ndarray, region.buffer)

    def checksums(self, region: Region) -> list[int]:
        """xxh3_64 of each block of ``region``, in block order.

        Device pools are copied to the host first (one copy per region): checksums cost real
        bandwidth there, which is why they can be switched off.
        """
        data = self.host_bytes(region)
        bb = self.block_bytes
        return [
            # numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12
            xxhash.xxh3_64_intdigest(data[i * bb : (i + 1) * bb])  # type: ignore[arg-type]
            for i in range(region.count)
        ]

    def corrupted_copy(self, region: Region, block_offsets: list[int]) -> Region:
        """A copy of ``region`` with one byte flipped in each listed block (fault injection only)."""
        data = np.array(self.host_bytes(region), copy=True)
        for off in block_offsets:
            data[off * self.block_bytes + self.block_bytes // 2] ^= 0xFF
        if region.is_cuda:
            torch = _torch_module()
            data = torch.from_numpy(data).to(region.buffer.device)
        return Region(region.first_block, region.count, region.nbytes, data, region.is_cuda)


def copy_region(dst: Region, src: Region) -> None:
    """Copy ``src`` into ``dst`` (same size; host or device on either side)."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"region sizes differ: {dst.nbytes} != {src.nbytes}")
    if not dst.is_cuda and not src.is_cuda:
        np.copyto(dst.buffer, src.buffer)
        return
    torch = _torch_module()
    d = dst.buffer if dst.is_cuda else torch.from_numpy(dst.buffer)
    s = src.buffer if src.is_cuda else torch.from_numpy(src.buffer)
    d.copy_(s)
