"""Shared fixtures: offline test models, made once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every cluster a test starts shares this session's cluster secret (workers then refuse calls
# without its token), and tests' own channels carry it (ClusterSecurity.from_env()).
os.environ.setdefault("PDSERVE_CLUSTER_SECRET", os.urandom(24).hex())


def _model_dir(root: Path, preset: str, arch: str) -> Path:
    from shared.cli.tiny_model import make_tiny_model

    path = root / f"{preset}-{arch}"
    if not (path / "model.safetensors").exists():
        make_tiny_model(path, preset=preset, arch=arch)
    return path


@pytest.fixture(scope="session")
def models_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_llama(models_root) -> Path:
    return _model_dir(models_root, "tiny", "llama")


@pytest.fixture(scope="session")
def make_model(models_root):
    """``make_model(preset, arch)`` -> path of a generated model directory (cached)."""
    return lambda preset="tiny", arch="llama": _model_dir(models_root, preset, arch)
