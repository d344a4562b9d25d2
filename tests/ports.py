"""Tests pick server ports with :func:`shared.ports.free_port` (why: see that module)."""

from shared.ports import free_port

__all__ = ["free_port"]
