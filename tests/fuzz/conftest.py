"""A compose-like cluster for the fuzz tests: Redis, 1 prefill and 2 decode workers, the router,
as real processes on loopback, serving the tiny model with a 256-token context (so that valid
requests the fuzzers pick, n=128 with the longest max_tokens included, stay short)."""

from __future__ import annotations

import pytest

from tests.cluster_utils import make_cluster


@pytest.fixture(scope="package")
def fuzz_cluster(tiny_llama, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fuzz-run")
    c = make_cluster(tiny_llama, run_dir, "--max-model-len", "256", prefill=1, decode=2)
    c.start_redis()
    workers = [
        c.spawn_worker("prefill", 0),
        c.spawn_worker("decode", 0),
        c.spawn_worker("decode", 1),
    ]
    c.wait_ready(workers)
    url = c.start_router(["--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"])
    c.url = url
    yield c
    c.stop()
