"""Per-request block tables on top of the block pool, plus the host swap pool and pins.

The KV-cache manager alone writes block tables. "No room" is a ``None`` return, never an
exception: the scheduler then preempts or waits.

A *pin* is one reference on a set of blocks held on behalf of a KV transfer, independent of
any block table: a block handed to a transfer (P sending from it, D receiving into it) keeps a
reference until the transfer reached a terminal state and its owner called :meth:`unpin`, so
neither abort, preemption, swap-out nor finishing can put it back into the free queue while
bytes may still be read from or written to it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from shared.engine.block_pool import BlockPool, IntegrityError, KVCacheBlock
from shared.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool, num_host_blocks: int = 0
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks already given their hash
        self.num_host_blocks = num_host_blocks
        self.free_host_blocks: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.swapped: dict[str, list[int]] = {}  # request id -> host block ids
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found
        self.pins: dict[int, list[KVCacheBlock]] = {}
        self._next_pin = 1

    # ---- queries -----------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def num_blocks_of(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ()))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of ``request`` in full blocks, and its length in tokens.

        At least one token is always left to compute (its logits are needed), so a fully
        cached prompt reuses all but its last block. Changes nothing (not the hit-rate stats:
        a request waiting for room looks again every step; see :meth:`record_lookup`).
        Does not take references: pass the blocks to ``allocate_slots``.
        """
        if not self._looks_up(request):
            return [], 0  # prompt logprobs need every prompt position's logits
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _looks_up(self, request: Request) -> bool:
        return self.enable_caching and not request.wants_prompt_logprobs

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count ``request``'s prefix lookup in the hit-rate stats: once per request, at its
        first admission, with the ``num_hit_tokens`` it was admitted with (vLLM's rule), not
        at every look. A re-admission after a preemption (a recompute) is not counted, as in
        vLLM's ``prefix_cache_queries`` / ``hits``: it would count the prompt again, and hit
        on the blocks the request itself had computed."""
        if request.num_preemptions == 0 and self._looks_up(request):
            self.prefix_queries += request.num_tokens
            self.prefix_hits += num_hit_tokens

    # ---- allocation --------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        cache: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of KV after the computed ones.

        ``new_computed_blocks`` (prefix-cache hits from ``get_computed_blocks``) are appended
        to the table first. Returns the newly allocated blocks, or ``None`` (nothing changed)
        when the pool lacks room. With ``cache``, blocks that will be full once this step's
        tokens are computed get their hash (so later requests can share them).
        """
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(new_computed_blocks))
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - revived:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        if cache:
            self.cache_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash every full block of ``request`` whose tokens (up to ``num_tokens``) are known."""
        if not self.enable_caching:
            return
        rid = request.request_id
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        blocks = self.req_blocks[rid]
        self.pool.cache_blocks(blocks[start:num_full], request.block_hashes[start:num_full])
        self.num_cached_blocks[rid] = num_full

    def trim(self, request: Request, num_tokens: int) -> int:
        """Give back the blocks past the first ``cdiv(num_tokens, block_size)`` (those only
        rejected speculative drafts needed), tail first; returns how many. They were never
        hashed: only blocks of known tokens are."""
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return 0
        keep = cdiv(num_tokens, self.block_size)
        extra = blocks[keep:]
        if not extra:
            return 0
        if self.num_cached_blocks.get(request.request_id, 0) > keep:
            raise IntegrityError(f"trimming a hashed block of {request.request_id}")
        del blocks[keep:]
        self.pool.free_blocks(reversed(extra))
        return len(extra)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so its last blocks are evicted first."""
        blocks = self.req_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))
        host = self.swapped.pop(request.request_id, None)
        if host:
            self.free_host_blocks.extend(host)

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int]] | None:
        """Share ``parent``'s computed prompt blocks with ``child`` (n > 1).

        Full blocks are shared by reference; the partially filled last block, which both will
        write next, is copied (copy-on-write done eagerly at fork). Returns the ``(src, dst)``
        block copies to run before the next forward pass, or ``None`` when no block is free.
        The child's table then holds the parent's ``num_computed_tokens`` tokens of KV (the
        scheduler records that on the child).
        """
        parent_blocks = self.req_blocks[parent.request_id]
        num_tokens = parent.num_computed_tokens
        num_full = num_tokens // self.block_size
        partial = num_tokens % self.block_size != 0
        if partial and self.pool.num_free_blocks < 1:
            return None
        shared = parent_blocks[:num_full]
        self.pool.touch(shared)
        blocks = list(shared)
        copies: list[tuple[int, int]] = []
        if partial:
            (new,) = self.pool.get_new_blocks(1)
            copies.append((parent_blocks[num_full].block_id, new.block_id))
            blocks.append(new)
        self.req_blocks[child.request_id] = blocks
        self.num_cached_blocks[child.request_id] = min(
            self.num_cached_blocks.get(parent.request_id, 0), num_full
        )
        return copies

    # ---- pins --------------------------------------------------------------------------
    def pin(self, block_ids: Sequence[int], pin_id: int | None = None) -> int:
        """Take one reference on each of ``block_ids`` (blocks in use) for a transfer.

        With ``pin_id`` (still held) the blocks join that pin; otherwise a new pin is made.
        Returns the pin id; :meth:`unpin` drops every reference it holds. Raises
        ``IntegrityError`` (nothing changed) for a block that is free: a transfer may only
        touch blocks some request holds.
        """
        blocks = [self.pool.blocks[b] for b in block_ids]
        for b in blocks:
            if b.ref_cnt <= 0:
                raise IntegrityError(f"pinning {b}, which no request holds")
        held = self.pins.get(pin_id) if pin_id is not None else None
        if held is None:
            pin_id = self._next_pin
            self._next_pin += 1
            held = self.pins[pin_id] = []
        self.pool.touch(blocks)
        held.extend(blocks)
        assert pin_id is not None  # held is None whenever pin_id is
        return pin_id

    def unpin(self, pin_id: int) -> bool:
        """Drop the pin's references (blocks no table holds then join the free queue).
        Returns False for an unknown (or already dropped) pin."""
        blocks = self.pins.pop(pin_id, None)
        if blocks is None:
            return False
        self.pool.free_blocks(reversed(blocks))
        return True

    @property
    def num_pinned_blocks(self) -> int:
        # tuple(): one atomic copy; the metrics and lease threads read this (EngineCore.stats)
        # while the engine thread pins and unpins ("dictionary changed size during iteration")
        return sum(map(len, tuple(self.pins.values())))

    # ---- swap --------------------------------------------------------------------------
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the host pool: ``(device, host)`` copies, or ``None``
        when the host pool lacks room (the caller then preempts by recompute)."""
        blocks = self.req_blocks.get(request.request_id, [])
        if len(blocks) > len(self.free_host_blocks) or not blocks:
            return None
        host = [self.free_host_blocks.pop() for _ in blocks]
        self.swapped[request.request_id] = host
        pairs = [(b.block_id, h) for b, h in zip(blocks, host)]
        del self.req_blocks[request.request_id]
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))
        return pairs

    def can_swap_in(self, request: Request, extra_blocks: int) -> bool:
        return len(self.swapped[request.request_id]) + extra_blocks <= self.pool.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped request back: ``(host, device)`` copies. Check ``can_swap_in``."""
        host = self.swapped.pop(request.request_id)
        blocks = self.pool.get_new_blocks(len(host))
        self.req_blocks[request.request_id] = blocks
        self.free_host_blocks.extend(host)
        return [(h, b.block_id) for h, b in zip(host, blocks)]

    # ---- integrity ---------------------------------------------------------------------
    def check_integrity(self, live_requests: Iterable[str] | None = None) -> None:
        """Pool invariants plus: each block's ref count equals the number of block tables and
        pins holding it; only ``live_requests`` own tables (when given); host blocks balance."""
        self.pool.check_integrity()
        live = None if live_requests is None else set(live_requests)
        refs: dict[int, int] = {}
        for rid, blocks in self.req_blocks.items():
            if live is not None and rid not in live:
                raise IntegrityError(f"request {rid} holds blocks but is not live")
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for blocks in self.pins.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            if block.ref_cnt != refs.get(block.block_id, 0):
                raise IntegrityError(
                    f"{block} has ref_cnt {block.ref_cnt} but {refs.get(block.block_id, 0)} "
                    "tables and pins hold it"
                )
        n_host = len(self.free_host_blocks) + sum(len(v) for v in self.swapped.values())
        if n_host != self.num_host_blocks:
            raise IntegrityError(f"host blocks leak: {n_host} accounted of {self.num_host_blocks}")
