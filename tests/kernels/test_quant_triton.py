"""The CUDA path of the quantized linears (``kernels/triton_quant.py``), run through Triton's CPU
interpreter: the same cases as the CPU kernels' tests, against the fp32 dequantized weight."""

from __future__ import annotations

import importlib

import pytest
import torch

from kernels import quant


@pytest.fixture(scope="module")
def tq():
    import kernels.triton_quant as mod

    return importlib.reload(mod)  # built by the interpreter (conftest sets TRITON_INTERPRET)


CASES = [
    # (bits, group, symmetric, act order)
    (4, 32, True, False),
    (4, 64, False, False),
    (4, 64, True, True),
    (8, -1, True, False),
    (8, 32, False, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_fp8_matmul_matches_the_dequantized_reference(tq, dtype):
    torch.manual_seed(5)
    n, k = 80, 96  # K not a multiple of the 32-wide tile: the masks are exercised
    fw = quant.quantize_fp8_per_channel(torch.randn(n, k) * 0.05)
    ref_w = fw.weight.float() * fw.scale.unsqueeze(1)
    for m in (1, 19, 40):
        x = torch.randn(m, k).to(dtype)
        y = tq.fp8_matmul(x, fw.weight, fw.scale).float()
        ref = x.float() @ ref_w.to(dtype).float().t()
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), (m, err)


@pytest.mark.parametrize(("bits", "group", "sym", "act"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_quant_matmul_matches_the_dequantized_reference(tq, bits, group, sym, act, dtype):
    torch.manual_seed(bits * 100 + group)
    n, k = 80, 128  # N not a multiple of the 64-wide tile: the masks are exercised
    w = torch.randn(n, k) * 0.05
    if act:
        qw, g_idx = quant.quantize_rtn_act_order(w, bits, group, seed=2)
        p = quant.to_gptq(qw, g_idx)
        qw = quant.from_gptq(p["qweight"], p["qzeros"], p["scales"], p["g_idx"], bits, group)
    elif bits == 8 and group == -1:
        qw = quant.quantize_int8_per_channel(w)
    else:
        qw = quant.quantize_rtn(w, bits, group, symmetric=sym)
    assert tq.supports(qw)
    tensors = tq.prepare(qw, torch.device("cpu"))
    pw = quant.PreparedWeight(
        f"triton-w{bits}", n, k, dtype, tensors, qw.perm, 1 << 62, None, bits, qw.group_size
    )
    # the kernel stores 4-bit codes at half a byte each
    assert tensors["q"].numel() * 4 == n * k * bits // 8
    ref_w = qw.dequantize()
    bias = torch.randn(n).to(dtype)
    for m in (1, 3, 17, 40):
        x = torch.randn(m, k).to(dtype)
        y = quant.quant_linear(x, pw, bias).float()
        ref = x.float() @ ref_w.to(dtype).float().t() + bias.float()
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), (m, err)
