"""The routing cost model (pure logic)."""

from __future__ import annotations

import random

import pytest

from router.policy import Candidate, PolicyConfig, choose_route, decode_load

pytestmark = pytest.mark.unit


def cand(wid, cached=0, running=0, waiting=0, free=10_000, inflight=0, bs=16):
    return Candidate(wid, f"{wid}:1", cached, running, waiting, free, bs, inflight)


CFG = PolicyConfig(local_prefill_threshold=0)


def test_no_decode_worker_means_no_route():
    assert choose_route(100, [], [cand("p")], CFG) is None


def test_decode_worker_holding_the_prefix_wins():
    r = choose_route(1024, [cand("d0"), cand("d1", cached=1008)], [cand("p")], CFG)
    assert r.decode.worker_id == "d1"
    assert r.uncached_tokens == 16


def test_prefill_worker_holding_the_prefix_wins():
    r = choose_route(1024, [cand("d")], [cand("p0", cached=512), cand("p1", cached=1008)], CFG)
    assert r.prefill.worker_id == "p1" and r.path == "disagg"


def test_load_decides_when_nobody_caches():
    r = choose_route(256, [cand("d0", waiting=3), cand("d1", running=2)], [cand("p")], CFG)
    assert r.decode.worker_id == "d1"
    # requests this router sent but the worker has not reported yet count as load
    r = choose_route(256, [cand("d0", inflight=3), cand("d1")], [cand("p")], CFG)
    assert r.decode.worker_id == "d1"


def test_cache_hit_outweighs_light_load_but_not_a_deep_queue():
    cfg = CFG
    hot = cand("hot", cached=4096, running=4)
    cold = cand("cold")
    assert choose_route(4112, [hot, cold], [cand("p")], cfg).decode.worker_id == "hot"
    swamped = cand("hot", cached=4096, waiting=40)
    assert choose_route(4112, [swamped, cold], [cand("p")], cfg).decode.worker_id == "cold"


def test_local_prefill_when_decode_holds_nearly_everything():
    cfg = PolicyConfig(local_prefill_threshold=64)
    r = choose_route(1000, [cand("d", cached=960)], [cand("p")], cfg)
    assert r.path == "local" and r.prefill is None
    # above the threshold the costs decide: a cold P would recompute all 1000 tokens, so D's
    # 200 missing tokens are cheaper locally; a P holding the same prefix makes disagg cheaper
    # (a D decoding one request: on an idle one a short prefill is local anyway, see below)
    r = choose_route(1000, [cand("d", cached=800, running=1)], [cand("p")], cfg)
    assert r.path == "local"
    r = choose_route(1000, [cand("d", cached=800, running=1)], [cand("p", cached=800)], cfg)
    assert r.path == "disagg" and r.uncached_tokens == 200


def test_local_prefill_without_prefill_workers():
    r = choose_route(5000, [cand("d")], [], CFG)
    assert r.path == "local" and r.uncached_tokens == 5000


def test_swamped_prefill_pool_falls_back_to_local():
    r = choose_route(512, [cand("d")], [cand("p", waiting=20)], CFG)
    assert r.path == "local"


def test_kv_pressure_on_decode_is_penalised():
    full = cand("full", free=2)
    roomy = cand("roomy", running=1)
    assert decode_load(full, 1024, CFG) > decode_load(roomy, 1024, CFG)
    assert choose_route(1024, [full, roomy], [cand("p")], CFG).decode.worker_id == "roomy"


def test_full_hit_still_costs_one_token():
    r = choose_route(64, [cand("d", cached=64)], [], CFG)
    assert r.uncached_tokens == 1


def test_ties_break_randomly_but_reproducibly():
    ds = [cand(f"d{i}") for i in range(4)]
    picks = {choose_route(100, ds, [], CFG, random.Random(s)).decode.worker_id for s in range(40)}
    assert len(picks) == 4
    a = [choose_route(100, ds, [], CFG, random.Random(7)).decode.worker_id for _ in range(3)]
    assert len(set(a)) == 1


