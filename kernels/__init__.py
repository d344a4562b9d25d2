"""Paged-KV kernels: Triton kernels for CUDA and their plain-torch references.

``get_backend("torch" | "triton" | "cpp")`` returns a module exposing ``write_kv``,
``paged_attention``, ``paged_decode_attention`` and ``argmax_rows`` with identical signatures
(see ``kernels/reference.py`` for the contracts). ``default_backend(device)`` picks one for a device.
Kernels import nothing from the project.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

from kernels.checks import KernelArgumentError
from kernels.fp8_scales import compute_kv_scales

__all__ = ["KernelArgumentError", "compute_kv_scales", "default_backend", "get_backend"]

BACKENDS = ("torch", "triton", "cpp")


def get_backend(name: str) -> ModuleType:
    """The module implementing backend ``name``; ``ValueError`` for an unknown name."""
    if name == "torch":
        from kernels import reference

        return reference
    if name == "triton":
        from kernels import triton_paged

        return triton_paged
    if name == "cpp":  # CPU: the C++ decode kernel (reads blocks in place), reference otherwise
        from kernels import cpu_paged

        return cpu_paged
    raise ValueError(f"unknown attention backend {name!r} (expected one of {BACKENDS})")


def default_backend(device: str) -> str:
    """``"triton"`` for a CUDA device when Triton is installed; on the CPU ``"cpp"`` when its
    extension builds; else ``"torch"``.

    ``device`` is a torch device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
    """
    if device.split(":", 1)[0] == "cpu":
        from kernels import cpu_paged

        return "cpp" if cpu_paged.available() else "torch"
    if device.split(":", 1)[0] != "cuda" or importlib.util.find_spec("triton") is None:
        return "torch"
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken Triton install must not stop the engine
        return "torch"
    return "triton"
