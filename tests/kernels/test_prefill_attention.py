"""Triton varlen paged attention (prefill / chunked prefill / mixed) against the torch reference.

Sequences are packed without padding and mix every kind of row a V1-style scheduler produces:
full prompts, chunks continuing earlier chunks or prefix-cache hits (context already in the
pool), decode rows (one query) and sequences with no query this step.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_cases import FP8, assert_close, make_case

from kernels import reference as ref
from kernels.checks import check_pool
from kernels.triton_prefill import PrefillConfig, launch_prefill

DTYPES = [
    (torch.float32, torch.float32, False),
    (torch.float16, torch.float16, False),
    (torch.bfloat16, torch.bfloat16, False),
    (torch.float16, FP8, True),
    (torch.bfloat16, FP8, False),
]
GEOMETRIES = [(32, 16, 4, 1), (64, 32, 8, 1), (128, 16, 2, 2), (64, 16, 6, 2)]
# (seq_len, q_len): full prompt, continuing chunk / prefix hit, decode row, idle, tiny prompt
MIXED = [(37, 37), (100, 21), (50, 1), (20, 0), (1, 1), (64, 17)]


def _ids(params):
    return [str(p).replace(" ", "").replace("torch.", "") for p in params]


def _run(backend, case, config: PrefillConfig | None = None) -> torch.Tensor:
    if config is None:
        return backend.paged_attention(*case.attention_args())
    geom = check_pool(case.kv_cache, case.layer)
    return launch_prefill(
        case.query,
        case.kv_cache,
        case.layer,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        case.scale,
        case.k_scale,
        case.v_scale,
        geom,
        case.k_scale is not None and case.k_scale.numel() > 1,
        config,
        backend._emulate_bf16(case.query.dtype),
    )


def _mixed_case(**kw):
    return make_case([s for s, _ in MIXED], [q for _, q in MIXED], **kw)


@pytest.mark.parametrize("dtype,kv_dtype,per_head", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("head_dim,block_size,hq,hkv", GEOMETRIES, ids=_ids(GEOMETRIES))
def test_mixed_batch_matches_reference(
    triton_backend, dtype, kv_dtype, per_head, head_dim, block_size, hq, hkv
):
    case = _mixed_case(
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        kv_dtype=kv_dtype,
        per_head_scale=per_head,
        seed=head_dim,
    )
    expected = ref.paged_attention(*case.attention_args())
    actual = triton_backend.paged_attention(*case.attention_args())
    assert_close(actual, expected, dtype, f"mixed batch {dtype} kv={kv_dtype}")


@pytest.mark.parametrize("block_q,tile_n", [(1, 64), (2, 32), (8, 16), (16, 64), (32, 32)])
def test_tile_shapes_match_reference(triton_backend, block_q, tile_n):
    """Query tiles straddling sequence ends, KV tiles straddling pool blocks and the diagonal."""
    case = _mixed_case(
        num_heads=8, num_kv_heads=2, head_dim=64, block_size=32, dtype=torch.float16, seed=block_q
    )
    expected = ref.paged_attention(*case.attention_args())
    actual = _run(triton_backend, case, PrefillConfig(block_q=block_q, tile_n=tile_n))
    assert_close(actual, expected, torch.float16, f"tiles {block_q}x{tile_n}")


@pytest.mark.parametrize(
    "dtype,kv_dtype",
    [(torch.float16, torch.float16), (torch.bfloat16, FP8)],
    ids=["f16", "bf16-fp8"],
)
def test_chunk_over_thousands_of_cached_tokens(triton_backend, dtype, kv_dtype):
    """A 16-token chunk after a 3000-token prefix already in the pool, packed with a prompt."""
    case = make_case(
        [3016, 120],
        [16, 120],
        num_heads=8,
        num_kv_heads=1,
        head_dim=128,
        block_size=16,
        dtype=dtype,
        kv_dtype=kv_dtype,
        seed=5,
    )
    expected = ref.paged_attention(*case.attention_args())
    actual = triton_backend.paged_attention(*case.attention_args())
    assert_close(actual, expected, dtype, "long prefix chunk")


def test_decode_rows_agree_with_decode_kernel(triton_backend):
    """All q_len == 1: the varlen kernel and the split-K decode kernel compute the same thing."""
    case = make_case(
        [1, 9, 200, 513], num_heads=4, num_kv_heads=1, head_dim=64, dtype=torch.float32, seed=9
    )
    varlen = triton_backend.paged_attention(*case.attention_args())
    decode = triton_backend.paged_decode_attention(*case.decode_args())
    assert torch.allclose(varlen, decode, atol=1e-5, rtol=1e-5)


def test_chunked_prefill_equals_whole_prompt(triton_backend):
    """Attending a prompt in three chunks gives the rows of one whole-prompt pass."""
    whole = make_case(
        [150], [150], num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32, seed=4
    )
    full = triton_backend.paged_attention(*whole.attention_args())
    pieces = []
    for end, q_len in ((40, 40), (100, 60), (150, 50)):
        start = end - q_len
        pieces.append(
            triton_backend.paged_attention(
                whole.query[start:end],
                whole.kv_cache,
                whole.layer,
                whole.block_tables,
                torch.tensor([end], dtype=torch.int32),
                torch.tensor([0, q_len], dtype=torch.int32),
                whole.scale,
            )
        )
    assert torch.allclose(torch.cat(pieces), full, atol=1e-5, rtol=1e-5)


def test_prefill_config_heuristic(triton_backend):
    cfg = triton_backend.prefill_config
    long = cfg(num_tokens=8192, num_seqs=2, group=4, head_dim=128)
    assert long.block_q * 4 == 128 and long.num_warps == 8
    mostly_decode = cfg(num_tokens=70, num_seqs=64, group=8, head_dim=128)
    assert mostly_decode.block_q == 1  # one query row per program for decode rows
    assert cfg(num_tokens=100, num_seqs=1, group=1, head_dim=64).block_q == 64


SWEEP = list(itertools.product(DTYPES, [32, 64, 128], [16, 32], [(4, 4), (8, 2), (8, 1)]))


@pytest.mark.slow
@pytest.mark.parametrize("dtypes,head_dim,block_size,heads", SWEEP, ids=_ids(SWEEP))
def test_prefill_sweep(triton_backend, dtypes, head_dim, block_size, heads):
    dtype, kv_dtype, per_head = dtypes
    hq, hkv = heads
    case = make_case(
        [300, 257, 1, 33, 90],
        [300, 40, 1, 1, 90],
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        kv_dtype=kv_dtype,
        per_head_scale=per_head,
        seed=head_dim + hq,
    )
    expected = ref.paged_attention(*case.attention_args())
    actual = triton_backend.paged_attention(*case.attention_args())
    assert_close(actual, expected, dtype, "prefill sweep")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_of_a_2k_prompt(triton_backend, dtype):
    case = make_case(
        [2100],
        [2100],
        num_heads=4,
        num_kv_heads=1,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        seed=21,
    )
    expected = ref.paged_attention(*case.attention_args())
    actual = triton_backend.paged_attention(*case.attention_args())
    assert_close(actual, expected, dtype, "2k prompt")
