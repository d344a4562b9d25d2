"""Paged-KV kernels: Triton kernels for CUDA and their plain-torch references.

``get_backend("torch" | "triton")`` returns a module exposing ``write_kv``,
``paged_attention`` and ``paged_decode_attention`` with identical signatures (see
``kernels/reference.py`` for the contracts). Kernels import nothing from the project.
"""

from __future__ import annotations

from types import ModuleType


def get_backend(name: str) -> ModuleType:
    if name == "torch":
        from kernels import reference

        return reference
    if name == "triton":
        from kernels import triton_paged

        return triton_paged
    raise ValueError(f"unknown attention backend {name!r} (expected 'torch' or 'triton')")
