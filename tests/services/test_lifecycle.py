"""Worker lifecycle with real processes: graceful drain, a new worker joining, a dead worker
leaving the directory, a restart getting a new generation."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import signal
import time

import httpx
import pytest
import redis

from shared.directory import DirectoryReader, connect_async
from shared.hashing import block_hashes, hash_seed
from shared.proto import pdserve_pb2 as pb
from tests.cluster_utils import channel_to, decode_stub, generate, make_cluster, wait_until
from tests.engine.helpers import hf_greedy, random_prompts

pytestmark = pytest.mark.integration


def _prefix_blocks(c, prompt):
    """What a router would read: leading prompt blocks each live worker holds."""

    async def read():
        client = connect_async(c.redis_url)
        try:
            reader = DirectoryReader(client)
            live = {w.worker_id: w.generation for w in await reader.live_workers()}
            hashes = block_hashes(prompt, 16, hash_seed(c.served_model_name))
            return (await reader.prefix_match(c.served_model_name, hashes, live)).blocks, live
        finally:
            await client.aclose()

    return asyncio.run(read())


def test_sigterm_drains_in_flight_then_deregisters(tiny_llama, tmp_path):
    c = make_cluster(tiny_llama, tmp_path, prefill=0, decode=1)
    c.start_redis()
    try:
        worker = c.spawn_worker("decode", 0)
        c.wait_ready([worker])
        r = redis.Redis.from_url(c.redis_url)
        addr = c.ready["decode-0"]["grpc"]
        prompt = random_prompts(41, lengths=[50])[0]
        with channel_to(addr) as ch, cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(
                generate, decode_stub(ch), "drain", prompt, "", max_tokens=400, ignore_eos=True
            )
            wait_until(
                lambda: decode_stub(ch).Stats(pb.StatsRequest(), timeout=5).running > 0,
                interval=0.01,
                what="the request to start",
            )
            worker.proc.send_signal(signal.SIGTERM)
            # Draining: the lease goes at once (routers stop choosing it) ...
            wait_until(
                lambda: not r.exists("pds:worker:decode-0"),
                timeout=5,
                what="the worker to deregister",
            )
            # ... new work is refused ...
            with pytest.raises(Exception) as ei:
                generate(decode_stub(ch), "late", prompt, "", max_tokens=2)
            assert "draining" in str(ei.value) or "UNAVAILABLE" in str(ei.value)
            # ... saying why, so that a router never takes it for a call its own pause broke
            assert ("pdserve-failure", "draining") in tuple(ei.value.trailing_metadata())
            # ... and the request in flight still finishes, complete.
            tokens, final = fut.result(timeout=120)
        assert len(tokens[0]) == 400 and final.usage.completion_tokens == 400
        assert tokens[0][:8] == hf_greedy(tiny_llama, [prompt], 8)[0]
        assert worker.proc.wait(timeout=30) == 0
        assert not r.sismember("pds:workers:decode", "decode-0")
    finally:
        c.stop()


def test_new_worker_used_dead_worker_dropped_restart_new_generation(tiny_llama, tmp_path):
    c = make_cluster(
        tiny_llama, tmp_path, "--router-arg=--worker-refresh-interval=0.2", prefill=0, decode=1
    )
    try:
        url = c.start()
        r = redis.Redis.from_url(c.redis_url)
        body = {"model": c.served_model_name, "max_tokens": 4, "temperature": 0}
        # A second decode worker joins a running cluster; nothing is restarted.
        new = c.spawn_worker("decode", 1)
        c.wait_ready([new])
        new_addr = c.ready["decode-1"]["grpc"]

        def served_by_new():
            httpx.post(
                f"{url}/v1/completions", json={**body, "prompt": "a new worker"}, timeout=60
            ).raise_for_status()
            with channel_to(new_addr) as ch:
                return decode_stub(ch).Stats(pb.StatsRequest(), timeout=5).prefix_cache_queries > 0

        wait_until(served_by_new, timeout=30, interval=0.05, what="the router to use decode-1")

        # Its cache shows up in the directory, then vanishes for readers when it dies.
        prompt = random_prompts(42, lengths=[80])[0]
        httpx.post(
            f"{url}/v1/completions", json={**body, "prompt": prompt}, timeout=60
        ).raise_for_status()
        blocks, live = wait_until(
            lambda: (lambda b: b if max(b[0].values()) == 5 else None)(_prefix_blocks(c, prompt)),
            what="the prompt's 5 blocks in the directory",
        )
        holder = max(blocks, key=blocks.get)
        old_generation = live[holder]
        child = next(ch for ch in c.children if ch.name == holder)
        child.proc.kill()
        child.proc.wait(10)
        t0 = time.monotonic()
        # one lease period (3 s TTL) plus a heartbeat, with room for a loaded machine; well
        # under the two lease periods a lease renewed once more would take
        wait_until(
            lambda: holder not in _prefix_blocks(c, prompt)[1],
            timeout=8,
            what="the dead worker's lease to expire",
        )
        assert time.monotonic() - t0 < 8
        assert _prefix_blocks(c, prompt)[0].get(holder) is None
        # The cluster keeps serving on the survivor.
        httpx.post(
            f"{url}/v1/completions", json={**body, "prompt": "still serving"}, timeout=60
        ).raise_for_status()
        # A restart under the same id registers with a new generation.
        c.children.remove(child)
        again = c.spawn_worker("decode", int(holder.split("-")[1]))
        c.wait_ready([again])
        gen = r.hget(f"pds:worker:{holder}", "generation").decode()
        assert gen != old_generation
    finally:
        c.stop()
