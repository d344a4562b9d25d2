"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before ``@triton.jit`` runs (Triton picks the interpreter at
decoration time), so it is set here, at collection, and the ``triton_backend`` fixture rebuilds
the kernel modules if something imported them earlier in the session without it.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import pytest

os.environ["TRITON_INTERPRET"] = "1"

_KERNEL_MODULES = (
    "kernels.triton_write_kv",
    "kernels.triton_decode",
    "kernels.triton_prefill",
    "kernels.triton_paged",
    "kernels.triton_quant",
)


@pytest.fixture(scope="session")
def triton_backend() -> ModuleType:
    """``kernels.triton_paged`` with every kernel built by the CPU interpreter."""
    import kernels.triton_paged as tp

    if not tp._interpreted():
        for name in _KERNEL_MODULES:
            if name in sys.modules:
                importlib.reload(sys.modules[name])
    tp = sys.modules["kernels.triton_paged"]
    assert tp._interpreted(), "Triton kernels are not running in the interpreter"
    return tp
