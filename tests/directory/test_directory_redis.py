"""The Redis registry and prefix directory against a real redis-server."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import pytest
import redis

from shared.directory import (
    DirectoryError,
    DirectoryKeys,
    DirectoryReader,
    EmbeddedRedis,
    KVEventPublisher,
    WorkerInfo,
    WorkerLease,
    WorkerLoad,
    connect_async,
    connect_sync,
    make_member,
    parse_member,
)
from shared.hashing import block_hashes, hash_seed
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

MODEL = "tiny-model"


def chain(n_blocks: int, salt: int = 0, block_size: int = 4) -> list[bytes]:
    toks = [(salt * 1000 + i) % 50000 for i in range(n_blocks * block_size)]
    return block_hashes(toks, block_size, hash_seed(MODEL))


def read(url: str, keys: DirectoryKeys, fn):
    """Run ``fn(reader)`` on a fresh event loop with its own async client."""

    async def main():
        client = connect_async(url)
        try:
            return await fn(DirectoryReader(client, keys))
        finally:
            await client.aclose()

    return asyncio.run(main())


def record_commands(client) -> list[str]:
    """From now on, the name of every command ``client`` sends on its own (a round trip each;
    pipelines go their own way), in order."""
    calls: list[str] = []
    execute = client.execute_command

    async def recorded(*args, **kw):
        calls.append(args[0])
        return await execute(*args, **kw)

    client.execute_command = recorded
    return calls


def make_worker(url, keys, wid, role="decode", ttl=3.0, num_blocks=100):
    info = WorkerInfo(
        worker_id=wid,
        role=role,
        model=MODEL,
        grpc=f"127.0.0.1:{5000 + len(wid)}",
        block_size=4,
        num_blocks=num_blocks,
        max_model_len=2048,
        metrics="http://127.0.0.1:9/metrics",
    )
    lease = WorkerLease(connect_sync(url), info, keys=keys, ttl_s=ttl)
    return lease, KVEventPublisher(lease.client, lease)


def live_map(records):
    return {r.worker_id: r.generation for r in records}


def test_member_roundtrip_with_colons_in_ids():
    assert parse_member(make_member("10.0.0.1:7000", "abc")) == ("10.0.0.1:7000", "abc")
    with pytest.raises(DirectoryError):
        parse_member("nogeneration")


def test_lease_register_heartbeat_deregister(redis_server, keys):
    lease, _ = make_worker(redis_server.url, keys, "d0")
    assert lease.register(WorkerLoad(free_blocks=90, running=3, waiting=1))
    (rec,) = read(redis_server.url, keys, lambda r: r.live_workers())
    assert (rec.worker_id, rec.info.role, rec.info.model, rec.info.block_size) == (
        "d0",
        "decode",
        MODEL,
        4,
    )
    assert (rec.load.free_blocks, rec.load.running, rec.load.waiting) == (90, 3, 1)
    assert rec.generation == lease.generation and rec.info.max_model_len == 2048
    assert rec.kv_usage == pytest.approx(0.1)
    ttl_ms = lease.client.pttl(keys.worker("d0"))
    assert 0 < ttl_ms <= 3000

    assert lease.heartbeat(WorkerLoad(free_blocks=10, running=7, waiting=5))
    (rec,) = read(redis_server.url, keys, lambda r: r.live_workers(["decode"]))
    assert (rec.load.running, rec.load.waiting) == (7, 5)
    assert read(redis_server.url, keys, lambda r: r.live_workers(["prefill"])) == []

    assert lease.deregister()
    assert read(redis_server.url, keys, lambda r: r.live_workers()) == []
    assert not lease.heartbeat()  # a deregistered lease stays down


def test_expired_lease_is_not_live_and_role_set_is_cleaned(redis_server, keys):
    lease, _ = make_worker(redis_server.url, keys, "p0", role="prefill", ttl=0.3)
    lease.register()
    assert [r.worker_id for r in read(redis_server.url, keys, lambda r: r.live_workers())] == ["p0"]
    time.sleep(0.45)
    assert read(redis_server.url, keys, lambda r: r.live_workers()) == []
    assert lease.client.smembers(keys.workers("prefill")) == set()


def test_background_heartbeats_keep_a_short_lease_alive(redis_server, keys):
    # a TTL with room for a loaded machine's scheduling delays between 0.1 s heartbeats
    lease, _ = make_worker(redis_server.url, keys, "d1", ttl=1.0)
    calls = []

    def load():
        calls.append(1)
        return WorkerLoad(free_blocks=5, running=len(calls), waiting=0)

    lease.register()
    lease.start(load, interval_s=0.1)
    try:
        time.sleep(2.0)  # twice the TTL: without the heartbeats the lease expired by now
        (rec,) = read(redis_server.url, keys, lambda r: r.live_workers())
        assert rec.load.running >= 3
    finally:
        lease.deregister()
    assert read(redis_server.url, keys, lambda r: r.live_workers()) == []


def test_publish_and_longest_prefix_match(redis_server, keys):
    a, pa = make_worker(redis_server.url, keys, "a")
    b, pb = make_worker(redis_server.url, keys, "b")
    a.register(), b.register()
    h = chain(6)
    assert pa.publish([BlockStored(tuple(h[:5]))])
    # b holds blocks 0, 1 and 3, 4: a gap at 2, so only 2 leading blocks count
    assert pb.publish([BlockStored(tuple(h[:2])), BlockStored(tuple(h[3:5]))])
    assert pa.seq == 1 and lease_seq(a, keys) == 1

    live = live_map(read(redis_server.url, keys, lambda r: r.live_workers()))
    m = read(redis_server.url, keys, lambda r: r.prefix_match(MODEL, h, live))
    assert m.blocks == {"a": 5, "b": 2} and m.stale == []

    pa.publish([BlockRemoved((h[1],))])  # a now breaks at block 1
    m = read(redis_server.url, keys, lambda r: r.prefix_match(MODEL, h, live))
    assert m.blocks == {"a": 1, "b": 2}
    pb.publish([AllBlocksCleared()])
    m = read(redis_server.url, keys, lambda r: r.prefix_match(MODEL, h, live))
    assert m.blocks == {"a": 1, "b": 0}
    assert lease_seq(b, keys) == 2
    # another model never matches, and an empty chain matches nothing
    assert read(redis_server.url, keys, lambda r: r.prefix_match("other", h, live)).blocks == {
        "a": 0,
        "b": 0,
    }
    assert read(redis_server.url, keys, lambda r: r.prefix_match(MODEL, [], live)).blocks == {
        "a": 0,
        "b": 0,
    }


def lease_seq(lease, keys) -> int:
    return int(lease.client.hget(keys.worker(lease.info.worker_id), "seq"))


def test_prefix_match_is_one_round_trip(redis_server, keys):
    a, pa = make_worker(redis_server.url, keys, "a")
    b, pb = make_worker(redis_server.url, keys, "b")
    a.register(), b.register()
    h = chain(40)
    pa.publish([BlockStored(tuple(h[:30]))])
    pb.publish([BlockStored(tuple(h[:12]))])
    live = {"a": a.generation, "b": b.generation}

    async def counted(reader):
        await reader.prefix_match(MODEL, h, live)  # loads the script once
        calls = record_commands(reader.client)
        m = await reader.prefix_match(MODEL, h, live)
        return m, calls

    m, calls = read(redis_server.url, keys, counted)
    assert m.blocks == {"a": 30, "b": 12} and calls == ["EVALSHA"]


def test_restart_gets_new_generation_and_stale_members_are_cleaned(redis_server, keys):
    old, pold = make_worker(redis_server.url, keys, "w")
    old.register()
    h = chain(4, salt=1)
    pold.publish([BlockStored(tuple(h))])
    # the worker restarts: same id, new lease object, new generation, empty cache
    new, pnew = make_worker(redis_server.url, keys, "w")
    assert new.generation != old.generation
    new.register()
    pnew.publish([BlockStored((h[0],))])

    async def scenario(reader):
        live = live_map(await reader.live_workers())
        m = await reader.prefix_match(MODEL, h, live)
        removed = await reader.remove_stale(m.stale)
        m2 = await reader.prefix_match(MODEL, h, live)
        return live, m, removed, m2

    live, m, removed, m2 = read(redis_server.url, keys, scenario)
    assert live == {"w": new.generation}
    assert m.blocks == {"w": 1}  # the old generation's 4 blocks do not count
    assert (keys.block(MODEL, h[0]), old.member) in m.stale
    assert removed == 2  # stale members seen before the scan stopped at block 1
    assert new.client.smembers(keys.block(MODEL, h[0])) == {new.member}
    assert m2.blocks == {"w": 1}


def test_remove_stale_never_removes_a_live_member(redis_server, keys):
    a, pa = make_worker(redis_server.url, keys, "a")
    a.register()
    h = chain(2, salt=2)
    pa.publish([BlockStored(tuple(h))])
    pairs = [
        (keys.block(MODEL, x), a.member) for x in h
    ]  # a caller wrongly believes they are stale
    assert read(redis_server.url, keys, lambda r: r.remove_stale(pairs)) == 0
    assert a.client.smembers(keys.block(MODEL, h[1])) == {a.member}


def test_sweep_removes_members_of_dead_workers(redis_server, keys):
    a, pa = make_worker(redis_server.url, keys, "a", ttl=0.3)
    b, pb = make_worker(redis_server.url, keys, "b")
    a.register(), b.register()
    h = chain(50, salt=3)
    pa.publish([BlockStored(tuple(h))])
    pb.publish([BlockStored(tuple(h[:10]))])
    time.sleep(0.45)  # a's lease expires without deregistering (a crash)

    async def sweep_all(reader):
        cursor, total = 0, 0
        while True:
            cursor, removed = await reader.sweep(MODEL, cursor, count=7)
            total += removed
            if cursor == 0:
                return total

    assert read(redis_server.url, keys, sweep_all) == 50
    assert b.client.smembers(keys.block(MODEL, h[0])) == {b.member}
    assert b.client.smembers(keys.block(MODEL, h[20])) == set()


def test_a_sweep_step_drops_older_generations_in_one_round_trip(redis_server, keys):
    """A live worker's members of an earlier incarnation go, its current ones stay; and each
    step is one script call: the router's event loop parses two values, not every member set
    of the keys it visits (a pipeline of SMEMBERS, then the removal, held it for milliseconds
    a step at 500 keys)."""
    b, pb = make_worker(redis_server.url, keys, "b")
    b.register()
    h = chain(30, salt=5)
    pb.publish([BlockStored(tuple(h))])
    old = make_member("b", "0" * 16)
    for x in h[:12]:
        b.client.sadd(keys.block(MODEL, x), old)

    async def sweep_all(reader):
        calls = record_commands(reader.client)
        reader.client.pipeline = lambda *a, **kw: calls.append("pipeline")
        cursor, total, steps = 0, 0, 0
        while True:
            cursor, removed = await reader.sweep(MODEL, cursor, count=5)
            total += removed
            steps += 1
            if cursor == 0:
                return total, steps, calls

    total, steps, calls = read(redis_server.url, keys, sweep_all)
    assert total == 12
    # (the first call of a fresh server loads the script: EVALSHA, SCRIPT LOAD, EVALSHA)
    assert calls.count("EVALSHA") - calls.count("SCRIPT LOAD") == steps
    assert set(calls) <= {"EVALSHA", "SCRIPT LOAD"}
    assert all(b.client.smembers(keys.block(MODEL, x)) == {b.member} for x in h)


def test_lease_loss_renews_generation_and_publisher_republishes(redis_server, keys):
    a, pa = make_worker(redis_server.url, keys, "a", ttl=0.3)
    a.register()
    h = chain(3, salt=4)
    pa.publish([BlockStored(tuple(h))])
    g0 = a.generation
    time.sleep(0.45)  # stalled longer than the TTL
    assert a.heartbeat()
    assert a.generation != g0
    assert pa.publish([])  # notices the new generation and republishes what it holds
    members = a.client.smembers(keys.block(MODEL, h[2]))
    assert members == {a.member}
    live = {"a": a.generation}
    assert read(redis_server.url, keys, lambda r: r.prefix_match(MODEL, h, live)).blocks == {"a": 3}


def test_publisher_survives_redis_outage_and_converges(keys):
    server = EmbeddedRedis()
    url = server.start()
    port = server.port
    try:
        a, pa = make_worker(url, keys, "a", ttl=30)
        a.register()
        h = chain(6, salt=5)
        assert pa.publish([BlockStored(tuple(h[:3]))])
        os.killpg(server._proc.pid, signal.SIGKILL)  # Redis crashes (no persistence)
        server._proc.wait(5)
        t0 = time.monotonic()
        assert not pa.publish([BlockStored(tuple(h[3:])), BlockRemoved((h[0],))])
        assert not a.heartbeat()
        assert time.monotonic() - t0 < 5  # bounded: the socket timeouts, not a hang
        assert pa.num_pending == 4
        server._proc = None
        server.port = port
        server.start()  # Redis is back, empty
        assert a.heartbeat()  # the lease is re-created (it was lost: new generation)
        assert pa.publish([])
        live = live_map(read(url, keys, lambda r: r.live_workers()))
        m = read(url, keys, lambda r: r.prefix_match(MODEL, h, live))
        assert m.blocks == {"a": 0}  # block 0 was evicted during the outage
        assert a.client.smembers(keys.block(MODEL, h[1])) == {a.member}
        assert a.client.smembers(keys.block(MODEL, h[0])) == set()
        assert pa.num_pending == 0 and pa.num_held == 5
    finally:
        server.stop()


def test_pending_overflow_starts_a_new_generation(redis_server, keys):
    a, pa = make_worker(redis_server.url, keys, "a")
    pa.max_pending = 3
    # not registered yet: nothing can flush, changes stay pending
    assert not pa.publish([BlockStored(tuple(chain(2, salt=6)))])
    a.register()
    g0 = a.generation
    h = chain(5, salt=7)
    assert pa.publish([BlockStored(tuple(h))])  # 7 pending > 3: new generation, full republish
    assert a.generation != g0 and pa.num_held == 7 and pa.num_pending == 0
    assert a.client.smembers(keys.block(MODEL, h[4])) == {a.member}


def test_embedded_redis_stops_its_process():
    server = EmbeddedRedis()
    url = server.start()
    pid = server._proc.pid
    assert redis.Redis.from_url(url).ping()
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(DirectoryError):
        _ = server.url


def test_worker_info_validation():
    with pytest.raises(DirectoryError):
        WorkerInfo(worker_id="x", role="both", model=MODEL, grpc="h:1", block_size=16, num_blocks=1)
    with pytest.raises(DirectoryError):
        WorkerInfo(
            worker_id="", role="decode", model=MODEL, grpc="h:1", block_size=16, num_blocks=1
        )


def test_prefix_match_agrees_with_a_reference_on_random_holdings(redis_server, keys):
    """Server-side scan-and-stop vs a plain Python longest-prefix over random cache contents,
    with gaps, stale generations and members of unknown workers."""
    import random

    rng = random.Random(1234)
    workers = [make_worker(redis_server.url, keys, f"w{i}") for i in range(4)]
    for lease, _ in workers:
        lease.register()
    ghost = WorkerLease(
        connect_sync(redis_server.url),
        WorkerInfo(
            worker_id="w0", role="decode", model=MODEL, grpc="h:1", block_size=4, num_blocks=9
        ),
        keys=keys,
    )  # same id as w0, other generation (never registered: stale)
    for trial in range(30):
        h = chain(rng.randint(1, 24), salt=100 + trial)
        held: dict[str, set[int]] = {}
        for lease, pub in workers:
            n = rng.randint(0, len(h))
            idx = set(range(n)) | {rng.randrange(len(h)) for _ in range(rng.randint(0, 4))}
            idx -= {rng.randrange(len(h)) for _ in range(rng.randint(0, 2))}  # gaps
            held[lease.info.worker_id] = idx
            pub.publish([BlockStored(tuple(h[i] for i in sorted(idx)))])
        for i in range(len(h)):  # stale members sprinkled everywhere
            if rng.random() < 0.5:
                workers[0][0].client.sadd(keys.block(MODEL, h[i]), ghost.member, "nobody:1")
        live = {lease.info.worker_id: lease.generation for lease, _ in workers}
        m = read(redis_server.url, keys, lambda r, h=h, live=live: r.prefix_match(MODEL, h, live))

        def longest(idx: set[int]) -> int:
            n = 0
            while n in idx:
                n += 1
            return n

        assert m.blocks == {w: longest(idx) for w, idx in held.items()}
        assert all(mem in (ghost.member, "nobody:1") for _, mem in m.stale)
        for _, pub in workers:
            pub.publish([AllBlocksCleared()])


def test_embedded_redis_dies_with_its_parent():
    import subprocess
    import sys

    code = (
        "import time\nfrom shared.directory import EmbeddedRedis\n"
        "r = EmbeddedRedis(); r.start(); print(r._proc.pid, flush=True); time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        redis_pid = int(parent.stdout.readline())
        os.kill(redis_pid, 0)  # running
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the parent crashes without stopping it
        parent.wait(5)
        parent.stdout.close()
    deadline = time.monotonic() + 5
    while True:
        try:
            os.kill(redis_pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "redis-server outlived its parent"
        time.sleep(0.05)


def test_async_pool_queues_a_burst_instead_of_failing(redis_server):
    """A burst far above the pool size waits for connections; no MaxConnectionsError."""
    import asyncio

    from shared.directory import connect_async

    async def burst():
        client = connect_async(redis_server.url, max_connections=4)
        try:
            return await asyncio.gather(*[client.ping() for _ in range(300)])
        finally:
            await client.aclose()

    assert asyncio.run(burst()) == [True] * 300


def test_embedded_redis_restarts_on_its_own_port_or_not_at_all():
    """``pdserve up`` restarts its dead Redis "on the same port". When that port was held at
    that moment, the server silently came up on a random port instead: every worker and the
    router kept the old URL, and the cluster had no registry for good (later restarts kept
    the new port too)."""
    server = EmbeddedRedis()
    server.start()
    port = server.port
    try:
        os.kill(server.pid, signal.SIGKILL)
        while server.alive:
            time.sleep(0.02)
        blocker = socket.socket()
        blocker.bind(("127.0.0.1", port))
        blocker.listen(1)
        try:
            with pytest.raises(DirectoryError, match=f"did not start on port {port}"):
                server.restart(timeout_s=2)
            assert server.port == port and not server.alive
        finally:
            blocker.close()
        server.restart(timeout_s=10)  # the port is free again: the next try takes it
        assert server.port == port and server.alive
        assert redis.Redis(port=port, socket_timeout=2).ping()
    finally:
        server.stop()
