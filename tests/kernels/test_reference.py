"""The torch reference (the oracle of every kernel test) against naive per-token loops."""

from __future__ import annotations

import math

import torch
from kernel_cases import FP8, make_case

from kernels import reference as ref


def _naive(case) -> torch.Tensor:
    """Row-by-row softmax attention, reading K/V token by token through the block table."""
    q_all = case.query.double()
    t, hq, d = q_all.shape
    bs, hkv = case.kv_cache.shape[3], case.kv_cache.shape[4]
    out = torch.full((t, hq, d), float("nan"), dtype=torch.float64)
    qsl = case.query_start_loc.tolist()
    for s, ctx in enumerate(case.seq_lens.tolist()):
        q_len = qsl[s + 1] - qsl[s]
        keys, vals = [], []
        for pos in range(ctx):
            blk = int(case.block_tables[s, pos // bs])
            k = case.kv_cache[blk, case.layer, 0, pos % bs]  # [Hkv, D]
            v = case.kv_cache[blk, case.layer, 1, pos % bs]
            if case.kv_cache.dtype == FP8:
                k = ref.dequantize_fp8(k, case.k_scale, case.query.dtype)
                v = ref.dequantize_fp8(v, case.v_scale, case.query.dtype)
            keys.append(k.double())
            vals.append(v.double())
        for i in range(q_len):
            row = qsl[s] + i
            visible = ctx - q_len + i + 1
            for h in range(hq):
                kh = h // (hq // hkv)
                scores = torch.stack([keys[j][kh] @ q_all[row, h] for j in range(visible)])
                w = torch.softmax(scores * case.scale, 0)
                out[row, h] = sum(w[j] * vals[j][kh] for j in range(visible))
    return out


def test_reference_attention_matches_naive_loops():
    for kv_dtype, per_head in ((torch.float32, False), (FP8, True)):
        case = make_case(
            [5, 40, 19, 33],
            [5, 7, 1, 0],
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            block_size=16,
            dtype=torch.float32,
            kv_dtype=kv_dtype,
            per_head_scale=per_head,
            seed=3,
        )
        expected = _naive(case)
        got = ref.paged_attention(*case.attention_args()).double()
        rows = torch.arange(case.query.shape[0]) < int(case.query_start_loc[-1])
        assert torch.allclose(got[rows], expected[rows], atol=1e-5)
        decode = make_case(
            [1, 30, 64],
            num_heads=4,
            num_kv_heads=1,
            head_dim=16,
            dtype=torch.float32,
            kv_dtype=kv_dtype,
            seed=4,
        )
        got = ref.paged_decode_attention(*decode.decode_args()).double()
        assert torch.allclose(got, _naive(decode), atol=1e-5)


def test_reference_fp8_round_trip_and_saturation():
    x = torch.tensor([[[0.0, 1.0, -3.3, 1000.0, -1e9, 4e-4]]])  # [1, 1, 6]
    scale = torch.tensor([0.5])
    q = ref.quantize_fp8(x, scale)
    assert q.dtype == FP8
    back = ref.dequantize_fp8(q, scale, torch.float32)
    assert back[0, 0, 3] == 224.0 and back[0, 0, 4] == -224.0  # saturated at ±448 * scale
    assert math.isclose(float(back[0, 0, 2]), -3.25)  # nearest e4m3 value of -6.6, times 0.5
    assert back[0, 0, 5] == 0.0 and not torch.isnan(back).any()


def test_reference_write_kv_skips_negative_slots():
    pool = torch.zeros(2, 1, 2, 4, 1, 2)
    key = torch.ones(3, 1, 2)
    ref.write_kv(key, key * 2, pool, 0, torch.tensor([1, -1, 6]))
    assert pool[0, 0, 0, 1].eq(1).all() and pool[1, 0, 1, 2].eq(2).all()
    assert int((pool != 0).sum()) == 2 * 2 * 2  # two slots, K and V, 2 dims each
