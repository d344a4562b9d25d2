"""All-reduce and all-gather through shared memory for the TP ranks of one CPU node.

gloo moves every collective over loopback TCP: on the 2-core CI machine a 1 KiB all-reduce
between two processes costs about a millisecond (``bench/gloo_latency.py``), and a TP decode
step makes two per layer. Ranks on one host can instead meet in one shared-memory segment, as
vLLM's CPU backend does (its C++ ``shm_allreduce``). Here:

* the segment holds, for each rank, a sequence counter and two data slots (double buffered);
* collective number ``k`` of a rank: copy its tensor into its slot ``k % 2``, publish ``k`` in
  its counter, wait until every rank's counter reached ``k``, then read every rank's slot in
  rank order (so every rank computes bitwise the same sum). A rank writes slot ``k % 2`` again
  only at collective ``k + 2``, which it reaches after every rank published ``k + 1``, i.e.
  after every rank finished reading collective ``k``: no second barrier is needed;
* x86-64 keeps stores in order and loads in order, so a counter seen is data seen;
* waiting spins briefly, then yields the core (the ranks share it with the router and the
  clients on small machines), and gives up after a bound, raising :class:`CommTimeoutError`
  (a peer stuck or gone; rank 0's process watch normally notices first).

Tensors larger than a slot go through the gloo group instead (same results up to summation
order, which is then gloo's). The segment is unlinked by the rank that created it as soon as
every rank has opened it, so nothing is left in ``/dev/shm`` whatever happens later.
"""

from __future__ import annotations

import os
import platform
import time
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import torch

HEADER = 64  # bytes per rank counter (one cache line: no false sharing)
SLOT_BYTES = int(float(os.environ.get("PDSERVE_SHM_SLOT_MB", "8")) * (1 << 20))
WAIT_TIMEOUT_S = float(os.environ.get("PDSERVE_SHM_TIMEOUT_S", "60"))


class CommTimeoutError(RuntimeError):
    """A TP peer did not reach the collective in time."""


def shm_supported() -> bool:
    """Ordered stores/loads are assumed (x86-64); elsewhere use gloo."""
    return platform.machine().lower() in ("x86_64", "amd64")


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """An opener is not the owner: keep Python's resource tracker from unlinking (and warning
    about) the creator's segment when this process exits (Python < 3.13 tracks openers too)."""
    try:
        from multiprocessing import resource_tracker

        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - only a warning at exit is at stake
        pass


class ShmComm:
    """One stage's TP group on one node. Build it on every rank of the group at the same
    time (it uses ``group`` for the rendezvous and for tensors larger than a slot)."""

    def __init__(self, name: str, rank: int, size: int, group: Any) -> None:
        import torch.distributed as dist

        self.rank, self.size, self.group = rank, size, group
        total = size * HEADER + 2 * size * SLOT_BYTES
        if rank == 0:
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=total)
        dist.barrier(group=group)
        if rank != 0:
            self._shm = shared_memory.SharedMemory(name=name)
            _untrack(self._shm)
        dist.barrier(group=group)
        if rank == 0:
            self._shm.unlink()  # every rank has it open: the mapping outlives the name
        buf = self._shm.buf
        self._counters = np.ndarray((size, HEADER // 8), dtype=np.int64, buffer=buf)
        self._data = torch.frombuffer(buf, dtype=torch.uint8, offset=size * HEADER)
        self._data = self._data.view(2, size, SLOT_BYTES)
        self._seq = 0

    def _publish_and_wait(self, seq: int) -> None:
        counters = self._counters
        counters[self.rank, 0] = seq
        spins = 0
        deadline = None
        while True:
            if int(counters[:, 0].min()) >= seq:
                return
            spins += 1
            if spins > 200:
                if deadline is None:
                    deadline = time.monotonic() + WAIT_TIMEOUT_S
                elif time.monotonic() > deadline:
                    raise CommTimeoutError(
                        f"TP peer missed collective {seq} for {WAIT_TIMEOUT_S:.0f} s: "
                        f"counters {counters[:, 0].tolist()}"
                    )
                os.sched_yield()

    def _slots(self, x: torch.Tensor) -> tuple[list[torch.Tensor], int] | None:
        nbytes = x.numel() * x.element_size()
        if nbytes > SLOT_BYTES or not x.is_contiguous():
            return None
        self._seq += 1
        seq = self._seq
        parity = self._data[seq % 2]
        mine = parity[self.rank, :nbytes].view(x.dtype).view(x.shape)
        mine.copy_(x)
        self._publish_and_wait(seq)
        return [parity[r, :nbytes].view(x.dtype).view(x.shape) for r in range(self.size)], seq

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place (rank order: the same bits on every rank)."""
        got = self._slots(x)
        if got is None:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
            return x
        slots, _ = got
        torch.add(slots[0], slots[1], out=x)
        for s in slots[2:]:
            x += s
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension, in rank order."""
        x = x.contiguous()
        got = self._slots(x)
        if got is None:
            import torch.distributed as dist

            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
            return torch.cat(parts, dim=-1)
        slots, _ = got
        return torch.cat(slots, dim=-1)  # a copy: the slots are reused two collectives on

    def close(self) -> None:
        self._counters = None  # type: ignore[assignment]
        self._data = None  # type: ignore[assignment]
        try:
            self._shm.close()
        except BufferError:
            pass  # a view still alive: the mapping goes with the process