def test_rejects_empty_prompt():
    with pytest.raises(ValueError):
        choose_route(0, [cand("d")], [], CFG)


def test_prefill_workers_with_another_block_size_are_not_paired():
    r = choose_route(4096, [cand("d", bs=16)], [cand("p", bs=32)], CFG)
    assert r.path == "local"
    r = choose_route(4096, [cand("d", bs=16)], [cand("p", bs=32), cand("q", bs=16)], CFG)
    assert r.prefill.worker_id == "q"


def test_prefill_workers_with_other_weights_are_not_paired():
    """A P serving another quantization would push KV that D's own weights do not produce."""
    d = Candidate("d", "d:1", 0, 0, 0, 10_000, 16, weights="int8 (w8a16, per-channel, symmetric)")
    dense = cand("p")
    same = Candidate("q", "q:1", 0, 0, 0, 10_000, 16, weights=d.weights)
    assert choose_route(4096, [d], [dense], CFG).path == "local"
    assert choose_route(4096, [d], [dense, same], CFG).prefill.worker_id == "q"


def cand2(wid, backlog=0, decoding=0, **kw):
    c = cand(wid, **kw)
    return Candidate(
        c.worker_id,
        c.address,
        c.cached_tokens,
        c.running,
        c.waiting,
        c.free_blocks,
        c.block_size,
        c.inflight,
        backlog,
        decoding,
    )


def test_a_burst_splits_prefills_between_p_and_an_idle_d():
    """Dispatching a burst of 256-token prompts: the router's own backlog (tokens sent to
    prefill, no first token yet) sends the prompts after the first few to whichever worker
    can start them sooner: P's backlog against D's own plus the local-prefill penalty."""
    cfg = PolicyConfig(local_prefill_threshold=128)
    backlog = {"p": 0, "d": 0}
    inflight = {"p": 0, "d": 0}
    paths = []
    for _ in range(16):
        d = cand2("d", backlog["d"], inflight=inflight["d"])
        r = choose_route(256, [d], [cand2("p", backlog["p"])], cfg)
        backlog["p" if r.prefill else "d"] += r.uncached_tokens
        inflight["d"] += 1
        paths.append(r.path)
    assert paths[:2] == ["local", "disagg"]  # the idle D takes the first itself
    assert 7 <= paths.count("local") <= 8 and paths.count("disagg") == 16 - paths.count("local")


def test_an_idle_d_prefills_a_short_prompt_itself():
    """Nothing in flight on D: a prompt no P holds a prefix of costs D what it costs P, without
    the transfer, up to ``idle_local_prefill_tokens``; anything in flight, running or waiting
    on D, a longer prompt, or a P holding the prefix, and P is cheaper again."""
    cfg = PolicyConfig(local_prefill_threshold=128, idle_local_prefill_tokens=1024)
    p = cand("p")
    assert choose_route(256, [cand("d")], [p], cfg).path == "local"
    assert choose_route(1024, [cand("d")], [p], cfg).path == "local"
    assert choose_route(1025, [cand("d")], [p], cfg).path == "disagg"
    for busy in (
        cand("d", inflight=1),
        cand("d", running=1),
        cand("d", waiting=1),
        cand2("d", decoding=1),
        cand2("d", backlog=16),
    ):
        assert choose_route(256, [busy], [p], cfg).path == "disagg", busy
    assert choose_route(1000, [cand("d")], [cand("p", cached=992)], cfg).path == "disagg"
    off = PolicyConfig(local_prefill_threshold=128, idle_local_prefill_tokens=0)
    assert choose_route(256, [cand("d")], [p], off).path == "disagg"


def test_a_decoding_d_leaves_long_prefills_to_a_busy_p():
    """With sequences decoding on D, a 3000-token prompt waits for P's backlog rather than
    stalling them; an idle D takes it instead."""
    cfg = PolicyConfig(local_prefill_threshold=128)
    busy_p = cand2("p", backlog=3000)
    assert choose_route(3000, [cand2("d", decoding=6)], [busy_p], cfg).path == "disagg"
    assert choose_route(3000, [cand2("d")], [busy_p], cfg).path == "local"
