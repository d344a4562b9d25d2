"""Routing through the real registry/directory: prefix affinity, load, dead workers, paths."""

from __future__ import annotations

import time
from dataclasses import replace

import httpx
import pytest
import redis
from router_harness import MODEL_NAME

from router.tokenizer import RouterTokenizer
from shared.directory import DirectoryKeys, WorkerInfo, WorkerLease, connect_sync
from shared.hashing import block_hashes, hash_seed

pytestmark = pytest.mark.integration
LONG_PROMPT = (
    "the system prompt of a helpful assistant who answers questions about rivers, "
    "mountains, forests and the weather in great detail and with care; "
) * 2


@pytest.fixture(scope="module")
def tok(tiny_model) -> RouterTokenizer:
    return RouterTokenizer.from_model_dir(tiny_model)


def queries(*workers) -> list[int]:
    return [w.stats().prefix_cache_queries for w in workers]


def wait_published(
    redis_url: str, prefix: str, ids: list[int], router=None, timeout: float = 5.0
) -> None:
    """Until the last full block of ``ids`` is in the directory and, with ``router``, in the
    router's own copy of it (which applied every event written so far)."""
    keys = DirectoryKeys(prefix)
    last = block_hashes(ids, 16, hash_seed(MODEL_NAME))[-1]
    key = keys.block(MODEL_NAME, last)
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout
    while not client.exists(key):
        assert time.monotonic() < deadline, "blocks were not published"
        time.sleep(0.02)
    while router is not None:
        written = int(client.get(keys.events_counter(MODEL_NAME)) or 0)
        synced = router.metric("pdserve:router_directory_mirror_synced")
        if synced and router.metric("pdserve:router_directory_mirror_last_event") == written:
            break
        assert time.monotonic() < deadline, "the router's directory copy did not catch up"
        time.sleep(0.02)
    client.close()


def complete(router, prompt, max_tokens=4):
    return router.openai().completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, extra_body={"ignore_eos": True}
    )


