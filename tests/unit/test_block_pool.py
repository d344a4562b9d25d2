"""BlockPool: exact block ids, free-queue order, ref counts, the hash map and its events."""

from __future__ import annotations

import pytest

from shared.engine.block_pool import BlockPool, IntegrityError
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

pytestmark = pytest.mark.unit
H = [bytes([i]) * 16 for i in range(8)]  # block hashes


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def test_new_blocks_come_from_the_head_in_id_order():
    pool = BlockPool(6, enable_caching=True)
    assert free_ids(pool) == [0, 1, 2, 3, 4, 5]
    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [0, 1] and [b.ref_cnt for b in got] == [1, 1]
    assert free_ids(pool) == [2, 3, 4, 5] and pool.num_free_blocks == 4
    pool.check_integrity()


def test_freed_blocks_join_the_tail_in_the_order_given():
    pool = BlockPool(4, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([c, a])  # a request frees tail first: its last block is evicted first
    assert free_ids(pool) == [3, 2, 0]
    pool.free_blocks([b])
    assert free_ids(pool) == [3, 2, 0, 1]
    pool.check_integrity()


def test_a_shared_block_is_free_only_when_its_last_reference_goes():
    pool = BlockPool(3, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and 0 not in free_ids(pool)
    pool.free_blocks([a])
    assert free_ids(pool) == [1, 2, 0]
    with pytest.raises(IntegrityError, match="double free"):
        pool.free_blocks([a])


def test_caching_maps_hashes_and_emits_events_in_chain_order():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_blocks([a, b], H[:2])
    assert pool.get_cached_block(H[0]) is a and pool.get_cached_block(H[1]) is b
    assert pool.take_events() == [BlockStored((H[0], H[1]))]
    assert pool.take_events() == []
    # the first copy of a hash wins: a second block with the same hash stays uncached
    (c,) = pool.get_new_blocks(1)
    pool.cache_blocks([c], [H[0]])
    assert c.block_hash is None and pool.get_cached_block(H[0]) is a
    assert pool.take_events() == []
    with pytest.raises(IntegrityError, match="different hash"):
        pool.cache_blocks([a], [H[5]])


def test_a_cached_free_block_is_revived_by_a_hit_or_evicted_by_an_allocation():
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_blocks([a, b], H[:2])
    pool.take_events()
    pool.free_blocks([b, a])
    assert free_ids(pool) == [2, 1, 0]
    pool.touch([a])  # a prefix hit revives it from the middle of the queue
    assert a.ref_cnt == 1 and free_ids(pool) == [2, 1] and pool.get_cached_block(H[0]) is a
    got = pool.get_new_blocks(2)  # uncached 2 first, then b: evicted
    assert [x.block_id for x in got] == [2, 1]
    assert b.block_hash is None and pool.get_cached_block(H[1]) is None
    assert pool.take_events() == [BlockRemoved((H[1],))]
    assert pool.num_evictions == 1
    pool.check_integrity()


def test_caching_disabled_never_maps_anything():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_blocks([a], [H[0]])
    assert a.block_hash is None and pool.get_cached_block(H[0]) is None
    assert pool.take_events() == []


def test_reset_is_refused_while_blocks_are_in_use():
    pool = BlockPool(2, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.cache_blocks([a], [H[0]])
    assert not pool.reset_prefix_cache()
    pool.free_blocks([a])
    pool.take_events()
    assert pool.reset_prefix_cache()
    assert a.block_hash is None and pool.take_events() == [AllBlocksCleared()]


def test_asking_for_more_blocks_than_free_is_a_bug():
    pool = BlockPool(2, enable_caching=True)
    with pytest.raises(IntegrityError, match="asked for 3"):
        pool.get_new_blocks(3)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda p: setattr(p.blocks[0], "ref_cnt", 1), "in the free queue with ref_cnt"),
        (lambda p: setattr(p.free_queue, "num_free", 5), "counter"),
        (lambda p: setattr(p.blocks[1], "block_hash", H[3]), "does not point back"),
        (lambda p: p.cached.__setitem__(H[4], p.blocks[2]), "points at"),
    ],
)
def test_check_integrity_names_what_broke(corrupt, message):
    pool = BlockPool(4, enable_caching=True)
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(IntegrityError, match=message):
        pool.check_integrity()
