"""Launcher argument checks, backend selection and fp8 scale helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_cases import FP8, make_case

import kernels
from kernels import KernelArgumentError, compute_kv_scales, default_backend, get_backend
from kernels import reference as ref


@pytest.fixture
def case():
    return make_case(
        [20, 40], [5, 40], num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float16
    )


def test_backends_share_signatures(triton_backend):
    import inspect

    torch_backend = get_backend("torch")
    for name in ("write_kv", "paged_attention", "paged_decode_attention"):
        a = inspect.signature(getattr(torch_backend, name))
        b = inspect.signature(getattr(get_backend("triton"), name))
        assert list(a.parameters) == list(b.parameters), name
        assert [p.default for p in a.parameters.values()] == [
            p.default for p in b.parameters.values()
        ], name
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("flash")


def test_default_backend():
    from kernels import cpu_paged  # the CPU C++ backend, when its extension builds

    assert default_backend("cpu") == ("cpp" if cpu_paged.available() else "torch")
    assert default_backend("cuda") == "triton"
    assert default_backend("cuda:1") == "triton"
    assert default_backend("mps") == "torch"


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda c: c.update(query=c["query"].double()), "query dtype"),
        (lambda c: c.update(query=c["query"][:, :3]), "multiple of num_kv_heads"),
        (lambda c: c.update(query=c["query"][..., :16]), "head_dim"),
        (
            lambda c: c.update(query=c["query"].transpose(1, 2).contiguous().transpose(1, 2)),
            "stride",
        ),
        (lambda c: c.update(kv_cache=c["kv_cache"][0]), "kv_cache must be"),
        (lambda c: c.update(layer=2), "layer 2 out of range"),
        (lambda c: c.update(block_tables=c["block_tables"].float()), "block_tables must be int"),
        (lambda c: c.update(block_tables=c["block_tables"][:1]), "block_tables must have shape"),
        (lambda c: c.update(seq_lens=c["seq_lens"][:1]), "must have shape"),
        (lambda c: c.update(query_start_loc=c["query_start_loc"][:2]), "query_start_loc"),
        (lambda c: c.update(k_scale=torch.ones(1)), "only valid for an fp8"),
        (lambda c: c.update(seq_lens=c["seq_lens"] * 10), "exceed block_tables capacity"),
        (lambda c: c.update(seq_lens=torch.tensor([4, 40], dtype=torch.int32)), "longer than"),
        (lambda c: c.update(block_tables=c["block_tables"] + 1000), "outside"),
    ],
)
def test_attention_rejects_bad_arguments(triton_backend, case, mutate, match):
    args = {
        "query": case.query,
        "kv_cache": case.kv_cache,
        "layer": case.layer,
        "block_tables": case.block_tables,
        "seq_lens": case.seq_lens,
        "query_start_loc": case.query_start_loc,
        "scale": case.scale,
    }
    mutate(args)
    with pytest.raises(KernelArgumentError, match=match):
        triton_backend.paged_attention(**args)


def test_query_dtype_may_differ_from_pool(triton_backend, case):
    """An fp32 query over an fp16 pool: K/V are converted to the query dtype on load."""
    q32 = case.query.float()
    args = (q32,) + case.attention_args()[1:]
    expected = ref.paged_attention(*args)
    actual = triton_backend.paged_attention(*args)
    assert actual.dtype == torch.float32
    assert torch.allclose(actual, expected, atol=1e-4, rtol=1e-4)


def test_fp8_pool_needs_well_formed_scales(triton_backend):
    case = make_case([20], num_heads=2, num_kv_heads=2, head_dim=32, kv_dtype=FP8)
    args = case.decode_args()[:6]
    with pytest.raises(KernelArgumentError, match="needs k_scale and v_scale"):
        triton_backend.paged_decode_attention(*args)
    with pytest.raises(KernelArgumentError, match="needs k_scale and v_scale"):
        ref.paged_decode_attention(*args)
    with pytest.raises(KernelArgumentError, match="float32"):
        triton_backend.paged_decode_attention(*args, case.k_scale.half(), case.v_scale)
    with pytest.raises(KernelArgumentError, match=r"shape \[1\] or \[2\]"):
        triton_backend.paged_decode_attention(*args, torch.ones(3), torch.ones(3))
    with pytest.raises(KernelArgumentError, match="both be per-tensor or both per-head"):
        triton_backend.paged_decode_attention(*args, torch.ones(1), torch.ones(2))


def test_write_kv_rejects_bad_arguments(triton_backend):
    pool = torch.zeros(4, 1, 2, 16, 2, 32, dtype=torch.float16)
    key = torch.randn(3, 2, 32, dtype=torch.float16)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(KernelArgumentError, match="slots >= num_blocks"):
        triton_backend.write_kv(key, key, pool, 0, torch.tensor([0, 1, 64]))
    with pytest.raises(KernelArgumentError, match="value has 2"):
        triton_backend.write_kv(key, key[:2], pool, 0, slots)
    with pytest.raises(KernelArgumentError, match="key has 1 heads"):
        triton_backend.write_kv(key[:, :1], key[:, :1], pool, 0, slots)
    with pytest.raises(KernelArgumentError, match="slot_mapping must be int"):
        triton_backend.write_kv(key, key, pool, 0, slots.float())
    with pytest.raises(KernelArgumentError, match="needs k_scale"):
        triton_backend.write_kv(key, key, pool.to(FP8), 0, slots)
    with pytest.raises(KernelArgumentError, match="block_size must be a power of two"):
        triton_backend.write_kv(key, key, torch.zeros(4, 1, 2, 12, 2, 32), 0, slots)
    with pytest.raises(KernelArgumentError, match="needs k_scale"):
        ref.write_kv(key, key, pool.to(FP8), 0, slots)


def test_cpu_tensors_without_interpreter_get_a_clear_error(tmp_path: Path):
    """Outside the interpreter, CPU tensors are refused with a named error, not a crash."""
    code = (
        "import torch\n"
        "from kernels import triton_paged as tp\n"
        "pool = torch.zeros(2, 1, 2, 16, 1, 32)\n"
        "k = torch.zeros(1, 1, 32)\n"
        "try:\n"
        "    tp.write_kv(k, k, pool, 0, torch.zeros(1, dtype=torch.long))\n"
        "except tp.KernelArgumentError as e:\n"
        "    print('REFUSED', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(kernels.__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=root,
    )
    assert "REFUSED" in proc.stdout and "TRITON_INTERPRET" in proc.stdout, proc.stderr[-2000:]


def test_compute_kv_scales():
    key = torch.randn(50, 4, 16)
    key[:, 2] *= 10
    value = torch.zeros(50, 4, 16)
    ks, vs = compute_kv_scales(key, value)
    assert ks.shape == (1,) and ks.dtype == torch.float32
    assert torch.allclose(ks * 448, key.abs().max().reshape(1))
    assert float(vs) > 0  # all-zero sample still gives a usable scale
    ks_h, vs_h = compute_kv_scales(key, value, per_head=True, margin=2.0)
    assert vs_h.shape == (4,)
    assert ks_h.shape == (4,) and int(ks_h.argmax()) == 2
    assert torch.allclose(ks_h * 448 / 2, key.abs().amax(dim=(0, 2)))
    # quantizing the sample with these scales never saturates (besides the max itself)
    q = ref.quantize_fp8(key, ks_h)
    assert q.float().abs().max() <= 448 / 2 + 1e-3
    with pytest.raises(KernelArgumentError):
        compute_kv_scales(key.long(), value)
    with pytest.raises(KernelArgumentError):
        compute_kv_scales(key, value, margin=0)
    with pytest.raises(KernelArgumentError, match="inf or NaN"):
        compute_kv_scales(key * float("inf"), value)
