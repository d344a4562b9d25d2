"""A pool past 2**31 elements: block offsets only fit int64 (``block_id * stride_block``).

The pool is a plain ``torch.empty`` of a few GiB: Linux maps it lazily, and only the pages of
the handful of blocks the test touches become resident (the interpreter passes CPU tensors by
pointer, without copying them). A kernel that computed offsets in int32 would wrap around and
read or write far outside the intended block (typically crashing the process).
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import FP8, assert_close

from kernels import reference as ref
from kernels.fp8_scales import compute_kv_scales

BS, HKV, D, HQ = 16, 1, 32, 4
ELEMENTS_PER_BLOCK = 2 * BS * HKV * D  # one layer


def _huge_pool(dtype: torch.dtype) -> torch.Tensor:
    num_blocks = (1 << 31) // ELEMENTS_PER_BLOCK + 64  # just past 2**31 elements
    try:
        return torch.empty(num_blocks, 1, 2, BS, HKV, D, dtype=dtype)  # [NB, 1, 2, BS, Hkv, D]
    except RuntimeError as e:  # e.g. strict overcommit settings
        pytest.skip(f"cannot map a {num_blocks * ELEMENTS_PER_BLOCK} element pool: {e}")


@pytest.mark.parametrize(
    "dtype,kv_dtype", [(torch.float16, torch.float16), (torch.bfloat16, FP8)], ids=["f16", "fp8"]
)
def test_offsets_beyond_int32(triton_backend, dtype, kv_dtype):
    pool = _huge_pool(kv_dtype)
    nb = pool.shape[0]
    gen = torch.Generator().manual_seed(0)
    # two sequences: one in the pool's last blocks (offsets > 2**31 elements), one mixing
    # block 0 with top blocks, in shuffled order
    top = (nb - 1 - torch.randperm(40, generator=gen)).to(torch.int32)
    tables = torch.stack([top[:8], torch.cat([torch.tensor([0], dtype=torch.int32), top[8:15]])])
    assert int(top.max()) * pool.stride(0) > 2**31  # the point of the test
    seq_lens = torch.tensor([120, 97], dtype=torch.int32)

    tokens = int(seq_lens.sum())
    key = torch.randn(tokens, HKV, D, generator=gen).to(dtype)  # [T, Hkv, D]
    value = torch.randn(tokens, HKV, D, generator=gen).to(dtype)
    slots = torch.cat(
        [
            tables[s, torch.arange(n) // BS].long() * BS + torch.arange(n) % BS
            for s, n in enumerate(seq_lens.tolist())
        ]
    )  # [T]
    k_scale = v_scale = None
    if kv_dtype == FP8:
        k_scale, v_scale = compute_kv_scales(key, value)
    triton_backend.write_kv(key, value, pool, 0, slots, k_scale, v_scale)

    # the Triton writes landed where torch indexing (int64 throughout) finds them
    blocks, offs = slots // BS, slots % BS
    stored_k = pool[blocks, 0, 0, offs]  # [T, Hkv, D]
    if kv_dtype == FP8:
        expected_k = ref.quantize_fp8(key, k_scale)
        assert torch.equal(stored_k.view(torch.uint8), expected_k.view(torch.uint8))
    else:
        assert torch.equal(stored_k, key) and torch.equal(pool[blocks, 0, 1, offs], value)

    scale = D**-0.5
    q = torch.randn(2, HQ, D, generator=gen).to(dtype)  # [S, Hq, D]
    expected = ref.paged_decode_attention(q, pool, 0, tables, seq_lens, scale, k_scale, v_scale)
    actual = triton_backend.paged_decode_attention(
        q, pool, 0, tables, seq_lens, scale, k_scale, v_scale
    )
    assert_close(actual, expected, dtype, "decode over a >2**31-element pool")

    q_lens = [30, 97]
    qq = torch.randn(sum(q_lens), HQ, D, generator=gen).to(dtype)  # [T, Hq, D]
    qsl = torch.tensor([0, 30, 127], dtype=torch.int32)
    expected = ref.paged_attention(qq, pool, 0, tables, seq_lens, qsl, scale, k_scale, v_scale)
    actual = triton_backend.paged_attention(
        qq, pool, 0, tables, seq_lens, qsl, scale, k_scale, v_scale
    )
    assert_close(actual, expected, dtype, "prefill over a >2**31-element pool")