def test_cached_prefix_goes_to_the_worker_holding_it(
    make_worker, make_router, router_config, redis_server, prefix, tok
):
    d0, d1 = make_worker("d0"), make_worker("d1")
    r = make_router(router_config)
    r.wait_workers(2)
    deadline = time.monotonic() + 5
    while not r.metric("pdserve:router_directory_mirror_synced"):  # its first load
        assert time.monotonic() < deadline, "the router's directory copy never loaded"
        time.sleep(0.02)
    ids = tok.encode(LONG_PROMPT)
    assert len(ids) >= 48
    complete(r, LONG_PROMPT)
    holder, other = (d0, d1) if queries(d0, d1) == [1, 0] else (d1, d0)
    assert queries(holder, other) == [1, 0]
    wait_published(redis_server.url, prefix, ids, r)
    for i in range(4):  # same prefix, different tails
        complete(r, LONG_PROMPT + f" question {i}?")
    assert queries(holder, other) == [5, 0]
    assert holder.stats().prefix_cache_hits == 4
    hit = r.metric("pdserve:router_prefix_hit_tokens_total")
    assert hit >= 4 * 16 * (len(ids) // 16)
    # every lookup after the first load was local: none asked Redis
    assert r.metric("pdserve:router_directory_mirror_lookup_seconds_count") == 5
    assert r.metric("pdserve:router_directory_lookup_seconds_count") == 0


def test_directory_lookup_redis_asks_redis_for_every_request(
    make_worker, make_router, router_config, redis_server, prefix, tok
):
    """``--directory-lookup redis``: no copy in the router, one round trip per request, and
    the same affinity."""
    d0, d1 = make_worker("d0"), make_worker("d1")
    r = make_router(replace(router_config, directory_lookup="redis"))
    r.wait_workers(2)
    complete(r, LONG_PROMPT)
    holder, other = (d0, d1) if queries(d0, d1) == [1, 0] else (d1, d0)
    wait_published(redis_server.url, prefix, tok.encode(LONG_PROMPT))
    for i in range(2):
        complete(r, LONG_PROMPT + f" question {i}?")
    assert queries(holder, other) == [3, 0]
    assert r.metric("pdserve:router_directory_lookup_seconds_count") == 3
    assert r.metric("pdserve:router_directory_mirror_lookup_seconds_count") == 0
    assert r.metric("pdserve:router_directory_mirror_synced") == 0


def test_load_decides_when_no_worker_holds_the_prefix(make_worker, make_router, router_config):
    busy = make_worker("busy", report_waiting=4)
    idle = make_worker("idle")
    r = make_router(router_config)
    r.wait_workers(2)
    r.wait_waiting("busy", 4)  # the load reports routing reads
    r.wait_waiting("idle", 0)
    for i in range(3):
        complete(r, f"fresh prompt number {i} with nothing cached")
    assert queries(busy, idle) == [0, 3]


def test_dead_worker_is_skipped_within_one_lease_period(make_worker, make_router, router_config):
    ttl = 1.5
    d0 = make_worker("d0", lease_ttl=ttl)
    d1 = make_worker("d1", lease_ttl=ttl, report_waiting=2)  # d0 is preferred while alive
    r = make_router(replace(router_config, worker_cooldown_s=0.01))
    r.wait_workers(2)
    r.wait_waiting("d1", 2)
    r.wait_waiting("d0", 0)
    complete(r, "first")
    assert queries(d0, d1) == [1, 0]
    d0.kill()
    killed = time.monotonic()
    out = complete(r, "second")  # d0's lease still looks alive: one failed try, then d1
    assert out.usage.completion_tokens == 4
    assert r.metric("pdserve:router_retries_total") == 1
    # within one lease period, with room for a loaded machine (a leaked lease never expires)
    r.wait_workers(1, timeout=ttl + 3.0)
    assert time.monotonic() - killed <= ttl + 3.0
    for i in range(3):
        complete(r, f"after {i}")
    assert r.metric("pdserve:router_retries_total") == 1  # no more tries on the dead worker
    assert d1.stats().prefix_cache_queries == 4


def _prefill_lease(redis_server, prefix: str) -> WorkerLease:
    """A registered prefill worker at an address nobody listens on (deregister it after)."""
    p = WorkerLease(
        connect_sync(redis_server.url),
        WorkerInfo(
            worker_id="p0",
            role="prefill",
            model=MODEL_NAME,
            grpc="127.0.0.1:9",
            block_size=16,
            num_blocks=1000,
        ),
        keys=DirectoryKeys(prefix),
        ttl_s=30,
    )
    p.register()
    return p


def test_disagg_when_a_prefill_worker_is_live_then_local_once_decode_has_the_prefix(
    make_worker, make_router, router_config, redis_server, prefix, tok
):
    d = make_worker("d0")
    p = _prefill_lease(redis_server, prefix)
    try:
        # (an idle D would prefill this short prompt itself: that rule is tested below)
        cfg = replace(
            router_config, policy=replace(router_config.policy, idle_local_prefill_tokens=0)
        )
        r = make_router(cfg)
        r.wait_workers(1, n_prefill=1)
        complete(r, LONG_PROMPT)  # cold everywhere: P computes, blocks move to D
        assert r.metric("pdserve:router_requests_total", path="disagg") == 1
        wait_published(redis_server.url, prefix, tok.encode(LONG_PROMPT), r)
        complete(r, LONG_PROMPT)  # D now holds the whole prompt: prefill locally
        assert r.metric("pdserve:router_requests_total", path="local") == 1
        assert d.stats().prefix_cache_hits == 1
    finally:
        p.deregister()
    r.wait_workers(1, n_prefill=0)
    complete(r, "no prefill workers left " * 4)
    assert r.metric("pdserve:router_requests_total", path="local") == 2


def test_an_idle_decode_worker_prefills_a_short_cold_prompt_itself(
    make_worker, make_router, router_config, redis_server, prefix
):
    """Nothing in flight on D and no P holding the prompt: D prefills it (the same compute,
    no transfer); the prefill worker (an address nobody listens on) is never called."""
    d = make_worker("d0")
    p = _prefill_lease(redis_server, prefix)
    try:
        r = make_router(router_config)
        r.wait_workers(1, n_prefill=1)
        for i in range(2):  # one after the other: D is idle each time
            complete(r, f"{i} {LONG_PROMPT}")
        assert r.metric("pdserve:router_requests_total", path="local") == 2
        assert r.metric("pdserve:router_requests_total", path="disagg") == 0
        assert d.stats().prefill_fallbacks == 0
    finally:
        p.deregister()


def test_local_prefill_threshold_keeps_short_prompts_on_decode(
    make_worker, make_router, router_config, redis_server, prefix
):
    make_worker("d0")
    p = _prefill_lease(redis_server, prefix)
    try:
        cfg = replace(
            router_config, policy=replace(router_config.policy, local_prefill_threshold=256)
        )
        r = make_router(cfg)
        r.wait_workers(1, n_prefill=1)
        complete(r, LONG_PROMPT)  # < 256 tokens: conditional disaggregation says local
        assert r.metric("pdserve:router_requests_total", path="local") == 1
        assert r.metric("pdserve:router_requests_total", path="disagg") == 0
    finally:
        p.deregister()


def test_static_workers_without_redis(make_router, router_config, tiny_model):
    from router_harness import FakeWorker

    w = FakeWorker(None, "unused:", "static-d0")
    try:
        cfg = replace(router_config, redis_url=None, decode_workers=(w.address,))
        r = make_router(cfg)
        r.wait_workers(1)
        out = complete(r, "static routing")
        assert out.usage.completion_tokens == 4 and queries(w) == [1]
    finally:
        w.stop()


def test_static_list_overrides_discovery_and_other_models_are_ignored(
    make_worker, make_router, router_config
):
    listed = make_worker("listed")
    unlisted = make_worker("unlisted")
    make_worker("other-model", model="another-model")
    r = make_router(replace(router_config, decode_workers=(listed.address,)))
    r.wait_workers(1)
    r.wait_waiting("listed", 0)
    for i in range(3):
        complete(r, f"static override {i}")
    assert queries(listed, unlisted) == [3, 0]


def test_redis_outage_keeps_serving_from_the_last_snapshot_then_recovers(
    make_router, router_config, tok
):
    import os
    import signal

    from router_harness import FakeWorker

    from shared.directory import EmbeddedRedis

    server = EmbeddedRedis()
    url = server.start()
    port = server.port
    workers = []
    try:
        for i in range(2):
            workers.append(FakeWorker(url, "out:", f"o{i}"))
        r = make_router(replace(router_config, redis_url=url, directory_prefix="out:"))
        r.wait_workers(2)
        os.killpg(server._proc.pid, signal.SIGKILL)  # Redis dies; workers and router live on
        server._proc.wait(5)
        server._proc = None
        t0 = time.monotonic()
        for i in range(4):
            assert complete(r, f"during the outage {i}").usage.completion_tokens == 4
        assert time.monotonic() - t0 < 10  # lookups fail fast, routing falls back to load
        assert httpx.get(f"{r.url}/health").json()["registry"] != "ok"
        assert sum(queries(*workers)) == 4
        server.port = port
        server.start()  # Redis is back, empty: leases and directory are rebuilt
        assert server.port == port, "Redis did not come back on its port"
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 10
        while not all(client.exists(f"out:worker:{w.worker_id}") for w in workers):
            assert time.monotonic() < deadline, "workers did not re-register"
            complete(r, "while the workers re-register")  # no 503 in between
            time.sleep(0.05)
        client.close()
        time.sleep(0.5)  # the router's next refresh, and the publishers' resync
        q0 = queries(*workers)
        complete(r, LONG_PROMPT)
        q1 = queries(*workers)
        holder = 0 if q1[0] > q0[0] else 1
        wait_published(url, "out:", tok.encode(LONG_PROMPT), r, timeout=10)
        for i in range(3):
            complete(r, LONG_PROMPT + f" again {i}")
        q2 = queries(*workers)
        assert q2[holder] - q1[holder] == 3 and q2[1 - holder] == q1[1 - holder]  # affinity is back
    finally:
        for w in workers:
            w.stop()
        server.stop()


def test_a_worker_that_comes_back_with_a_new_generation_counts_as_a_restart(
    make_worker, make_router, router_config
):
    first = make_worker("phoenix")
    r = make_router(router_config)
    r.wait_workers(1)
    pool = r.app.state.pool
    assert pool.restarts("phoenix") == 0
    first.kill()
    make_worker("phoenix")  # the same id, a new process: a new generation
    deadline = time.monotonic() + 15
    while pool.restarts("phoenix") == 0:
        assert time.monotonic() < deadline, "the router never saw the new generation"
        time.sleep(0.1)
    data = httpx.get(f"{r.url}/dashboard/data", timeout=10).json()
    (w,) = [w for w in data["workers"] if w["id"] == "phoenix"]
    assert w["restarts"] == 1
