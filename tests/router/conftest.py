"""Router test fixtures: a tiny model dir, a real Redis, fake decode workers, in-process routers.

See ``router_harness.py`` for the helpers.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from router_harness import MODEL_NAME, FakeWorker, RouterThread

from shared.directory import EmbeddedRedis


@pytest.fixture(scope="session")
def tiny_model(tiny_llama) -> Path:
    """The session's tiny Llama directory (``tests/conftest.py``): tokenizer + chat template."""
    return tiny_llama


@pytest.fixture(scope="session")
def redis_server():
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"


@pytest.fixture
def make_worker(redis_server, prefix):
    workers: list[FakeWorker] = []

    def make(worker_id: str, **opts) -> FakeWorker:
        w = FakeWorker(redis_server.url, prefix, worker_id, **opts)
        workers.append(w)
        return w

    yield make
    for w in workers:
        w.stop()


@pytest.fixture
def router_config(tiny_model, redis_server, prefix):
    from router.config import RouterConfig
    from router.policy import PolicyConfig

    return RouterConfig(
        model=str(tiny_model),
        served_model_name=MODEL_NAME,
        redis_url=redis_server.url,
        directory_prefix=prefix,
        port=0,
        worker_refresh_interval_s=0.1,
        request_timeout_s=30.0,
        stall_timeout_s=10.0,
        policy=PolicyConfig(local_prefill_threshold=0),
    )


@pytest.fixture
def make_router():
    routers: list[RouterThread] = []

    def make(config) -> RouterThread:
        r = RouterThread(config)
        routers.append(r)
        return r

    yield make
    for r in routers:
        r.stop()
