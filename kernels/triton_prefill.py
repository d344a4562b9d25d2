"""Triton varlen paged attention for prefill, chunked prefill and mixed batches.

Query chunks of several sequences are packed back to back (``query_start_loc``), no padding.
Sequence ``s`` has ``q_len = qsl[s+1] - qsl[s]`` query rows, the *last* ``q_len`` positions of its
``seq_len``-token context; everything before them (prefix-cache hits, earlier chunks) is already
in the pool. Row ``i`` attends causally to context positions ``<= seq_len - q_len + i``.

Grid: ``(num_tokens // BLOCK_Q + num_seqs, num_kv_heads)``. Sequence ``s`` owns the programs
``qsl[s] // BLOCK_Q + s ..``, enough for its ``cdiv(q_len, BLOCK_Q)`` query tiles; a program
finds its sequence by binary search over ``query_start_loc`` and exits early (an empty loop and
a fully masked store) when it falls past its sequence's last tile. This sizes the grid from
shapes alone (no device sync), like vLLM's unified Triton attention.

Each program holds a ``BLOCK_M = BLOCK_Q * BLOCK_G`` row tile: ``BLOCK_Q`` query tokens times the
``G = Hq / Hkv`` query heads sharing one kv head (padded to ``BLOCK_G``, a power of two), so one
K/V tile read from the pool serves the whole group. It streams the context in ``TILE_N``-token
tiles through the block table (int64 offsets) up to the tile's last visible key, with an online
softmax in fp32 (flash-attention style), and writes the normalised output.
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
class PrefillConfig:
    """Launch parameters of the varlen kernel (powers of two)."""

    block_q: int  # query tokens per program; BLOCK_M = block_q * BLOCK_G >= 16
    tile_n: int  # context tokens per inner iteration (>= 16)
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _find_sequence(qsl_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Largest ``s`` with ``qsl[s] // BLOCK_Q + s <= pid`` (binary search; qsl is sorted)."""
    lo = pid * 0
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(qsl_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        go_right = start <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    return lo


@triton.jit
def _prefill_kernel(
    out_ptr,  # [T, Hq, D]
    q_ptr,  # [T, Hq, D]
    kv_ptr,  # [NB, L, 2, BS, Hkv, D]
    block_tables_ptr,  # [S, max_blocks] int32/int64
    seq_lens_ptr,  # [S] int32/int64: context length incl. this step's queries
    qsl_ptr,  # [S + 1] int32/int64: query_start_loc
    k_scale_ptr,  # [1] or [Hkv] float32 (fp8 only)
    v_scale_ptr,  # [1] or [Hkv] float32 (fp8 only)
    num_seqs,
    layer_offset,  # layer * pool stride of the layer dim (host-computed)
    scale_log2,  # softmax scale * log2(e)
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_slot,
    stride_kv_head,
    stride_bt_s,
    QUERY_GROUP: tl.constexpr,  # G = Hq // Hkv
    BLOCK_G: tl.constexpr,  # next power of two >= G
    BLOCK_Q: tl.constexpr,  # query tokens per program
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= max(HEAD_DIM, 16)
    BLOCK_SIZE: tl.constexpr,  # pool block size
    TILE_N: tl.constexpr,  # context tokens per iteration
    FP8: tl.constexpr,
    PER_HEAD_SCALE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,  # bf16 under the CPU interpreter: see triton_rounding
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 queries
):
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(qsl_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq).to(tl.int32)
    q_len = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start
    q_tile = pid - (q_start // BLOCK_Q + seq)  # this program's query tile within the sequence
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx_before = seq_len - q_len  # context positions already cached before this chunk

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    qi = q_tile * BLOCK_Q + rows // BLOCK_G  # [BLOCK_M] query index within the chunk
    g = rows % BLOCK_G
    heads = kv_head * QUERY_GROUP + g  # [BLOCK_M]
    row_mask = (qi < q_len) & (g < QUERY_GROUP)
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_mask = d < HEAD_DIM
    tok_row = (q_start + qi).to(tl.int64)  # [BLOCK_M] packed token index
    q = tl.load(
        q_ptr + tok_row[:, None] * stride_q_t + heads[:, None] * stride_q_h + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    compute_dtype = q.dtype
    q = to_compute_dtype(q, compute_dtype, EMULATE_BF16)
    pos = ctx_before + qi  # [BLOCK_M] absolute position of each query row

    k_scale, v_scale = load_kv_scales(k_scale_ptr, v_scale_ptr, kv_head, FP8, PER_HEAD_SCALE)

    # keys visible to the tile's last valid row; 0 for programs past the sequence's last tile
    last_q = tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
    kv_end = tl.where(q_tile * BLOCK_Q < q_len, ctx_before + last_q, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kv_base = kv_ptr + layer_offset + kv_head * stride_kv_head
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    offs_n = tl.arange(0, TILE_N)  # [TILE_N]
    for start in range(0, kv_end, TILE_N):
        tok = start + offs_n  # [TILE_N] context positions
        n_mask = tok < kv_end
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

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
        visible = (tok[None, :] <= pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
        # rows with nothing visible yet keep m = -inf; use 0 as the reference to avoid NaN
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])  # [BLOCK_M, TILE_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        p_v = to_compute_dtype(p, compute_dtype, EMULATE_BF16)  # 16-bit operand, as on GPUs
        acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=DOT_PRECISION)
        m_i = m_new

    # l_i == 0 only on masked rows (programs past their sequence's last tile): avoid 0/0
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if EMULATE_BF16:
        o = round_rne(o, BF16_MANT_BITS, BF16_MIN_EXP)
    tl.store(
        out_ptr + tok_row[:, None] * stride_o_t + heads[:, None] * stride_o_h + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def launch_prefill(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [NB, L, 2, BS, Hkv, D]
    layer: int,
    block_tables: torch.Tensor,  # [S, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [S] int32/int64
    query_start_loc: torch.Tensor,  # [S + 1] int32/int64
    scale: float,
    k_scale: torch.Tensor | None,  # [1] or [Hkv] float32 (fp8 only)
    v_scale: torch.Tensor | None,
    geom: PoolGeometry,
    per_head_scale: bool,
    config: PrefillConfig,
    emulate_bf16: bool,
) -> torch.Tensor:  # [T, Hq, D]
    """Launch :func:`_prefill_kernel`; arguments must already be validated by the caller."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // geom.num_kv_heads
    block_g = triton.next_power_of_2(group)
    block_q = max(config.block_q, triton.cdiv(16, block_g))  # tl.dot needs >= 16 rows
    fp8 = k_scale is not None
    dummy = seq_lens
    # grid: enough query tiles for every sequence (see module docstring) x kv heads
    grid = (num_tokens // block_q + num_seqs, geom.num_kv_heads)
    _prefill_kernel[grid](
        out,
        query,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        k_scale if fp8 else dummy,
        v_scale if fp8 else dummy,
        num_seqs,
        layer * kv_cache.stride(1),
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        block_tables.stride(0),
        QUERY_GROUP=group,
        BLOCK_G=block_g,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=geom.block_size,
        TILE_N=config.tile_n,
        FP8=fp8,
        PER_HEAD_SCALE=per_head_scale,
        EMULATE_BF16=emulate_bf16,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
