"""Triton paged decode attention against the torch reference, under the interpreter.

Unmarked cases are a representative subset (each dtype, head dim, block size and GQA ratio at
least once, split-K on and off, a context of several thousand tokens); the ``slow`` sweep runs
their full cross product.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_cases import FP8, assert_close, make_case

from kernels import reference as ref
from kernels.checks import check_pool
from kernels.triton_decode import DecodeConfig, launch_decode

# (query dtype, pool dtype, per-head fp8 scales)
DTYPES = [
    (torch.float32, torch.float32, False),
    (torch.float16, torch.float16, False),
    (torch.bfloat16, torch.bfloat16, False),
    (torch.float16, FP8, False),
    (torch.bfloat16, FP8, True),
]
# (head_dim, block_size, num_heads, num_kv_heads): GQA ratios 1, 3, 4, 8
GEOMETRIES = [(32, 16, 4, 1), (64, 32, 8, 1), (128, 16, 2, 2), (64, 16, 6, 2)]
SEQ_LENS = [1, 2, 15, 16, 17, 33, 130, 300]


def _ids(params):
    return [str(p).replace(" ", "").replace("torch.", "") for p in params]


def _run_decode(backend, case, config: DecodeConfig | None = None) -> torch.Tensor:
    if config is None:
        return backend.paged_decode_attention(*case.decode_args())
    geom = check_pool(case.kv_cache, case.layer)
    return launch_decode(
        case.query,
        case.kv_cache,
        case.layer,
        case.block_tables,
        case.seq_lens,
        case.scale,
        case.k_scale,
        case.v_scale,
        geom,
        case.k_scale is not None and case.k_scale.numel() > 1,
        config,
        backend._emulate_bf16(case.query.dtype),
    )


@pytest.mark.parametrize("dtype,kv_dtype,per_head", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("head_dim,block_size,hq,hkv", GEOMETRIES, ids=_ids(GEOMETRIES))
def test_decode_matches_reference(
    triton_backend, dtype, kv_dtype, per_head, head_dim, block_size, hq, hkv
):
    case = make_case(
        SEQ_LENS,
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        kv_dtype=kv_dtype,
        per_head_scale=per_head,
        seed=head_dim + hq,
    )
    expected = ref.paged_decode_attention(*case.decode_args())
    actual = triton_backend.paged_decode_attention(*case.decode_args())
    assert_close(actual, expected, dtype, f"decode {dtype} kv={kv_dtype}")


@pytest.mark.parametrize("num_splits,tile_n", [(2, 32), (4, 64), (8, 32), (16, 64)])
@pytest.mark.parametrize("dtype,kv_dtype,per_head", [DTYPES[1], DTYPES[4]], ids=["f16", "fp8"])
def test_split_k_decode_matches_reference(
    triton_backend, num_splits, tile_n, dtype, kv_dtype, per_head
):
    """Split-K with uneven and empty splits: short sequences leave most splits without work."""
    case = make_case(
        [1, 20, 700, 64, 1111],
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        kv_dtype=kv_dtype,
        per_head_scale=per_head,
        seed=num_splits,
    )
    expected = ref.paged_decode_attention(*case.decode_args())
    actual = _run_decode(triton_backend, case, DecodeConfig(tile_n=tile_n, num_splits=num_splits))
    assert_close(actual, expected, dtype, f"split-K {num_splits}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_several_thousand_tokens(triton_backend, dtype):
    case = make_case(
        [4100, 2500], num_heads=8, num_kv_heads=1, head_dim=128, block_size=32, dtype=dtype, seed=11
    )
    expected = ref.paged_decode_attention(*case.decode_args())
    # public API (heuristic config) and an explicit split-K config
    assert_close(
        triton_backend.paged_decode_attention(*case.decode_args()), expected, dtype, "long decode"
    )
    assert_close(
        _run_decode(triton_backend, case, DecodeConfig(tile_n=128, num_splits=4)),
        expected,
        dtype,
        "long decode split-K",
    )


def test_decode_batch_of_one_token_contexts(triton_backend):
    """seq_len == 1: the output is exactly the single value vector (softmax of one score)."""
    case = make_case([1, 1, 1], num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    out = triton_backend.paged_decode_attention(*case.decode_args())  # [S, Hq, D]
    v = case.kv_cache[case.block_tables[:, 0].long(), case.layer, 1, 0]  # [S, Hkv, D]
    assert torch.allclose(out, v.repeat_interleave(2, dim=1), atol=1e-6)


def test_decode_config_heuristic(triton_backend):
    cfg = triton_backend.decode_config
    assert cfg(256, 8, 8192, 128, num_sms=132).num_splits == 1  # big batch fills the GPU
    long_small = cfg(1, 8, 32768, 128, num_sms=132)
    assert 1 < long_small.num_splits <= triton_backend.MAX_DECODE_SPLITS
    assert cfg(1, 8, 256, 128, num_sms=132).num_splits == 1  # too short to split
    for s, h, ctx in itertools.product([1, 4, 64], [1, 8], [16, 4096, 131072]):
        c = cfg(s, h, ctx, 128, num_sms=132)
        assert c.num_splits & (c.num_splits - 1) == 0 and c.tile_n >= 16


SWEEP = list(itertools.product(DTYPES, [32, 64, 128], [16, 32], [(4, 4), (8, 2), (8, 1)], [1, 4]))


@pytest.mark.slow
@pytest.mark.parametrize("dtypes,head_dim,block_size,heads,num_splits", SWEEP, ids=_ids(SWEEP))
def test_decode_sweep(triton_backend, dtypes, head_dim, block_size, heads, num_splits):
    dtype, kv_dtype, per_head = dtypes
    hq, hkv = heads
    case = make_case(
        [1, 5, 16, 31, 257, 1500],
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        kv_dtype=kv_dtype,
        per_head_scale=per_head,
        seed=head_dim * block_size + hq,
    )
    expected = ref.paged_decode_attention(*case.decode_args())
    actual = _run_decode(triton_backend, case, DecodeConfig(tile_n=64, num_splits=num_splits))
    assert_close(actual, expected, dtype, "decode sweep")
