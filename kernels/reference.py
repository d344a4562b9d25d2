"""Plain-torch reference implementations of the paged-KV kernels.

These are the oracle for the Triton kernels' tests and the engine's CPU attention path. They
implement exactly the same contracts as ``kernels/triton_paged.py``:

KV pool layout (block-major, one block = one contiguous region = one transfer unit)::

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]   (2 = K, V)

A token's *slot* is ``block_id * block_size + offset_in_block``.

fp8 KV (``kv_cache.dtype == torch.float8_e4m3fn``): stored = clamp(x / scale, ±448) in e4m3;
read = stored * scale. ``k_scale`` / ``v_scale`` are float32 tensors of shape ``[1]``
(per-tensor) or ``[num_kv_heads]`` (per-head). For other dtypes they must be ``None``.

This module imports nothing from the project (kernels depend on torch only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.checks import KernelArgumentError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def is_fp8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == FP8_DTYPE


def _scale_view(scale: torch.Tensor, ndim: int) -> torch.Tensor:
    # scale: [1] or [Hkv] -> broadcastable over [..., Hkv, D] with `ndim` dims
    return scale.to(torch.float32).view(*([1] * (ndim - 2)), -1, 1)


def _require_scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    if k_scale is None or v_scale is None:
        raise KernelArgumentError("an fp8 KV cache needs k_scale and v_scale")


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: [..., Hkv, D] -> fp8 e4m3 (x / scale, saturated)."""
    y = x.to(torch.float32) / _scale_view(scale, x.dim())
    return y.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: [..., Hkv, D] fp8 -> ``dtype`` (x * scale)."""
    return (x.to(torch.float32) * _scale_view(scale, x.dim())).to(dtype)


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [NB, L, 2, BS, Hkv, D]
    layer: int,
    slot_mapping: torch.Tensor,  # [T] int64, slot = block * BS + offset; < 0 = padding
    k_scale: torch.Tensor | None = None,  # [1] or [Hkv] float32, fp8 only
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store this step's K/V of ``layer`` into their slots (quantizing for an fp8 pool).

    A negative slot marks a padding token (as in vLLM's ``reshape_and_cache``) and is skipped.
    """
    block_size = kv_cache.shape[3]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    slot_mapping = slot_mapping.long()
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    if is_fp8(kv_cache):
        _require_scales(k_scale, v_scale)
        key = quantize_fp8(key, k_scale)
        value = quantize_fp8(value, v_scale)
    else:
        key = key.to(kv_cache.dtype)
        value = value.to(kv_cache.dtype)
    kv_cache[blocks, layer, 0, offsets] = key
    kv_cache[blocks, layer, 1, offsets] = value


