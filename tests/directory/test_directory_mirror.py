"""The router's copy of the directory (``shared/directory/mirror.py``) against a real Redis:
it agrees with the server-side lookup, follows the event stream, and loads itself again when it
loses track (trimmed stream, Redis emptied, trimmed while loading)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest

from shared.directory import (
    DirectoryMirror,
    DirectoryReader,
    KVEventPublisher,
    WorkerLease,
    connect_async,
    make_member,
)
from shared.directory.mirror import EMIT_LUA
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.directory.test_directory_redis import MODEL, chain, make_worker

WAIT_S = 10.0


def run(coro):
    return asyncio.run(coro)


def mirror_for(url, keys, **kw) -> DirectoryMirror:
    return DirectoryMirror(connect_async(url, timeout_s=3.0), keys, MODEL, block_ms=200, **kw)


async def until(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def caught_up(mirror: DirectoryMirror) -> None:
    """Until the mirror has applied every entry written so far (the counter's value)."""
    target = int(await mirror.client.get(mirror.counter) or 0)
    await until(lambda: mirror.synced and mirror._last_n >= target, f"event {target}")


def test_mirror_agrees_with_the_server_side_lookup_on_random_holdings(redis_server, keys):
    """Random stores and removals on four workers, some before the mirror loads (snapshot),
    the rest while it runs (stream): after each round the local lookup gives exactly what the
    Redis script gives, for every chain and for every subset of live workers."""
    rng = random.Random(7)
    workers = [make_worker(redis_server.url, keys, f"w{i}") for i in range(4)]
    for lease, _ in workers:
        lease.register()
    chains = [chain(rng.randint(1, 20), salt=s) for s in range(12)]

    def churn() -> None:
        for _lease, pub in workers:
            events = []
            for h in rng.sample(chains, 4):
                lo = rng.randrange(len(h))
                hi = rng.randint(lo, len(h))
                kind = BlockStored if rng.random() < 0.7 else BlockRemoved
                events.append(kind(tuple(h[lo:hi])))
            pub.publish(events)

    churn()  # before the mirror exists: loaded by its scan

    async def main():
        mirror = mirror_for(redis_server.url, keys)
        reader_client = connect_async(redis_server.url)
        reader = DirectoryReader(reader_client, keys)
        task = asyncio.create_task(mirror.run())
        try:
            assert mirror.prefix_match(chains[0], {"w0": "x"}) is None  # not loaded yet
            for _ in range(6):
                await caught_up(mirror)
                for h in chains:
                    for k in (1, 2, 4):
                        live = {
                            lease.info.worker_id: lease.generation
                            for lease, _ in rng.sample(workers, k)
                        }
                        want = await reader.prefix_match(MODEL, h, live)
                        got = mirror.prefix_match(h, live)
                        assert got is not None and got.blocks == want.blocks
                await asyncio.to_thread(churn)  # while it runs: from the stream
            assert mirror.resyncs == 1 and mirror.entries > 0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await mirror.client.aclose()
            await reader_client.aclose()

    run(main())


def test_a_block_stored_after_loading_is_seen_without_asking_redis(redis_server, keys):
    lease, pub = make_worker(redis_server.url, keys, "a")
    lease.register()
    h = chain(5)

    async def main():
        mirror = mirror_for(redis_server.url, keys)
        task = asyncio.create_task(mirror.run())
        try:
            await until(lambda: mirror.synced, "the first load")
            live = {"a": lease.generation}
            assert mirror.prefix_match(h, live).blocks == {"a": 0}
            await asyncio.to_thread(pub.publish, [BlockStored(tuple(h[:3]))])
            await until(lambda: mirror.prefix_match(h, live).blocks == {"a": 3}, "3 blocks")
            await asyncio.to_thread(pub.publish, [BlockRemoved((h[1],))])
            await until(lambda: mirror.prefix_match(h, live).blocks == {"a": 1}, "1 block")
            await asyncio.to_thread(pub.publish, [AllBlocksCleared()])
            await until(lambda: mirror.num_blocks == 0, "no block")
            # another generation of the same worker does not count
            assert mirror.prefix_match(h, {"a": "other"}).blocks == {"a": 0}
            assert mirror.resyncs == 1
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await mirror.client.aclose()

    run(main())


def test_a_hole_in_the_stream_makes_the_mirror_load_again(redis_server, keys):
    """Entries trimmed before the mirror read them: the numbers skip, the mirror notices and
    loads the block sets again, ending with the right state."""
    lease, pub = make_worker(redis_server.url, keys, "a")
    lease.register()
    h = chain(8)

    async def main():
        mirror = mirror_for(redis_server.url, keys)
        try:
            await mirror._resync()
            live = {"a": lease.generation}
            for i in range(6):  # six entries; all but the last trimmed before the mirror reads
                await asyncio.to_thread(pub.publish, [BlockStored((h[i],))])
            await mirror.client.xtrim(mirror.stream, maxlen=1, approximate=False)
            with pytest.raises(Exception, match="follows"):
                await mirror._tail_once()
            task = asyncio.create_task(mirror.run())
            try:
                await until(lambda: mirror.resyncs == 2 and mirror.synced, "the second load")
                assert mirror.prefix_match(h, live).blocks == {"a": 6}
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        finally:
            await mirror.client.aclose()

    run(main())


def test_redis_emptied_under_the_mirror_makes_it_load_again(redis_server, keys):
    """Redis restarted empty (here: the keys deleted). The workers publish again from number 1:
    the mirror sees the numbers go back and loads again. And when the new stream's ids are
    below the mirror's position (a clock behind), XREAD stays silent: the counter, checked on
    every idle read, tells."""
    lease, pub = make_worker(redis_server.url, keys, "a")
    lease.register()
    h = chain(4)
    pub.publish([BlockStored(tuple(h))])

    async def main():
        mirror = mirror_for(redis_server.url, keys)
        task = asyncio.create_task(mirror.run())
        client = mirror.client

        async def wipe() -> None:
            victims = [k async for k in client.scan_iter(match=f"{keys.prefix}*")]
            await client.delete(*victims)

        try:
            await until(lambda: mirror.synced, "the first load")
            for _ in range(3):  # several entries, so the mirror's number is well ahead
                await asyncio.to_thread(pub.publish, [BlockRemoved((h[3],))])
                await asyncio.to_thread(pub.publish, [BlockStored((h[3],))])
            await caught_up(mirror)
            ahead = mirror._last_n
            await wipe()
            # the lease is gone too: a new generation, under which the worker republishes
            await asyncio.to_thread(lease.register)
            await asyncio.to_thread(pub.publish, [])
            assert int(await client.get(mirror.counter)) < ahead
            live = {"a": lease.generation}
            await until(
                lambda: mirror.resyncs == 2 and mirror.prefix_match(h, live).blocks == {"a": 4},
                "a load after the numbers went back",
            )
            await caught_up(mirror)
            # the idle path: a stream whose ids are below the mirror's position
            await wipe()
            await client.xadd(mirror.stream, {"n": 1, "m": "", "a": "", "r": ""}, id="1-1")
            await client.set(mirror.counter, 1)
            await until(lambda: mirror.resyncs == 3, "a load after an idle read")
            assert mirror.synced and mirror.num_blocks == 0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.aclose()

    run(main())


def test_a_stream_trimmed_while_loading_is_loaded_again(redis_server, keys):
    """The marker written before the scan is gone after it (trimmed past the load's start):
    changes made during the scan may be lost, so the load does not count."""
    lease, pub = make_worker(redis_server.url, keys, "a")
    lease.register()
    pub.publish([BlockStored(tuple(chain(3)))])

    async def main():
        mirror = mirror_for(redis_server.url, keys)
        real_scan = mirror.client.scan
        trims = []

        async def scan_then_trim(*a, **kw):
            out = await real_scan(*a, **kw)
            if not trims:
                trims.append(await mirror.client.xtrim(mirror.stream, maxlen=0, approximate=False))
            return out

        mirror.client.scan = scan_then_trim
        try:
            with pytest.raises(Exception, match="trimmed"):
                await mirror._resync()
            assert not mirror.synced and trims == [2]  # the worker's entry and the marker
            await mirror._resync()  # no trim this time
            assert mirror.synced and mirror.num_blocks == 3
        finally:
            await mirror.client.aclose()

    run(main())


def test_prune_drops_members_neither_live_nor_written_lately(redis_server, keys):
    a, pa = make_worker(redis_server.url, keys, "a")
    b, pb = make_worker(redis_server.url, keys, "b")
    a.register(), b.register()
    h = chain(4)
    pa.publish([BlockStored(tuple(h))])
    pb.publish([BlockStored(tuple(h[:2]))])

    async def main():
        mirror = mirror_for(redis_server.url, keys)
        try:
            await mirror._resync()
            assert mirror.num_blocks == 4
            live = {a.member}
            # b was written (loaded) just now: kept until it has been idle long enough
            assert mirror.prune(live, idle_since=time.monotonic() - 60) == 0
            assert mirror.prune(live, idle_since=time.monotonic() + 1) == 1
            assert mirror.prefix_match(h, {"a": a.generation, "b": b.generation}).blocks == {
                "a": 4,
                "b": 0,
            }
            assert mirror.num_blocks == 4  # a still holds them all
            assert mirror.prune(set(), idle_since=time.monotonic() + 1) == 1
            assert mirror.num_blocks == 0
        finally:
            await mirror.client.aclose()

    run(main())


def test_publisher_numbers_entries_without_holes_across_workers(redis_server, keys):
    """Every change is in the stream, numbered 1, 2, 3... in stream order, whoever wrote it
    (the marker a mirror writes takes a number too)."""
    a, pa = make_worker(redis_server.url, keys, "a")
    b, pb = make_worker(redis_server.url, keys, "b")
    a.register(), b.register()
    h = chain(3)
    pa.publish([BlockStored(tuple(h))])
    pb.publish([BlockStored(tuple(h[:1])), BlockRemoved((h[2],))])
    a.client.register_script(EMIT_LUA)(
        keys=[keys.events(MODEL), keys.events_counter(MODEL)], args=[100, "m", ""]
    )
    pa.publish([BlockRemoved((h[0],))])
    entries = a.client.xrange(keys.events(MODEL))
    fields = [dict(f) for _, f in entries]  # the sync client decodes replies
    assert [int(f["n"]) for f in fields] == [1, 2, 3, 4]
    assert [f["m"] for f in fields] == [a.member, b.member, "", a.member]

    def hashes(hexes: str) -> set[str]:
        return {hexes[i : i + 32] for i in range(0, len(hexes), 32)}

    assert hashes(fields[0]["a"]) == {x.hex() for x in h} and fields[0]["r"] == ""
    assert fields[1]["a"] == h[0].hex() and fields[1]["r"] == ""  # h[2] was never b's
    assert fields[3]["a"] == "" and fields[3]["r"] == h[0].hex()
    assert make_member("a", a.generation) == a.member


def test_the_mirror_leaves_nothing_for_a_full_gc_to_walk(redis_server, keys):
    """The router's copy of the directory can hold hundreds of thousands of blocks; a set per
    block made each full garbage collection of the router walk them all (150k: ~20 ms of its
    event loop, every ~13 s under load). Holders are tuples, which the collector untracks."""
    import gc

    a, pa = make_worker(redis_server.url, keys, "a")
    b, pb = make_worker(redis_server.url, keys, "b")
    a.register(), b.register()
    h = chain(6)
    pa.publish([BlockStored(tuple(h))])

    async def main():
        mirror = mirror_for(redis_server.url, keys)
        task = asyncio.create_task(mirror.run())
        try:
            await until(lambda: mirror.synced, "the first load")  # a's blocks: from the scan
            await asyncio.to_thread(pb.publish, [BlockStored(tuple(h[:3]))])  # b's: the stream
            await caught_up(mirror)
            gc.collect()
            holders = list(mirror._blocks.values())
            assert len(holders) == 6 and not any(gc.is_tracked(v) for v in holders)
            match = mirror.prefix_match(h, {"a": a.generation, "b": b.generation})
            assert match.blocks == {"a": 6, "b": 3}
            await asyncio.to_thread(pb.publish, [BlockRemoved((h[0],))])
            await caught_up(mirror)
            assert mirror.prefix_match(h, {"b": b.generation}).blocks == {"b": 0}
            assert mirror.prefix_match(h, {"a": a.generation}).blocks == {"a": 6}
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await mirror.client.aclose()

    run(main())


@pytest.mark.parametrize(
    ("model", "neighbour"),
    [("llama3", "llama3:8b"), ("m[v2]", None), ("a*?b\\c", "a*?b\\c:x")],
)
def test_the_load_finds_exactly_its_own_models_blocks_whatever_the_name(
    redis_server, keys, model, neighbour
):
    """The load's SCAN pattern had the served model name pasted in unescaped: ``m[v2]``
    matched none of its own keys (synced with 0 blocks: blocks stored before the load never
    found), and ``llama3`` also matched ``llama3:8b``'s keys, whose names failed to parse, so
    that mirror never synced at all (every lookup went to Redis, an error logged each second)."""
    h = chain(4)

    def publisher(wid: str, name: str):
        lease, _ = make_worker(redis_server.url, keys, wid)
        lease = WorkerLease(
            lease.client, dataclasses.replace(lease.info, model=name), keys=keys, ttl_s=30
        )
        lease.register()
        KVEventPublisher(lease.client, lease).publish([BlockStored(tuple(h[:3]))])
        return lease

    mine = publisher("a", model)
    if neighbour:
        publisher("b", neighbour)

    async def main():
        mirror = DirectoryMirror(
            connect_async(redis_server.url, timeout_s=3.0), keys, model, block_ms=200
        )
        task = asyncio.create_task(mirror.run())
        try:
            await until(lambda: mirror.synced, "the first load")
            assert mirror.num_blocks == 3
            assert mirror.prefix_match(h, {"a": mine.generation}).blocks == {"a": 3}
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await mirror.client.aclose()

    run(main())


def test_a_model_named_like_another_models_counter_keeps_its_own_stream(redis_server, keys):
    """The event counter of model ``m`` was ``kvev:m:n``, which is the event stream of a model
    named ``m:n``: with both served from one Redis, the second publisher's INCR or XADD hit
    the other's key (WRONGTYPE) and its blocks never reached the directory."""
    h = chain(3)
    leases = {}
    for wid, name in (("a", "m"), ("b", "m:n")):
        lease, _ = make_worker(redis_server.url, keys, wid)
        lease = WorkerLease(
            lease.client, dataclasses.replace(lease.info, model=name), keys=keys, ttl_s=30
        )
        lease.register()
        KVEventPublisher(lease.client, lease).publish([BlockStored(tuple(h[: len(leases) + 2]))])
        leases[name] = lease
    for name, lease in leases.items():
        entries = lease.client.xrange(keys.events(name))
        assert [dict(f)["m"] for _, f in entries] == [lease.member]
        assert int(lease.client.get(keys.events_counter(name))) == 1
