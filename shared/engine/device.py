"""Which device ``--device auto`` means here (the tensor side of the engine: imports torch)."""

from __future__ import annotations


def resolve_device(requested: str) -> str:
    """``"cuda"`` when ``requested`` is ``"auto"`` and a CUDA device is visible, else ``"cpu"``;
    any other value as given."""
    if requested != "auto":
        return requested
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"