def gather_kv(
    kv_cache: torch.Tensor,  # [NB, L, 2, BS, Hkv, D]
    layer: int,
    block_ids: torch.Tensor,  # [n] int
    length: int,
    dtype: torch.dtype,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first ``length`` tokens held in ``block_ids``: two ``[length, Hkv, D]``."""
    _, _, _, bs, h, d = kv_cache.shape
    kv = kv_cache[block_ids.long(), layer]  # [n, 2, BS, Hkv, D]
    k = kv[:, 0].reshape(-1, h, d)[:length]
    v = kv[:, 1].reshape(-1, h, d)[:length]
    if is_fp8(kv_cache):
        _require_scales(k_scale, v_scale)
        return dequantize_fp8(k, k_scale, dtype), dequantize_fp8(v, v_scale, dtype)
    return k.to(dtype), v.to(dtype)


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D], sequences packed back to back
    kv_cache: torch.Tensor,  # [NB, L, 2, BS, Hkv, D], already holding this step's K/V
    layer: int,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32: tokens of context per sequence, query included
    query_start_loc: torch.Tensor,  # [S + 1] int32: query s is rows [qsl[s], qsl[s+1])
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each sequence's query chunk over its whole paged context.

    The query rows of sequence ``s`` are its last ``q_len`` positions
    (``seq_lens[s] - q_len .. seq_lens[s] - 1``); row ``i`` attends to context positions
    ``<= seq_lens[s] - q_len + i``. Covers prefill, chunked prefill and prefix-cache hits
    (context written in earlier steps) and decode (``q_len == 1``).
    """
    return paged_attention_with(
        _attend,
        paged_decode_attention,
        query,
        kv_cache,
        layer,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        k_scale,
        v_scale,
    )


def paged_attention_with(
    attend,
    decode_attention,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_attention`` with a backend's kernels: ``attend`` (``_attend``'s contract) runs
    each sequence's chunk over its gathered K/V, ``decode_attention``
    (``paged_decode_attention``'s) the single-token rows, all in one call."""
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode_rows: list[int] = []
    for s, ctx in enumerate(lens):
        q0, q1 = qsl[s], qsl[s + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        if q_len == 1:
            decode_rows.append(s)
            continue
        n_blocks = -(-ctx // kv_cache.shape[3])
        k, v = gather_kv(
            kv_cache, layer, block_tables[s, :n_blocks], ctx, query.dtype, k_scale, v_scale
        )
        out[q0:q1] = attend(query[q0:q1], k, v, scale, ctx - q_len)
    if decode_rows:
        rows = torch.tensor(decode_rows, device=query.device)
        idx = query_start_loc[rows].long()
        out[idx] = decode_attention(
            query[idx], kv_cache, layer, block_tables[rows], seq_lens[rows], scale, k_scale, v_scale
        )
    return out


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, offset: int
) -> torch.Tensor:
    """q: [Tq, Hq, D], k/v: [Tk, Hkv, D]; query row i sees keys <= offset + i."""
    tq, tk = q.shape[0], k.shape[0]
    # [1, H, T, D]: with a batch dimension SDPA takes its fused (flash) CPU kernel; 3-D inputs
    # fall back to the unfused math path, ~7x slower on a 2048-token chunk.
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    gqa = qh.shape[1] != kh.shape[1]
    if offset == 0 and tq == tk:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        pos_q = torch.arange(tq, device=q.device).unsqueeze(1) + offset
        mask = torch.arange(tk, device=q.device).unsqueeze(0) <= pos_q  # [Tq, Tk]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.squeeze(0).transpose(0, 1)


def paged_decode_attention(
    query: torch.Tensor,  # [S, Hq, D], one query token per sequence
    kv_cache: torch.Tensor,  # [NB, L, 2, BS, Hkv, D]
    layer: int,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32, context length incl. the query token
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [S, Hq, D]
    """Single-token attention for a batch of sequences over their paged KV."""
    num_seqs, num_heads, head_dim = query.shape
    bs = kv_cache.shape[3]
    num_kv_heads = kv_cache.shape[4]
    max_len = int(seq_lens.max())
    n_blocks = -(-max_len // bs)
    tables = block_tables[:, :n_blocks].long()  # [S, nb]
    kv = kv_cache[tables, layer]  # [S, nb, 2, BS, Hkv, D]
    k = kv[:, :, 0].reshape(num_seqs, n_blocks * bs, num_kv_heads, head_dim)
    v = kv[:, :, 1].reshape(num_seqs, n_blocks * bs, num_kv_heads, head_dim)
    if is_fp8(kv_cache):
        _require_scales(k_scale, v_scale)
        k = dequantize_fp8(k, k_scale, query.dtype)
        v = dequantize_fp8(v, v_scale, query.dtype)
    elif k.dtype != query.dtype:
        k, v = k.to(query.dtype), v.to(query.dtype)
    mask = torch.arange(n_blocks * bs, device=query.device).unsqueeze(
        0
    ) < seq_lens.long().unsqueeze(1)  # [S, Tk]
    o = F.scaled_dot_product_attention(
        query.unsqueeze(2),  # [S, Hq, 1, D]
        k.transpose(1, 2),  # [S, Hkv, Tk, D]
        v.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return o.squeeze(2)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``[N, V]`` logits (any float dtype) -> ``[N]`` ids of each row's first maximum; exact
    (an upcast changes no comparison). Every backend provides it for greedy sampling."""
    return logits.float().argmax(dim=-1)
