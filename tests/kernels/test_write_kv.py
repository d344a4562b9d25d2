"""Triton ``write_kv`` against the torch reference: bit-exact, fp8 included (interpreter)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference as ref
from kernels.fp8_scales import compute_kv_scales

FP8 = torch.float8_e4m3fn


def _pool(
    num_blocks: int, block_size: int, hkv: int, d: int, dtype: torch.dtype, layers: int = 3
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    pool = torch.randn(num_blocks, layers, 2, block_size, hkv, d, generator=gen)
    return pool.to(dtype)  # [NB, L, 2, BS, Hkv, D]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == FP8:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.mark.parametrize(
    "src_dtype,pool_dtype,per_head",
    [
        (torch.float32, torch.float32, False),
        (torch.float16, torch.float16, False),
        (torch.bfloat16, torch.bfloat16, False),
        (torch.float32, torch.float16, False),  # pool dtype differs from the activations
        (torch.float16, FP8, False),
        (torch.bfloat16, FP8, True),
        (torch.float32, FP8, True),
    ],
)
@pytest.mark.parametrize("block_size,hkv,d", [(16, 1, 32), (32, 2, 64), (16, 8, 128)])
def test_write_kv_matches_reference(
    triton_backend, src_dtype, pool_dtype, per_head, block_size, hkv, d
):
    num_blocks, layer, n_tok = 12, 1, 40
    gen = torch.Generator().manual_seed(block_size + hkv + d)
    key = (torch.randn(n_tok, hkv, d, generator=gen) * 3).to(src_dtype)  # [T, Hkv, D]
    value = (torch.randn(n_tok, hkv, d, generator=gen) * 0.2).to(src_dtype)
    if pool_dtype == FP8:
        key[0, 0, 0] = 1e6  # saturates: must clamp to ±448, not become NaN
        k_scale, v_scale = compute_kv_scales(key[1:], value, per_head=per_head)
    else:
        k_scale = v_scale = None
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n_tok]  # [T] scattered
    expected = _pool(num_blocks, block_size, hkv, d, pool_dtype)
    actual = expected.clone()
    ref.write_kv(key, value, expected, layer, slots, k_scale, v_scale)
    triton_backend.write_kv(key, value, actual, layer, slots, k_scale, v_scale)
    assert _same_bits(actual, expected)
    assert not torch.isnan(actual.float()).any()
    # the written rows really hold the new values (not just "both left the pool unchanged")
    blk, off = slots // block_size, slots % block_size
    got = actual[blk, layer, 0, off]  # [T, Hkv, D]
    if pool_dtype == FP8:
        got = ref.dequantize_fp8(got, k_scale, torch.float32)
        err = (got - key.float()).abs()[1:]
        assert bool((err <= 0.07 * key.float().abs()[1:] + 2 * k_scale.max()).all())
    else:
        assert torch.equal(got, key.to(pool_dtype))


def test_write_kv_skips_padding_slots_and_other_layers(triton_backend):
    num_blocks, bs, hkv, d = 6, 16, 2, 32
    key = torch.randn(10, hkv, d)
    value = torch.randn(10, hkv, d)
    slots = torch.arange(10) * 7
    slots[[2, 5, 9]] = -1  # padding tokens (CUDA-graph padding)
    pool = _pool(num_blocks, bs, hkv, d, torch.float32)
    before = pool.clone()
    expected = pool.clone()
    ref.write_kv(key, value, expected, 2, slots)
    triton_backend.write_kv(key, value, pool, 2, slots)
    assert torch.equal(pool, expected)
    changed = (pool != before).any(dim=(2, 4, 5))  # [NB, L, BS]
    written = torch.zeros_like(changed)
    real = slots[slots >= 0]
    written[real // bs, 2, real % bs] = True
    assert torch.equal(changed, written)


def test_write_kv_strided_views_from_fused_qkv(triton_backend):
    """K and V sliced out of a fused qkv projection (token stride > Hkv * D) are read correctly."""
    t, hq, hkv, d, bs = 9, 8, 2, 64, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * d, dtype=torch.float16)
    key = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)  # [T, Hkv, D], token stride (hq+2hkv)*d
    value = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    assert not key.is_contiguous()
    slots = torch.tensor([3, 17, 18, 40, 41, 42, 0, 63, 20])
    expected = _pool(4, bs, hkv, d, torch.float16, layers=1)
    actual = expected.clone()
    ref.write_kv(key, value, expected, 0, slots)
    triton_backend.write_kv(key, value, actual, 0, slots)
    assert torch.equal(actual, expected)


def test_write_kv_int32_slots_and_empty_step(triton_backend):
    pool = _pool(4, 16, 1, 32, torch.float16, layers=1)
    before = pool.clone()
    empty = torch.empty(0, 1, 32, dtype=torch.float16)
    triton_backend.write_kv(empty, empty, pool, 0, torch.empty(0, dtype=torch.int64))
    assert torch.equal(pool, before)
    key = torch.randn(3, 1, 32, dtype=torch.float16)
    triton_backend.write_kv(key, key, pool, 0, torch.tensor([5, 6, 63], dtype=torch.int32))
    assert torch.equal(pool[0, 0, 0, 5], key[0]) and torch.equal(pool[3, 0, 1, 15], key[2])
