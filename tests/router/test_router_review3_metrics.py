"""Failover metrics count what happened: ``router_prefix_hit_tokens`` once per prompt's stream
(the cached tokens of the worker whose attempt produced its output, not again for every
attempt), and ``router_retries_total`` only for retries that reached a worker (not for a
retry that found none left)."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
from router_harness import MODEL_NAME

pytestmark = pytest.mark.integration


def test_prefix_hit_tokens_are_counted_once_per_stream(make_worker, make_router, router_config):
    make_worker("d0", fail_requests=1000, fail_code="UNAVAILABLE")
    make_worker("d1")
    make_worker("d2")
    r = make_router(router_config)
    r.wait_workers(3)
    cached = {"d0": 48, "d1": 32, "d2": 32}  # d0 is the policy's choice: it holds the most

    async def fake_cached(prompt, cache_salt, workers):
        return {w.worker_id: cached[w.worker_id] for w in workers}

    r.ctx.dispatcher._cached_tokens = fake_cached
    prompt = list(range(10, 90))  # 80 tokens
    resp = httpx.post(
        f"{r.url}/v1/completions",
        timeout=30,
        json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "ignore_eos": True},
    )
    assert resp.status_code == 200, resp.text
    assert r.metric("pdserve:router_retries_total") == 1  # d0 failed; d1 or d2 served it
    # the cached tokens of the worker that served it, once (before: 48 + 32)
    assert r.metric("pdserve:router_prefix_hit_tokens_total") == 32


@pytest.mark.parametrize("workers", [2, 3])
def test_retries_count_only_attempts_that_reached_a_worker(
    make_worker, make_router, router_config, workers
):
    for i in range(workers):
        make_worker(f"d{i}", fail_requests=1000, fail_code="UNAVAILABLE")
    r = make_router(replace(router_config, max_retries=2))
    r.wait_workers(workers)
    resp = httpx.post(
        f"{r.url}/v1/completions",
        timeout=30,
        json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 4},
    )
    assert resp.status_code == 502, resp.text
    # each worker got one call; every call after the first was a retry (before: 2 with 2
    # workers, the last "retry" having found no worker left)
    assert r.metric("pdserve:router_retries_total") == workers - 1
