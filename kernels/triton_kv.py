"""Reading the paged KV pool from Triton kernels: one code path for decode and prefill.

Both attention kernels walk a sequence's context ``TILE_N`` positions at a time, find each
position's block through the block table and load its K and V rows from the block-major pool
(``[NB, L, 2, BS, Hkv, D]``), dequantising fp8 with the per-tensor or per-head scales.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_rounding import to_compute_dtype


@triton.jit
def load_kv_scales(
    k_scale_ptr, v_scale_ptr, kv_head, FP8: tl.constexpr, PER_HEAD_SCALE: tl.constexpr
):
    """(k_scale, v_scale) of ``kv_head`` for an fp8 pool; (1.0, 1.0), unused, otherwise."""
    if FP8:
        if PER_HEAD_SCALE:
            return tl.load(k_scale_ptr + kv_head), tl.load(v_scale_ptr + kv_head)
        else:
            return tl.load(k_scale_ptr), tl.load(v_scale_ptr)
    else:
        return 1.0, 1.0


@triton.jit
def load_kv_tile(
    kv_base,
    bt_row,
    tok,
    n_mask,
    d,
    d_mask,
    stride_kv_block,
    stride_kv_slot,
    stride_kv_kv,
    k_scale,
    v_scale,
    compute_dtype: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    """K and V (``[TILE_N, BLOCK_D]``, in ``compute_dtype``) of context positions ``tok``
    (``[TILE_N]``, masked by ``n_mask``). ``kv_base`` points at this layer's and KV head's
    first element, ``bt_row`` at the sequence's block-table row; offsets are int64."""
    block_id = tl.load(bt_row + tok // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    tok_off = block_id * stride_kv_block + (tok % BLOCK_SIZE) * stride_kv_slot  # [TILE_N] i64
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(kv_base + tok_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(kv_base + stride_kv_kv + tok_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if FP8:
        k = k.to(tl.float32) * k_scale
        v = v.to(tl.float32) * v_scale
    return (
        to_compute_dtype(k, compute_dtype, EMULATE_BF16),
        to_compute_dtype(v, compute_dtype, EMULATE_BF16),
    )
