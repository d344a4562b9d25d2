"""Triton backend of the paged-KV kernels: same functions, signatures and semantics as
``kernels/reference.py`` (see its docstring for the pool layout, slots and fp8 scales).

- :func:`write_kv` -> ``kernels/triton_write_kv.py`` (slot-mapped store, fp8 quantize)
- :func:`paged_decode_attention` -> ``kernels/triton_decode.py`` (split-K decode)
- :func:`paged_attention` -> ``kernels/triton_prefill.py`` (varlen causal prefill over paged KV;
  also correct for decode rows and mixed batches)

Each function validates dtypes, shapes, devices and strides from tensor metadata (never a device
sync) and raises :class:`kernels.checks.KernelArgumentError` on bad input. Index *values* (slots,
block ids, lengths) are checked too when the tensors are on the CPU (the interpreter, where a bad
index would crash the process) or when ``PDSERVE_KERNEL_CHECKS=1``; on CUDA they are otherwise
trusted, as in vLLM, because checking them costs a sync per layer.

Launch configurations are derived from shapes only, so the calls are CUDA-graph friendly.
CPU tensors run only under ``TRITON_INTERPRET=1`` set before this module is imported.
"""

from __future__ import annotations

import os

import torch
import triton

from kernels.checks import (
    FP8_DTYPE,
    QUERY_DTYPES,
    KernelArgumentError,
    PoolGeometry,
    check_gqa,
    check_heads,
    check_index,
    check_pool,
    check_same_device,
    check_scales,
    require,
)
from kernels.triton_decode import DecodeConfig, _decode_kernel, launch_decode
from kernels.triton_prefill import PrefillConfig, launch_prefill
from kernels.triton_write_kv import launch_write_kv

__all__ = [
    "KernelArgumentError",
    "argmax_rows",
    "decode_config",
    "paged_attention",
    "paged_decode_attention",
    "prefill_config",
    "write_kv",
]

MAX_DECODE_SPLITS = 16
MIN_TOKENS_PER_SPLIT = 256


