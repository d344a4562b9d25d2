"""KVCacheManager: block tables, prefix hits, "no room" as None, fork (copy-on-write), swap,
pins, and the integrity check that ties them to the pool's ref counts."""

from __future__ import annotations

import pytest

from shared.engine.block_pool import IntegrityError
from shared.engine.kv_cache_manager import KVCacheManager
from tests.unit.factories import BLOCK, make_request

pytestmark = pytest.mark.unit


def manager(num_blocks=8, caching=True, host=0) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK, caching, host)


def admit(kv, req, n_tokens=None):
    """Prefix lookup + allocation for the whole prompt, as the scheduler admits a request."""
    computed, num_computed = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, (n_tokens or req.num_tokens) - num_computed, computed)
    if new is not None:
        req.num_computed_tokens = num_computed
        kv.record_lookup(req, num_computed)
    return new, num_computed


def test_allocation_takes_exact_blocks_and_hashes_the_full_ones():
    kv = manager()
    r = make_request("a", 10)  # 2 full blocks + 2 tokens
    new, hit = admit(kv, r)
    assert hit == 0 and [b.block_id for b in new] == [0, 1, 2]
    assert kv.block_ids("a") == [0, 1, 2]
    assert [kv.pool.blocks[i].block_hash for i in (0, 1)] == r.block_hashes[:2]
    assert kv.pool.blocks[2].block_hash is None  # partial: not shareable yet
    kv.check_integrity({"a"})


def test_no_room_is_none_and_changes_nothing():
    kv = manager(num_blocks=2)
    r = make_request("a", 12)  # needs 3 blocks
    assert admit(kv, r) == (None, 0)
    assert kv.block_ids("a") == [] and kv.pool.num_free_blocks == 2
    kv.check_integrity(set())


def test_a_second_request_reuses_the_cached_prefix_blocks():
    kv = manager()
    a = make_request("a", list(range(100, 110)))
    admit(kv, a)
    b = make_request("b", list(range(100, 108)) + [7, 7, 7])  # shares 2 full blocks
    new, hit = admit(kv, b)
    assert hit == 2 * BLOCK and kv.block_ids("b")[:2] == [0, 1]
    assert [x.block_id for x in new] == [3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert (kv.prefix_queries, kv.prefix_hits) == (10 + 11, 8)
    kv.check_integrity({"a", "b"})


def test_a_fully_cached_prompt_still_computes_its_last_token():
    kv = manager()
    a = make_request("a", list(range(100, 108)))  # exactly 2 blocks
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(100, 108)))
    new, hit = admit(kv, b)
    assert hit == BLOCK  # the last block is recomputed: its last token's logits are needed
    assert kv.block_ids("b")[0] == 0


def test_freed_cached_blocks_are_evicted_tail_first_and_stay_hittable_until_then():
    kv = manager(num_blocks=5)
    a = make_request("a", list(range(100, 112)))
    admit(kv, a)
    kv.free(a)  # tail first: 2, 1, 0 join the free queue after the never-used 3, 4
    assert [b.block_id for b in kv.pool.free_queue] == [3, 4, 2, 1, 0]
    c = make_request("c", list(range(200, 208)))  # unrelated: takes the head, 3 and 4
    admit(kv, c)
    assert kv.block_ids("c") == [3, 4]
    d = make_request("d", list(range(100, 112)))  # a's first two blocks are still cached
    _, hit = admit(kv, d)
    assert hit == 2 * BLOCK and kv.block_ids("d") == [0, 1, 2]
    e = make_request("e", list(range(300, 304)))  # no block left that is not in a table
    assert admit(kv, e) == (None, 0)


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    kv = manager()
    parent = make_request("p", 10)
    admit(kv, parent)
    parent.num_computed_tokens = 10
    child = make_request("c", 10)
    copies = kv.fork(parent, child)
    assert kv.block_ids("c")[:2] == [0, 1] and copies == [(2, kv.block_ids("c")[2])]
    assert kv.block_ids("c")[2] == 3
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    kv.check_integrity({"p", "c"})


def test_fork_without_a_free_block_for_the_copy_is_none():
    kv = manager(num_blocks=3)
    parent = make_request("p", 10)
    admit(kv, parent)
    parent.num_computed_tokens = 10
    assert kv.fork(parent, make_request("c", 10)) is None
    assert kv.block_ids("c") == []
    kv.check_integrity({"p"})


def test_swap_out_and_in_move_exact_blocks_through_the_host_pool():
    kv = manager(num_blocks=6, host=4)
    r = make_request("a", 10)
    admit(kv, r)
    pairs = kv.swap_out(r)
    assert pairs == [(0, 0), (1, 1), (2, 2)]  # host blocks popped from the low end
    assert kv.block_ids("a") == [] and kv.pool.num_free_blocks == 6
    assert kv.can_swap_in(r, extra_blocks=3) and not kv.can_swap_in(r, extra_blocks=4)
    back = kv.swap_in(r)
    assert [h for h, _ in back] == [0, 1, 2] and kv.block_ids("a") == [d for _, d in back]
    kv.check_integrity({"a"})


def test_swap_out_without_host_room_is_none():
    kv = manager(num_blocks=6, host=2)
    r = make_request("a", 10)
    admit(kv, r)
    assert kv.swap_out(r) is None and kv.block_ids("a") == [0, 1, 2]


def test_pins_hold_blocks_after_the_table_is_freed():
    kv = manager(num_blocks=4)
    r = make_request("a", 8)
    admit(kv, r)
    pin = kv.pin([0, 1])
    assert kv.pin([1], pin) == pin and kv.num_pinned_blocks == 3
    kv.free(r)
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1)] == [1, 2]
    assert 0 not in [b.block_id for b in kv.pool.free_queue]
    kv.check_integrity(set())
    assert kv.unpin(pin) and not kv.unpin(pin)
    assert kv.pool.num_free_blocks == 4 and kv.num_pinned_blocks == 0
    kv.check_integrity(set())


def test_the_pinned_count_can_be_read_while_the_engine_thread_pins():
    """``num_pinned_blocks`` (read by the metrics and lease threads through
    ``EngineCore.stats``) iterated the pins while the engine thread pinned and unpinned: a
    scrape or a load report failed with "dictionary changed size during iteration"
    (about 3,000 of 50,000 reads in a second, before the fix)."""
    import sys
    import threading
    import time

    kv = manager(num_blocks=4)
    admit(kv, make_request("a", 8))
    for _ in range(200):
        kv.pin([0, 1])
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            kv.unpin(kv.pin([0, 1]))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=churn)
    t.start()
    errors = reads = 0
    try:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            try:
                assert kv.num_pinned_blocks in (400, 402)
                reads += 1
            except RuntimeError:
                errors += 1
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert errors == 0 and reads > 0


def test_pinning_a_free_block_is_refused_and_changes_nothing():
    kv = manager(num_blocks=4)
    with pytest.raises(IntegrityError, match="no request holds"):
        kv.pin([3])
    assert kv.num_pinned_blocks == 0 and kv.pool.num_free_blocks == 4


def test_integrity_sees_tables_that_do_not_match_ref_counts():
    kv = manager()
    r = make_request("a", 8)
    admit(kv, r)
    with pytest.raises(IntegrityError, match="not live"):
        kv.check_integrity(set())
    kv.pool.blocks[0].ref_cnt += 1
    with pytest.raises(IntegrityError, match="tables and pins"):
        kv.check_integrity({"a"})
