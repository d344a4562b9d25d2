"""The KV block pool: sole owner of block ref counts, the free queue and the hash -> block map.

Free blocks sit in a doubly linked LRU queue (least recently freed first). A free block may
still carry a hash (it is a *cached* free block): a prefix-cache hit revives it, an allocation
that pops it evicts it. Every change to the cache emits a KV event for the directory.
No torch import: the pool manages block ids; the model runner owns the tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class IntegrityError(AssertionError):
    """A block-pool or KV-cache-manager invariant does not hold (a bug, never bad input)."""


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; O(1) pop-front, append and remove-from-middle."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise IntegrityError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free


class BlockPool:
    """``num_blocks`` KV blocks with ref counting and LRU reuse of cached free blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.events: list[KVEvent] = []
        self.num_evictions = 0
        # Blocks [0, high_water) have been handed out at least once. The free queue starts in
        # id order and freed blocks join its tail, so blocks never used leave it in id order,
        # all before any reused one: the engine commits the pages ahead of this mark.
        self.high_water = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        """Fraction of blocks held by live requests (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks off the free queue (evicting cached ones) with ref count 1.

        The caller must have checked ``num_free_blocks >= n``.
        """
        if n > self.num_free_blocks:
            raise IntegrityError(f"asked for {n} blocks with {self.num_free_blocks} free")
        out = []
        removed: list[bytes] = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                removed.append(block.block_hash)
                del self.cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            if block.block_id >= self.high_water:
                self.high_water = block.block_id + 1
            out.append(block)
        if removed:
            self.events.append(BlockRemoved(tuple(removed)))
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (reviving cached free blocks)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue in
        the given order, so the first ones given are evicted first."""
        for block in ordered:
            if block.ref_cnt <= 0:
                raise IntegrityError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_blocks(self, blocks: list[KVCacheBlock], hashes: list[bytes]) -> None:
        """Give each full block its chained hash so later requests can reuse it.

        A block whose hash already maps to another block stays uncached (the first copy wins).
        """
        if not self.enable_caching:
            return
        stored: list[bytes] = []
        for block, h in zip(blocks, hashes):
            if block.block_hash is not None:
                if block.block_hash != h:
                    raise IntegrityError(f"{block} re-cached with a different hash")
                continue
            if h in self.cached:
                continue
            block.block_hash = h
            self.cached[h] = block
            stored.append(h)
        if stored:
            self.events.append(BlockStored(tuple(stored)))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash. Refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` unless: free + used = total, every free block has ref 0 and
        every other block ref > 0, the free queue links are consistent, and every map entry
        points at a block carrying that hash (and vice versa)."""
        seen = set()
        for block in self.free_queue:
            if block.ref_cnt != 0:
                raise IntegrityError(f"{block} in the free queue with ref_cnt {block.ref_cnt}")
            if block.block_id in seen:
                raise IntegrityError(f"{block} twice in the free queue")
            seen.add(block.block_id)
        if len(seen) != self.free_queue.num_free:
            raise IntegrityError("free-queue length counter is wrong")
        for block in self.blocks:
            if block.block_id not in seen and block.ref_cnt <= 0:
                raise IntegrityError(f"{block} is neither free nor referenced")
            if block.block_hash is not None and self.cached.get(block.block_hash) is not block:
                raise IntegrityError(f"{block} carries a hash the map does not point back to")
        for h, block in self.cached.items():
            if block.block_hash != h:
                raise IntegrityError(f"map entry {h.hex()[:8]} points at {block}")