def _interpreted() -> bool:
    """Whether the kernels were built by the CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return not isinstance(_decode_kernel, triton.runtime.JITFunction)


def _check_device(device: torch.device) -> None:
    if device.type == "cpu":
        require(
            _interpreted(),
            lambda: (
                "the Triton backend got CPU tensors but Triton is not in interpreter mode; use the "
                "'torch' backend on CPU, or set TRITON_INTERPRET=1 before importing kernels"
            ),
        )
    else:
        require(
            device.type == "cuda", lambda: f"the Triton backend needs CUDA tensors, got {device}"
        )


def _check_fp8_support(kv_cache: torch.Tensor) -> None:
    # Triton lowers e4m3 ("fp8e4nv") conversions only for compute capability >= 8.9.
    if kv_cache.dtype == FP8_DTYPE and kv_cache.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(kv_cache.device)
        require(
            (major, minor) >= (8, 9),
            lambda: (
                f"an fp8 KV cache needs compute capability >= 8.9 in the Triton backend (device has "
                f"{major}.{minor}); use --kv-cache-dtype auto or --attention-backend torch"
            ),
        )


def _check_values() -> bool:
    return os.environ.get("PDSERVE_KERNEL_CHECKS") == "1"


def _emulate_bf16(dtype: torch.dtype) -> bool:
    # The interpreter's bf16 is defective (casts truncate; tl.dot multiplies raw uint16 bit
    # patterns), so under it bf16 attention runs on fp32 values rounded to the bf16 grid
    # (kernels/triton_rounding.py). Always False on GPUs.
    return dtype == torch.bfloat16 and _interpreted()


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def decode_config(
    num_seqs: int, num_kv_heads: int, max_context: int, head_dim: int, num_sms: int
) -> DecodeConfig:
    """Pick tile size and split count from shapes: split long contexts until the grid covers
    about two waves of SMs, keeping at least ``MIN_TOKENS_PER_SPLIT`` tokens per split."""
    tile_n = 64 if head_dim <= 128 else 32
    splits = 1
    programs = max(1, num_seqs * num_kv_heads)
    while (
        splits < MAX_DECODE_SPLITS
        and programs * splits < 2 * num_sms
        and max_context >= 2 * splits * MIN_TOKENS_PER_SPLIT
    ):
        splits *= 2
    return DecodeConfig(tile_n=tile_n, num_splits=splits, num_warps=4, num_stages=2)


def prefill_config(num_tokens: int, num_seqs: int, group: int, head_dim: int) -> PrefillConfig:
    """Row tile ``BLOCK_M`` of 64 (128 for long chunks with head_dim <= 128), shrunk toward the
    mean chunk length so decode-heavy mixed batches do not waste rows."""
    block_g = triton.next_power_of_2(group)
    mean_q = max(1, num_tokens // max(1, num_seqs))
    block_m = 128 if (mean_q >= 256 and head_dim <= 128) else 64
    block_q = max(1, min(block_m // block_g, triton.next_power_of_2(mean_q)))
    return PrefillConfig(
        block_q=block_q,
        tile_n=64 if head_dim <= 128 else 32,
        num_warps=8 if block_m == 128 else 4,
        num_stages=2,
    )


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [NB, L, 2, BS, Hkv, D]
    layer: int,
    slot_mapping: torch.Tensor,  # [T] int64 (int32 accepted); < 0 = padding, skipped
    k_scale: torch.Tensor | None = None,  # [1] or [Hkv] float32, fp8 only
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store this step's K/V of ``layer`` into their slots (quantizing for an fp8 pool)."""
    geom = check_pool(kv_cache, layer)
    _check_device(kv_cache.device)
    check_heads("key", key, geom.num_kv_heads, geom.head_dim, QUERY_DTYPES)
    check_heads("value", value, geom.num_kv_heads, geom.head_dim, QUERY_DTYPES)
    require(
        value.shape[0] == key.shape[0],
        lambda: f"key has {key.shape[0]} tokens but value has {value.shape[0]}",
    )
    check_index("slot_mapping", slot_mapping, (key.shape[0],))
    per_head = check_scales(kv_cache, geom.num_kv_heads, k_scale, v_scale)
    _check_fp8_support(kv_cache)
    check_same_device(
        kv_cache.device,
        key=key,
        value=value,
        slot_mapping=slot_mapping,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    if kv_cache.device.type == "cpu" or _check_values():
        n_slots = geom.num_blocks * geom.block_size
        require(
            bool((slot_mapping < n_slots).all()),
            lambda: f"slot_mapping has slots >= num_blocks * block_size = {n_slots}",
        )
    launch_write_kv(
        key, value, kv_cache, layer, slot_mapping, k_scale, v_scale, geom, per_head, _interpreted()
    )


def _check_tables(
    geom: PoolGeometry,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_lens: torch.Tensor | None,
) -> None:
    """Value checks (may sync): lengths fit the tables, used block ids are inside the pool."""
    max_ctx = block_tables.shape[1] * geom.block_size
    lens = seq_lens.long()
    require(bool((lens >= 1).all()), lambda: "seq_lens must be >= 1")
    require(
        bool((lens <= max_ctx).all()),
        lambda: f"seq_lens exceed block_tables capacity {max_ctx} tokens",
    )
    if q_lens is not None:
        require(bool((q_lens >= 0).all()), lambda: "query_start_loc must be non-decreasing")
        require(bool((q_lens <= lens).all()), lambda: "a query chunk is longer than its seq_len")
    used = torch.arange(block_tables.shape[1], device=lens.device)[None, :] * geom.block_size
    used = used < lens[:, None]  # [S, max_blocks] blocks holding context
    ids = block_tables.long()[used]
    require(
        bool(((ids >= 0) & (ids < geom.num_blocks)).all()),
        lambda: f"block_tables reference blocks outside [0, {geom.num_blocks})",
    )


def _check_attention_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    num_seqs: int,
) -> tuple[PoolGeometry, bool]:
    geom = check_pool(kv_cache, layer)
    _check_device(kv_cache.device)
    check_heads("query", query, None, geom.head_dim, QUERY_DTYPES)
    check_gqa(query.shape[1], geom.num_kv_heads)
    require(
        block_tables.dim() == 2,
        lambda: f"block_tables must be [num_seqs, max_blocks], got {tuple(block_tables.shape)}",
    )
    check_index("block_tables", block_tables, (num_seqs, block_tables.shape[1]))
    check_index("seq_lens", seq_lens, (num_seqs,))
    per_head = check_scales(kv_cache, geom.num_kv_heads, k_scale, v_scale)
    _check_fp8_support(kv_cache)
    check_same_device(
        kv_cache.device,
        query=query,
        block_tables=block_tables,
        seq_lens=seq_lens,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return geom, per_head


def paged_decode_attention(
    query: torch.Tensor,  # [S, Hq, D], one query token per sequence
    kv_cache: torch.Tensor,  # [NB, L, 2, BS, Hkv, D]
    layer: int,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32, context length incl. the query token (>= 1)
    scale: float,
    k_scale: torch.Tensor | None = None,  # [1] or [Hkv] float32, fp8 only
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [S, Hq, D]
    """Single-token attention for a batch of sequences over their paged KV (split-K)."""
    num_seqs = query.shape[0] if query.dim() == 3 else -1
    geom, per_head = _check_attention_args(
        query, kv_cache, layer, block_tables, seq_lens, k_scale, v_scale, num_seqs
    )
    if num_seqs and (kv_cache.device.type == "cpu" or _check_values()):
        _check_tables(geom, block_tables, seq_lens, None)
    config = decode_config(
        num_seqs,
        geom.num_kv_heads,
        block_tables.shape[1] * geom.block_size,
        geom.head_dim,
        _num_sms(query.device),
    )
    return launch_decode(
        query,
        kv_cache,
        layer,
        block_tables,
        seq_lens,
        float(scale),
        k_scale,
        v_scale,
        geom,
        per_head,
        config,
        _emulate_bf16(query.dtype),
    )


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D], sequences packed back to back
    kv_cache: torch.Tensor,  # [NB, L, 2, BS, Hkv, D], already holding this step's K/V
    layer: int,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32: tokens of context per sequence, query included
    query_start_loc: torch.Tensor,  # [S + 1] int32: query s is rows [qsl[s], qsl[s+1])
    scale: float,
    k_scale: torch.Tensor | None = None,  # [1] or [Hkv] float32, fp8 only
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each sequence's query chunk over its whole paged context.

    Same contract as ``kernels.reference.paged_attention``: the rows of sequence ``s`` are its
    last ``q_len`` positions and row ``i`` sees context positions ``<= seq_len - q_len + i``.
    Rows not covered by any ``[qsl[s], qsl[s+1])`` are left unwritten.
    """
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    geom, per_head = _check_attention_args(
        query, kv_cache, layer, block_tables, seq_lens, k_scale, v_scale, num_seqs
    )
    check_index("query_start_loc", query_start_loc, (num_seqs + 1,))
    check_same_device(kv_cache.device, query_start_loc=query_start_loc)
    num_tokens = query.shape[0]
    if num_seqs and (kv_cache.device.type == "cpu" or _check_values()):
        qsl = query_start_loc.long()
        require(
            int(qsl[0]) >= 0 and int(qsl[-1]) <= num_tokens,
            lambda: f"query_start_loc must lie in [0, {num_tokens}]",
        )
        _check_tables(geom, block_tables, seq_lens, qsl[1:] - qsl[:-1])
    group = check_gqa(query.shape[1], geom.num_kv_heads)
    config = prefill_config(num_tokens, num_seqs, group, geom.head_dim)
    return launch_prefill(
        query,
        kv_cache,
        layer,
        block_tables,
        seq_lens,
        query_start_loc,
        float(scale),
        k_scale,
        v_scale,
        geom,
        per_head,
        config,
        _emulate_bf16(query.dtype),
    )


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``[N, V]`` -> ``[N]`` greedy ids (the backend contract of ``kernels/reference.py``)."""
    return logits.argmax(dim=-1)
