"""C++ weight-only quantized matmuls for the CPU (``kernels/csrc/quant_cpu.cpp``, AVX512-BF16).

Built like ``kernels/cpu_paged.py`` (``torch.utils.cpp_extension``, cached per source, flags,
torch version and CPU features, so a CI machine without AVX512-BF16 builds a stub whose
``supported()`` is false and the torch kernels serve instead: the choice is made at run time).
``prepare`` lays a :class:`kernels.quant.QuantizedWeight` out in the kernel's 16-channel x
2-feature pairs; ``run`` computes ``x @ W.T`` with it for any number of rows: measured against
oneDNN's bf16 GEMM on the dense weight it is faster up to ~128 rows and within ~10 % at 512 and
2048 (prefill chunks), and always faster than dequantizing first (bench/quant_linear.py).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from kernels import cpp_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "quant_cpu.cpp"
_FLAGS = ["-O3", "-fopenmp", "-march=native"]
MAX_M = 1 << 62  # every call: see the module docstring

_lock = threading.Lock()
_ext: object = None
_failed: str | None = None
NOT_THIS_CPU = "this CPU has no AVX512-BF16"  # built, but the binary says the CPU cannot run it


def extension() -> object:
    """The built extension when this CPU runs it (AVX512-BF16), else None."""
    global _ext, _failed
    if _ext is not None or _failed is not None:
        return _ext
    with _lock:
        if _ext is None and _failed is None:
            try:
                ext = cpp_build.build("pdserve_quant_cpu", SOURCE, _FLAGS)
                if ext.supported():
                    _ext = ext
                else:
                    _failed = NOT_THIS_CPU
                    logger.info("quantized C++ kernels off: %s; torch's kernels serve", _failed)
            except Exception as e:  # noqa: BLE001 - no compiler: torch's kernels serve
                _failed = f"{type(e).__name__}: {e}"
                logger.warning("quantized C++ kernels unavailable (%s)", _failed.splitlines()[0])
    return _ext


def prepare(qw, ext) -> tuple[str, dict[str, torch.Tensor]] | None:  # type: ignore[no-untyped-def]
    """(path, tensors) in the kernel's layout, or None where the kernel does not apply."""
    n, k = qw.out_features, qw.in_features
    g = qw.group_size
    if qw.bits not in (4, 8) or n % 16 or k % g or g % 4:
        return None
    off = 1 << (qw.bits - 1)
    codes = qw.qweight.to(torch.int16).view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3)
    if qw.bits == 8:
        packed = (codes - off).to(torch.int8).contiguous().view(torch.uint8).flatten()
    else:
        # [N/16, K/4, 2 pairs, 32 words]: byte = word of the even pair | word of the odd << 4
        c = codes.to(torch.uint8).reshape(n // 16, k // 4, 2, 32)
        packed = (c[:, :, 0] | (c[:, :, 1] << 4)).contiguous().flatten()
    scales = qw.scales.float().contiguous()
    if qw.symmetric:
        zs = torch.empty(0)
    else:
        zs = (-(qw.zeros.float() - off) * scales).contiguous()
    tensors = {"packed": packed, "scales": scales, "zs": zs}
    return f"cpp-w{qw.bits}", tensors


def run(pw, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    ext = extension()
    assert ext is not None
    t = pw.tensors
    return ext.quant_gemm(  # type: ignore[attr-defined]
        x.contiguous(), t["packed"], t["scales"], t["zs"], pw.bits, pw.group_size, pw.out_features
    )
