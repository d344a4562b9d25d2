"""Triton paged decode attention: one query token per sequence, split-K ("flash decoding").

Grid of the attention kernel: ``(num_seqs, num_kv_heads, num_splits)``. Program ``(s, h, p)``
handles the whole GQA group of query heads that share kv head ``h`` (``G = Hq / Hkv`` heads,
padded to ``BLOCK_G >= 16`` rows so ``tl.dot`` can be used), so each K/V byte is read from the
pool once per group, not once per query head. It walks split ``p``'s share of the sequence's
context in tiles of ``TILE_N`` tokens; a tile covers ``TILE_N / block_size`` pool blocks (or part
of one), each token's address coming from the block table:
``kv + block_tables[s, tok // BS] * stride_block + (tok % BS) * stride_slot`` in int64.
Online softmax in fp32 (base-2 exponent, scale folded into ``log2(e)``).

With ``num_splits == 1`` the kernel writes the normalised output directly. Otherwise each split
writes an unnormalised partial ``(acc, max, sum)`` and :func:`_decode_reduce_kernel` (grid
``(num_seqs, num_heads)``) merges the splits. The number of splits is chosen on the host from
tensor *shapes* only (no device sync); a split whose share of a shorter sequence is empty
writes ``max = -inf, sum = 0`` and drops out of the merge.

fp8 pools are dequantized in registers: ``(x_e4m3 * scale)`` rounded to the query dtype, exactly
as the reference does before its matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.checks import PoolGeometry
from kernels.triton_kv import load_kv_scales, load_kv_tile
from kernels.triton_rounding import BF16_MANT_BITS, BF16_MIN_EXP, round_rne, to_compute_dtype

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel (powers of two)."""

    tile_n: int  # context tokens per inner iteration
    num_splits: int  # split-K partitions of each sequence's context
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _decode_kernel(
    out_ptr,  # [S, Hq, D] query dtype (NUM_SPLITS == 1) or [S, Hq, NUM_SPLITS, D] fp32 partials
    max_ptr,  # [S, Hq, NUM_SPLITS] fp32 running max (log2 domain); unused if NUM_SPLITS == 1
    sum_ptr,  # [S, Hq, NUM_SPLITS] fp32 softmax denominators;      unused if NUM_SPLITS == 1
    q_ptr,  # [S, Hq, D]
    kv_ptr,  # [NB, L, 2, BS, Hkv, D]
    block_tables_ptr,  # [S, max_blocks] int32/int64
    seq_lens_ptr,  # [S] int32/int64, >= 1
    k_scale_ptr,  # [1] or [Hkv] float32 (fp8 only)
    v_scale_ptr,  # [1] or [Hkv] float32 (fp8 only)
    layer_offset,  # layer * pool stride of the layer dim (host-computed)
    scale_log2,  # softmax scale * log2(e)
    stride_q_s,
    stride_q_h,
    stride_o_s,
    stride_o_h,
    stride_o_p,  # stride_o_p: split stride of the partials
    stride_kv_block,
    stride_kv_kv,
    stride_kv_slot,
    stride_kv_head,
    stride_bt_s,
    QUERY_GROUP: tl.constexpr,  # G = Hq // Hkv
    BLOCK_G: tl.constexpr,  # next power of two >= max(G, 16)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= max(HEAD_DIM, 16)
    BLOCK_SIZE: tl.constexpr,  # pool block size
    TILE_N: tl.constexpr,  # context tokens per iteration (>= 16)
    NUM_SPLITS: tl.constexpr,
    FP8: tl.constexpr,
    PER_HEAD_SCALE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,  # bf16 under the CPU interpreter: see triton_rounding
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 queries, else "tf32" (ignored for 16-bit)
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    num_tiles = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    g = tl.arange(0, BLOCK_G)  # [BLOCK_G]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    heads = kv_head * QUERY_GROUP + g  # [BLOCK_G]
    g_mask = g < QUERY_GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_q_s + heads[:, None] * stride_q_h + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    compute_dtype = q.dtype
    q = to_compute_dtype(q, compute_dtype, EMULATE_BF16)

    k_scale, v_scale = load_kv_scales(k_scale_ptr, v_scale_ptr, kv_head, FP8, PER_HEAD_SCALE)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    kv_base = kv_ptr + layer_offset + kv_head * stride_kv_head
    bt_row = block_tables_ptr + seq * stride_bt_s
    offs_n = tl.arange(0, TILE_N)  # [TILE_N]
    for tile in range(tile_lo, tile_hi):
        tok = tile * TILE_N + offs_n  # [TILE_N] context positions
        n_mask = tok < seq_len
        k, v = load_kv_tile(
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
            compute_dtype,
            BLOCK_SIZE,
            FP8,
            EMULATE_BF16,
        )  # [TILE_N, BLOCK_D] each

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_G, TILE_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_G]
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_G, TILE_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        p_v = to_compute_dtype(p, compute_dtype, EMULATE_BF16)  # 16-bit operand, as on GPUs
        acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o = acc / l_i[:, None]
        if EMULATE_BF16:
            o = round_rne(o, BF16_MANT_BITS, BF16_MIN_EXP)
        tl.store(
            out_ptr + seq * stride_o_s + heads[:, None] * stride_o_h + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        row = seq * stride_o_s + heads * stride_o_h + split * stride_o_p  # [BLOCK_G]
        tl.store(out_ptr + row[:, None] + d[None, :], acc, mask=out_mask)
        stat = (seq * tl.num_programs(1) * QUERY_GROUP + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(max_ptr + stat, m_i, mask=g_mask)
        tl.store(sum_ptr + stat, l_i, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr,  # [S, Hq, D] query dtype
    partial_ptr,  # [S, Hq, NUM_SPLITS, D] fp32
    max_ptr,  # [S, Hq, NUM_SPLITS] fp32
    sum_ptr,  # [S, Hq, NUM_SPLITS] fp32
    stride_o_s,
    stride_o_h,
    stride_p_s,
    stride_p_h,
    stride_p_p,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,  # power of two
    EMULATE_BF16: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    p = tl.arange(0, NUM_SPLITS)  # [NUM_SPLITS]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_mask = d < HEAD_DIM
    stat = (seq * num_heads + head) * NUM_SPLITS + p
    m = tl.load(max_ptr + stat)  # [NUM_SPLITS]
    l_sum = tl.load(sum_ptr + stat)
    m_all = tl.max(m, 0)
    w = tl.exp2(m - m_all)  # empty splits: exp2(-inf) = 0
    denom = tl.sum(l_sum * w, 0)
    part = tl.load(
        partial_ptr + seq * stride_p_s + head * stride_p_h + p[:, None] * stride_p_p + d[None, :],
        mask=d_mask[None, :],
        other=0.0,
    )  # [NUM_SPLITS, BLOCK_D]
    o = tl.sum(part * w[:, None], 0) / denom  # [BLOCK_D]
    if EMULATE_BF16:
        o = round_rne(o, BF16_MANT_BITS, BF16_MIN_EXP)
    tl.store(
        out_ptr + seq * stride_o_s + head * stride_o_h + d,
        o.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def launch_decode(
    query: torch.Tensor,  # [S, Hq, D]
    kv_cache: torch.Tensor,  # [NB, L, 2, BS, Hkv, D]
    layer: int,
    block_tables: torch.Tensor,  # [S, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [S] int32/int64
    scale: float,
    k_scale: torch.Tensor | None,  # [1] or [Hkv] float32 (fp8 only)
    v_scale: torch.Tensor | None,
    geom: PoolGeometry,
    per_head_scale: bool,
    config: DecodeConfig,
    emulate_bf16: bool,
) -> torch.Tensor:  # [S, Hq, D]
    """Launch the decode kernels; arguments must already be validated by the caller."""
    num_seqs, num_heads, head_dim = query.shape
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    group = num_heads // geom.num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    fp8 = k_scale is not None
    dummy = seq_lens  # any valid pointer for unused arguments
    splits = config.num_splits
    if splits == 1:
        target, m_buf, l_buf = out, dummy, dummy
        stride_o = (out.stride(0), out.stride(1), 0)
    else:
        target = torch.empty(
            (num_seqs, num_heads, splits, head_dim), dtype=torch.float32, device=query.device
        )  # [S, Hq, P, D] partial accumulators
        m_buf = torch.empty(
            (num_seqs, num_heads, splits), dtype=torch.float32, device=query.device
        )  # [S, Hq, P]
        l_buf = torch.empty_like(m_buf)  # [S, Hq, P]
        stride_o = (target.stride(0), target.stride(1), target.stride(2))
    # grid: one program per (sequence, kv head, split); each handles the G query heads of the group
    grid = (num_seqs, geom.num_kv_heads, splits)
    _decode_kernel[grid](
        target,
        m_buf,
        l_buf,
        query,
        kv_cache,
        block_tables,
        seq_lens,
        k_scale if fp8 else dummy,
        v_scale if fp8 else dummy,
        layer * kv_cache.stride(1),
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        stride_o[0],
        stride_o[1],
        stride_o[2],
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        block_tables.stride(0),
        QUERY_GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=geom.block_size,
        TILE_N=config.tile_n,
        NUM_SPLITS=splits,
        FP8=fp8,
        PER_HEAD_SCALE=per_head_scale,
        EMULATE_BF16=emulate_bf16,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits > 1:
        # grid: one program per (sequence, query head) merges its splits
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out,
            target,
            m_buf,
            l_buf,
            out.stride(0),
            out.stride(1),
            target.stride(0),
            target.stride(1),
            target.stride(2),
            num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=splits,
            EMULATE_BF16=emulate_bf16,
            num_warps=1 if block_d * splits <= 1024 else 4,
        )
    return out
