"""Triton kernel that stores a step's new K/V into their pool slots (vLLM's ``reshape_and_cache``).

Grid: ``(num_tokens, cdiv(num_kv_heads, BLOCK_H))``; program ``(t, hb)`` copies the K and V rows
of token ``t`` for heads ``hb * BLOCK_H ..`` into slot ``slot_mapping[t]`` of ``layer``. For an
fp8 pool it quantizes on the way (``clamp(x / scale, ±448)`` rounded to nearest-even e4m3), which
is bit-identical to ``kernels.reference.quantize_fp8``. A negative slot marks a padding token
(CUDA-graph padding, as in vLLM) and is skipped.

All pool offsets are computed in int64: ``block_id * stride_block`` passes 2**31 elements in
pools of a few GiB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import PoolGeometry
from kernels.triton_rounding import (
    BF16_MANT_BITS,
    BF16_MIN_EXP,
    E4M3_MANT_BITS,
    E4M3_MIN_EXP,
    round_rne,
)


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    kv_ptr,  # [NB, L, 2, BS, Hkv, D]
    slot_ptr,  # [T] int32/int64, slot = block * BS + offset; < 0 = skip
    k_scale_ptr,  # [1] or [Hkv] float32 (fp8 pools only; else any pointer, unused)
    v_scale_ptr,  # [1] or [Hkv] float32
    layer_offset,  # layer * stride of the pool's layer dim (host-computed, may exceed int32)
    num_kv_heads,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_slot,
    stride_kv_head,
    BLOCK_SIZE: tl.constexpr,  # tokens per pool block
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_H: tl.constexpr,  # kv heads per program
    FP8: tl.constexpr,
    PER_HEAD_SCALE: tl.constexpr,
    EMULATE_RNE: tl.constexpr,  # interpreter only: round in fp32 before narrowing
    RNE_MANT_BITS: tl.constexpr,
    RNE_MIN_EXP: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    # the slot test is done on a vector: the interpreter mis-types a broadcast scalar bool mask
    valid = (tl.zeros([BLOCK_H], dtype=tl.int64) + slot >= 0) & (heads < num_kv_heads)  # [BLOCK_H]
    mask = valid[:, None] & (dims[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]

    src_k = key_ptr + tok * stride_key_t + heads[:, None] * stride_key_h + dims[None, :]
    src_v = value_ptr + tok * stride_value_t + heads[:, None] * stride_value_h + dims[None, :]
    k = tl.load(src_k, mask=mask, other=0.0)  # [BLOCK_H, BLOCK_D]
    v = tl.load(src_v, mask=mask, other=0.0)

    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = (
        kv_ptr
        + layer_offset
        + block * stride_kv_block
        + offset * stride_kv_slot
        + heads[:, None] * stride_kv_head
        + dims[None, :]
    )  # int64 offsets
    if FP8:
        if PER_HEAD_SCALE:
            hmask = heads < num_kv_heads
            ks = tl.load(k_scale_ptr + heads, mask=hmask, other=1.0)[:, None]  # [BLOCK_H, 1]
            vs = tl.load(v_scale_ptr + heads, mask=hmask, other=1.0)[:, None]
        else:
            ks = tl.load(k_scale_ptr)
            vs = tl.load(v_scale_ptr)
        # div_rn: IEEE-rounded division, so the e4m3 rounding matches torch bit for bit.
        k = tl.clamp(tl.div_rn(k.to(tl.float32), ks), -448.0, 448.0)
        v = tl.clamp(tl.div_rn(v.to(tl.float32), vs), -448.0, 448.0)
    if EMULATE_RNE:
        k = round_rne(k.to(tl.float32), RNE_MANT_BITS, RNE_MIN_EXP)
        v = round_rne(v.to(tl.float32), RNE_MANT_BITS, RNE_MIN_EXP)
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv_kv, v.to(kv_ptr.dtype.element_ty), mask=mask)


def launch_write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [NB, L, 2, BS, Hkv, D]
    layer: int,
    slot_mapping: torch.Tensor,  # [T] int32/int64
    k_scale: torch.Tensor | None,  # [1] or [Hkv] float32, fp8 pools only
    v_scale: torch.Tensor | None,
    geom: PoolGeometry,
    per_head_scale: bool,
    interpreted: bool,
) -> None:
    """Launch :func:`_write_kv_kernel`; arguments must already be validated by the caller."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    fp8 = k_scale is not None
    block_d = triton.next_power_of_2(geom.head_dim)
    # Up to ~2K elements per program: all heads of a token in one program for usual models.
    block_h = min(triton.next_power_of_2(geom.num_kv_heads), max(1, 2048 // block_d))
    # grid: one program per (token, group of BLOCK_H kv heads)
    grid = (num_tokens, triton.cdiv(geom.num_kv_heads, block_h))
    dummy = slot_mapping  # any valid pointer for the unused scale arguments
    narrowing = fp8 or (kv_cache.dtype == torch.bfloat16 and key.dtype != torch.bfloat16)
    emulate_rne = interpreted and narrowing
    mant, min_exp = (E4M3_MANT_BITS, E4M3_MIN_EXP) if fp8 else (BF16_MANT_BITS, BF16_MIN_EXP)
    _write_kv_kernel[grid](
        key,
        value,
        kv_cache,
        slot_mapping,
        k_scale if fp8 else dummy,
        v_scale if fp8 else dummy,
        layer * kv_cache.stride(1),
        geom.num_kv_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        BLOCK_SIZE=geom.block_size,
        HEAD_DIM=geom.head_dim,
        BLOCK_D=block_d,
        BLOCK_H=block_h,
        FP8=fp8,
        PER_HEAD_SCALE=per_head_scale,
        EMULATE_RNE=emulate_rne,
        RNE_MANT_BITS=mant,
        RNE_MIN_EXP=min_exp,
        num_warps=4 if block_h * block_d >= 1024 else 2,
    )
