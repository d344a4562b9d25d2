"""Triton weight-only quantized matmul (W4A16 / W8A16, grouped scales and zero points): the
CUDA path of ``kernels/quant.py``.

Layout, made once at load by :func:`prepare`: codes packed along K into int32 words, low bits
first (``32 / bits`` codes per word; GPTQ's ``qweight`` layout, ``[K * bits / 32, N]``), fp32
``scales`` and ``zeros`` ``[G, N]`` (zero points in code units). Grid ``(cdiv(M, BLOCK_M),
cdiv(N, BLOCK_N))``; each program walks K in tiles of ``BLOCK_K`` features that lie within one
group (``group_size % BLOCK_K == 0``), unpacks the tile's codes in registers, dequantizes them
as ``(q - z) * s`` into the activation dtype and accumulates ``tl.dot`` in fp32. Act order is a
host-side gather of ``x``'s columns (``kernels.quant.quant_linear``). The kernel tests run it
through Triton's CPU interpreter (``tests/kernels``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_rounding import BF16_MANT_BITS, BF16_MIN_EXP, round_rne, to_compute_dtype

BLOCK_K = 32


@triton.jit
def _quant_matmul_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EMULATE_BF16: tl.constexpr,  # bf16 under the interpreter (kernels/triton_rounding.py)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 activations: no TF32 on the fp32 path
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None], other=0.0)
        compute_dtype = x.dtype
        x = to_compute_dtype(x, compute_dtype, EMULATE_BF16)
        word = tl.load(
            q_ptr + (k // PACK)[:, None] * N + offs_n[None, :], mask=n_ok[None, :], other=0
        )
        codes = (word >> ((k % PACK) * BITS)[:, None]) & MASK
        g = k0 // GROUP
        s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0)
        z = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0.0)
        w = to_compute_dtype(
            (codes.to(tl.float32) - z[None, :]) * s[None, :], compute_dtype, EMULATE_BF16
        )
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    if EMULATE_BF16:
        acc = round_rne(acc, BF16_MANT_BITS, BF16_MIN_EXP)
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


@triton.jit
def _fp8_matmul_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """y = x @ (w_e4m3 * s[:, None]).T: the weight tile is widened to fp32 in registers and
    rounded to the activation dtype; the per-channel scale is applied to the fp32 sums."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        compute_dtype = x.dtype
        x = to_compute_dtype(x, compute_dtype, EMULATE_BF16)
        w = tl.load(
            w_ptr + offs_n[None, :] * K + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0
        )
        w = to_compute_dtype(w.to(tl.float32), compute_dtype, EMULATE_BF16)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    s = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)
    acc = acc * s[None, :]
    if EMULATE_BF16:
        acc = round_rne(acc, BF16_MANT_BITS, BF16_MIN_EXP)
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def fp8_matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ (w * scale[:, None]).T`` for e4m3 ``w [N, K]``."""
    x = x.contiguous()
    m, k = x.shape
    n = int(w.shape[0])
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    _fp8_matmul_kernel[grid](
        x,
        w,
        scale,
        y,
        m,
        n,
        k,
        x.stride(0),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_K=BLOCK_K,
        EMULATE_BF16=x.dtype == torch.bfloat16 and _interpreted(),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    return y


def supports(qw) -> bool:  # type: ignore[no-untyped-def]
    return qw.bits in (4, 8) and qw.group_size % BLOCK_K == 0 and qw.in_features % BLOCK_K == 0


def prepare(qw, device: torch.device) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The kernel's tensors for a :class:`kernels.quant.QuantizedWeight` (``supports(qw)``)."""
    from kernels.quant import pack_along_last

    packed = pack_along_last(qw.qweight, qw.bits).t().contiguous()  # [K * bits / 32, N]
    return {
        "q": packed.to(device),
        "scales": qw.scales.float().contiguous().to(device),
        "zeros": qw.zeros.float().contiguous().to(device),
    }


def quant_matmul(
    x: torch.Tensor, t: dict[str, torch.Tensor], bits: int, group_size: int, n: int
) -> torch.Tensor:
    """``x [M, K] @ W.T`` -> ``[M, N]`` in ``x``'s dtype."""
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _quant_matmul_kernel[grid](
        x,
        t["q"],
        t["scales"],
        t["zeros"],
        y,
        m,
        n,
        k,
        x.stride(0),
        y.stride(0),
        GROUP=group_size,
        BITS=bits,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK_K,
        EMULATE_BF16=x.dtype == torch.bfloat16 and _interpreted(),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    return y


def _interpreted() -> bool:
    """Whether the kernel was built by the CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return not isinstance(_quant_matmul_kernel, triton.runtime.JITFunction)
