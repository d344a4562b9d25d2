"""An idle engine commits its KV pool's pages ahead of use (``EngineCore.prefault_kv``).

The pool is an anonymous mmap whose pages are committed when first written; a step writing KV
into fresh pages paid a page fault each (docs/benchmarks.md, "The KV pool's pages committed
ahead of use"). These tests read the pool mapping's resident size from /proc/self/smaps.
"""

from __future__ import annotations

import errno
import threading
import time

import pytest
import torch

from shared.config import EngineArgs
from shared.engine import model_runner
from shared.engine.block_pool import BlockPool
from shared.engine.core import EngineCore
from shared.engine.sampling_params import SamplingParams
from shared.worker.engine_loop import EngineLoop


def mapping_bytes(t: torch.Tensor, field: str = "Rss:") -> int:
    """``field`` (bytes) of the mapping that holds ``t``'s first byte (/proc/self/smaps)."""
    addr = t.data_ptr()
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == field:
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {addr:#x}")


def resident_bytes(t: torch.Tensor) -> int:
    return mapping_bytes(t, "Rss:")


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "absent"
    return text.split("[")[1].split("]")[0]


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
    e = engine(monkeypatch, tiny_llama, window_mib=4, max_num_batched_tokens=64, max_num_seqs=8)
    kv = e.runner.kv_cache
    block_bytes = e.runner.block_bytes
    window = e._prefault_window
    assert window == -(-(4 << 20) // block_bytes)  # 4 MiB is more than 4 steps' blocks here
    assert window * 4 < e.num_blocks, "the test needs a pool well past the window"
    huge = 2 << 20  # a transparent huge page: what one chunk may commit beyond itself
    assert resident_bytes(kv) < window * block_bytes / 2
    chunks = drain_prefault(e)
    assert chunks == -(-window // e._prefault_chunk)
    committed = resident_bytes(kv)
    assert window * block_bytes <= committed <= window * block_bytes + huge  # not the pool
    assert not e.prefault_kv()  # nothing more until blocks are handed out

    def use(request_id: str, blocks: int, seed: int) -> None:
        sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        prompt = [3 + (seed * 131 + i) % 2000 for i in range(blocks * e.block_size)]
        e.add_request(request_id, prompt, sp)
        while e.has_unfinished_requests():
            e.step()

    # Blocks handed out move the window, but a refill waits until half of it is used ...
    use("a", window // 4, seed=1)
    assert e.kv.pool.high_water >= window // 4
    assert not e.prefault_kv()
    # ... and then commits the whole window past the mark, a chunk per idle turn.
    use("b", window // 2, seed=2)
    mark = e.kv.pool.high_water
    assert mark >= window * 3 // 4  # less than half the window left ahead
    assert drain_prefault(e) == -(-(mark + window - max(window, mark)) // e._prefault_chunk)
    assert resident_bytes(kv) >= (mark + window) * block_bytes


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="no transparent huge pages")
@pytest.mark.parametrize("hugepages", ["1", "0"])
def test_the_pool_is_on_huge_pages_unless_turned_off(monkeypatch, tiny_llama, hugepages):
    monkeypatch.setenv("PDSERVE_KV_HUGEPAGES", hugepages)
    e = engine(monkeypatch, tiny_llama, window_mib=4)
    drain_prefault(e)
    huge = mapping_bytes(e.runner.kv_cache, "AnonHugePages:")
    if hugepages == "1":
        assert huge >= 2 << 20, "the pool got no huge page"
    else:
        assert huge == 0 or thp_mode() == "always"


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

    def __init__(self, chunks: int, park_at: int = 0) -> None:
        self.left = chunks
        self.done = 0
        # after ``park_at`` chunks the loop waits for ``go``; ``parked`` tells the test
        self.park_at = park_at
        self.parked = threading.Event()
        self.go = threading.Event()

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
        if self.done == self.park_at:
            self.parked.set()
            self.go.wait(30)
        return True


def test_the_engine_loop_prefaults_while_idle_and_runs_commands_between_chunks():
    fake = PrefaultingEngine(chunks=400, park_at=5)
    loop = EngineLoop(fake)  # type: ignore[arg-type]
    loop.start()
    try:
        deadline = time.monotonic() + 30
        assert fake.parked.wait(30)  # the loop is into its chunks, held inside the fifth
        ran = loop.submit(lambda eng: eng.done)  # queued with 395 chunks still to do
        fake.go.set()
        ran_at = ran.result(timeout=30)
        assert ran_at < 400, "the command waited for every chunk"
        while fake.left:  # then the loop finishes the work, and goes idle
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert loop.alive and loop.error is None
    finally:
        loop.stop()
    assert fake.done == 400
