"""Building the C++ CPU extensions (``kernels/csrc``) with ``torch.utils.cpp_extension``.

Each is cached under ``~/.cache/torch_extensions`` by a name that hashes its source, its flags,
torch's version and the CPU's feature flags, so a changed kernel, or a cache dir shared with
another CPU model (AMX or not), builds afresh instead of loading a stale or illegal binary.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

import torch


def cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` builds for exactly these)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def extension_name(prefix: str, source: Path, flags: list[str]) -> str:
    """``<prefix>_<hash>`` (see the module docstring)."""
    h = hashlib.sha256(source.read_bytes())
    for part in (" ".join(flags), torch.__version__, cpu_flags()):
        h.update(b"\0" + part.encode())
    return f"{prefix}_{h.hexdigest()[:16]}"


def build(prefix: str, source: Path, flags: list[str]):  # type: ignore[no-untyped-def]
    """Build (or load the cached build of) ``source``; raises what the compiler raises."""
    from torch.utils.cpp_extension import load

    return load(
        name=extension_name(prefix, source, flags),
        sources=[str(source)],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        verbose=bool(os.environ.get("PDSERVE_VERBOSE_BUILD")),
    )
