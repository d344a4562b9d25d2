"""Argument checks shared by the Triton launchers (and usable by any caller of the kernels).

Every launcher validates dtypes, shapes, devices and strides *before* launching, because a
Triton kernel given a wrong stride or dtype does not fail: it reads or writes the wrong memory.
All checks raise :class:`KernelArgumentError` with a message naming the argument. The checks
only look at tensor metadata, never at tensor values, so they never synchronise with the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, FP8_DTYPE)
INDEX_DTYPES = (torch.int32, torch.int64)


class KernelArgumentError(ValueError):
    """A tensor given to a paged-KV kernel has the wrong dtype, shape, device or strides."""


@dataclass(frozen=True)
class PoolGeometry:
    """Pool dims: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``."""

    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int


def require(cond: bool, message: Callable[[], str]) -> None:
    """Raise :class:`KernelArgumentError` with ``message()`` unless ``cond``.

    The message is built lazily so that the checks cost almost nothing on the decode hot path.
    """
    if not cond:
        raise KernelArgumentError(message())


def check_pool(kv_cache: torch.Tensor, layer: int) -> PoolGeometry:
    """Check the KV pool and the layer index; return the pool's geometry.

    The pool may be any strided view (the kernels take all six strides) as long as ``head_dim``
    is the unit-stride dimension.
    """
    require(
        kv_cache.dim() == 6,
        lambda: (
            "kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, "
            "head_dim], "
            f"got shape {tuple(kv_cache.shape)}"
        ),
    )
    require(
        kv_cache.dtype in POOL_DTYPES,
        lambda: f"kv_cache dtype must be one of {POOL_DTYPES}, got {kv_cache.dtype}",
    )
    nb, nl, two, bs, hkv, d = kv_cache.shape
    require(two == 2, lambda: f"kv_cache dim 2 must be 2 (K, V), got {two}")
    require(
        kv_cache.stride(5) == 1,
        lambda: f"kv_cache head_dim must have stride 1, got {kv_cache.stride()}",
    )
    require(bs > 0 and (bs & (bs - 1)) == 0, lambda: f"block_size must be a power of two, got {bs}")
    require(0 <= layer < nl, lambda: f"layer {layer} out of range for a pool of {nl} layers")
    return PoolGeometry(num_blocks=nb, num_layers=nl, block_size=bs, num_kv_heads=hkv, head_dim=d)


def check_same_device(device: torch.device, **tensors: torch.Tensor | None) -> None:
    """Every tensor given must live on ``device``."""
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise KernelArgumentError(f"{name} is on {t.device}, expected {device}")


def check_index(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    """An int32/int64 index tensor of exactly ``shape`` whose last dim has stride 1."""
    require(t.dtype in INDEX_DTYPES, lambda: f"{name} must be int32 or int64, got {t.dtype}")
    require(
        tuple(t.shape) == shape, lambda: f"{name} must have shape {shape}, got {tuple(t.shape)}"
    )
    require(
        t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1,
        lambda: f"{name} last dim must have stride 1, got strides {t.stride()}",
    )


def check_heads(
    name: str,
    t: torch.Tensor,
    num_heads: int | None,
    head_dim: int,
    dtypes: tuple[torch.dtype, ...],
) -> None:
    """A ``[tokens, heads, head_dim]`` tensor with unit stride on ``head_dim``."""
    require(
        t.dim() == 3,
        lambda: f"{name} must be [tokens, heads, head_dim], got shape {tuple(t.shape)}",
    )
    require(t.dtype in dtypes, lambda: f"{name} dtype must be one of {dtypes}, got {t.dtype}")
    require(
        t.shape[2] == head_dim, lambda: f"{name} head_dim {t.shape[2]} != pool head_dim {head_dim}"
    )
    if num_heads is not None:
        require(
            t.shape[1] == num_heads, lambda: f"{name} has {t.shape[1]} heads, expected {num_heads}"
        )
    require(
        t.stride(2) == 1 or head_dim == 1,
        lambda: f"{name} head_dim must have stride 1, got {t.stride()}",
    )


def check_gqa(num_heads: int, num_kv_heads: int) -> int:
    """Return the query-group size ``num_heads // num_kv_heads`` (any integer ratio)."""
    require(
        num_kv_heads > 0 and num_heads % num_kv_heads == 0,
        lambda: f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}",
    )
    return num_heads // num_kv_heads


def check_scales(
    kv_cache: torch.Tensor,
    num_kv_heads: int,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    """fp8 pools need float32 ``[1]`` or ``[num_kv_heads]`` scales; other pools need ``None``.

    Returns whether the scales are per head.
    """
    if kv_cache.dtype != FP8_DTYPE:
        require(
            k_scale is None and v_scale is None,
            lambda: (
                f"k_scale/v_scale are only valid for an fp8 KV cache (pool is {kv_cache.dtype})"
            ),
        )
        return False
    require(
        k_scale is not None and v_scale is not None,
        lambda: "an fp8 KV cache needs k_scale and v_scale",
    )
    assert k_scale is not None and v_scale is not None  # for type checkers
    k_per_head = _check_scale("k_scale", k_scale, num_kv_heads)
    v_per_head = _check_scale("v_scale", v_scale, num_kv_heads)
    require(
        k_per_head == v_per_head,
        lambda: "k_scale and v_scale must both be per-tensor or both per-head",
    )
    return k_per_head


def _check_scale(name: str, s: torch.Tensor, num_kv_heads: int) -> bool:
    """One fp8 scale: float32, contiguous, ``[1]`` or ``[num_kv_heads]``; returns per-head."""
    require(s.dtype == torch.float32, lambda: f"{name} must be float32, got {s.dtype}")
    require(
        s.dim() == 1 and s.shape[0] in (1, num_kv_heads),
        lambda: f"{name} must have shape [1] or [{num_kv_heads}], got {tuple(s.shape)}",
    )
    require(s.is_contiguous(), lambda: f"{name} must be contiguous")
    return s.shape[0] == num_kv_heads and num_kv_heads > 1
