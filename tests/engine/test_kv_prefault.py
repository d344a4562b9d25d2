"""An idle engine commits its KV pool's pages ahead of use (``EngineCore.prefault_kv``).

The pool is an anonymous mmap whose pages are committed when first written; a step writing KV
into fresh pages paid a page fault each (docs/benchmarks.md, "The KV pool's pages committed
ahead of use"). These tests read the pool mapping's resident size from /proc/self/smaps.
"""

from __future__ import annotations

import errno
import time

import pytest
import torch

from shared.config import EngineArgs
from shared.engine import model_runner
from shared.engine.block_pool import BlockPool
from shared.engine.core import EngineCore
from shared.engine.sampling_params import SamplingParams
from shared.worker.engine_loop import EngineLoop


def resident_bytes(t: torch.Tensor) -> int:
    """Resident bytes of the mapping that holds ``t``'s first byte (/proc/self/smaps)."""
    addr = t.data_ptr()
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {addr:#x}")


def engine(monkeypatch, model, window_mib: int, **kw) -> EngineCore:
    monkeypatch.setenv("PDSERVE_KV_PREFAULT_MIB", str(window_mib))
    args = EngineArgs(model=str(model), device="cpu", kv_cache_memory="24MiB", **kw)
    return EngineCore(args)


def drain_prefault(e: EngineCore) -> int:
    n = 0
    while e.prefault_kv():
        n += 1
        assert n < 100_000, "prefault_kv never ran out of work"
    return n


def test_fresh_blocks_leave_the_pool_in_id_order_and_raise_its_high_water():
    pool = BlockPool(16, enable_caching=True)
    assert pool.high_water == 0
    first = pool.get_new_blocks(3)
    assert [b.block_id for b in first] == [0, 1, 2] and pool.high_water == 3
    pool.free_blocks(first)  # to the queue's tail: the never-used blocks go first
    assert [b.block_id for b in pool.get_new_blocks(5)] == [3, 4, 5, 6, 7]
    assert pool.high_water == 8
    rest = pool.get_new_blocks(pool.num_free_blocks)
    assert [b.block_id for b in rest] == [*range(8, 16), 0, 1, 2]
    assert pool.high_water == 16


def test_an_idle_engine_commits_the_window_past_the_blocks_handed_out(monkeypatch, tiny_llama):
    e = engine(monkeypatch, tiny_llama, window_mib=1, max_num_batched_tokens=64, max_num_seqs=8)
    kv = e.runner.kv_cache
    block_bytes = e.runner.block_bytes
    window = e._prefault_window
    assert window == -(-(1 << 20) // block_bytes)  # 1 MiB is more than 4 steps' blocks here
    assert window * 4 < e.num_blocks, "the test needs a pool well past the window"
    before = resident_bytes(kv)
    assert before < window * block_bytes / 2
    chunks = drain_prefault(e)
    assert chunks == -(-window // e._prefault_chunk)
    committed = resident_bytes(kv)
    assert committed >= window * block_bytes
    assert committed < 2 * window * block_bytes  # the window, not the pool
    assert not e.prefault_kv()  # nothing more until blocks are handed out

    # Blocks handed out move the window: the next idle turns commit past them.
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    e.add_request("a", list(range(3, 3 + 40 * e.block_size)), sp)
    while e.has_unfinished_requests():
        e.step()
    assert e.kv.pool.high_water >= 40
    assert drain_prefault(e) > 0
    assert resident_bytes(kv) >= (e.kv.pool.high_water + window) * block_bytes


def test_prefault_off_leaves_the_pool_uncommitted(monkeypatch, tiny_llama):
    e = engine(monkeypatch, tiny_llama, window_mib=0)
    assert not e.prefault_kv()
    assert resident_bytes(e.runner.kv_cache) < (1 << 20)


@pytest.mark.parametrize("madvise", ["populate", "fallback"])
def test_committing_pages_leaves_what_blocks_hold(monkeypatch, tiny_llama, madvise):
    e = engine(monkeypatch, tiny_llama, window_mib=1)
    if madvise == "fallback":  # a kernel without MADV_POPULATE_WRITE (before 5.14)
        monkeypatch.setattr(model_runner, "_madvise_ok", None)
        monkeypatch.setattr(model_runner, "_madvise_populate", lambda addr, n: errno.EINVAL)
    kv = e.runner.kv_cache
    g = torch.Generator().manual_seed(0)
    kv[:8] = torch.randn(kv[:8].shape, generator=g).to(kv.dtype)
    want = kv[:8].clone()
    e.runner.prefault_blocks(0, 40)  # blocks in use and fresh ones
    assert torch.equal(kv[:8], want)
    assert bool((kv[8:40] == 0).all())
    assert resident_bytes(kv) >= 40 * e.runner.block_bytes


def test_a_host_out_of_memory_turns_prefault_off(monkeypatch, tiny_llama, caplog):
    e = engine(monkeypatch, tiny_llama, window_mib=1)
    monkeypatch.setattr(model_runner, "_madvise_ok", True)
    monkeypatch.setattr(model_runner, "_madvise_populate", lambda addr, n: errno.ENOMEM)
    assert not e.prefault_kv()
    assert "not committed ahead of use" in caplog.text
    assert not e.prefault_kv()  # off: no second try, no second warning
    assert caplog.text.count("not committed ahead of use") == 1
    # the engine itself goes on: a request still runs
    e.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while e.has_unfinished_requests():
        e.step()


class PrefaultingEngine:
    """What EngineLoop calls of an idle engine, with ``chunks`` chunks of prefault work."""

    def __init__(self, chunks: int) -> None:
        self.left = chunks
        self.done = 0

    def check_alive(self) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return False

    def prefault_kv(self) -> bool:
        if self.left == 0:
            return False
        time.sleep(0.001)
        self.left -= 1
        self.done += 1
        return True


def test_the_engine_loop_prefaults_while_idle_and_runs_commands_between_chunks():
    fake = PrefaultingEngine(chunks=400)
    loop = EngineLoop(fake)  # type: ignore[arg-type]
    loop.start()
    try:
        deadline = time.monotonic() + 30
        while fake.done < 5:  # the loop is into its chunks
            assert time.monotonic() < deadline
            time.sleep(0.001)
        ran_at = loop.submit(lambda eng: eng.done).result(timeout=30)
        assert ran_at < 400, "the command waited for every chunk"
        while fake.left:  # then the loop finishes the work, and goes idle
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert loop.alive and loop.error is None
    finally:
        loop.stop()
    assert fake.done == 400
