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

For a tensor larger than a slot the methods return ``None`` and the caller (``Shard``) uses the
group's own collective (same results up to summation order, which is then gloo's). The segment is unlinked by the rank that created it as soon as
every rank has opened it, so nothing is left in ``/dev/shm`` whatever happens later; a start
that fails in between unlinks it too (only a rank 0 killed in that window leaves one, and the
next start on its port removes it: shared/engine/distributed.py::remove_segments). Its pages
are reserved when it is created (``posix_fallocate``): a ``/dev/shm`` too small for it (Docker's
64 MiB default) fails the start with the size it needs, instead of a SIGBUS at the first large
collective.
"""

from __future__ import annotations

import errno
import mmap
import os
import platform
import time
from typing import Any

import numpy as np
import torch

from shared.config import ConfigError, env_float

HEADER = 64  # bytes per rank counter (one cache line: no false sharing)
SLOT_BYTES = int(env_float("PDSERVE_SHM_SLOT_MB", 8, minimum=0.0625) * (1 << 20))
WAIT_TIMEOUT_S = env_float("PDSERVE_SHM_TIMEOUT_S", 60, minimum=0.001)


class CommTimeoutError(RuntimeError):
    """A TP peer did not reach the collective in time."""


class PeerDiedError(RuntimeError):
    """A rank this one waits for in shared memory has exited."""


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not published yet
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not reaped) is gone too
            return f.read().rsplit(") ", 1)[1][:1] != "Z"
    except OSError:
        return True


def _check_peers(counters: np.ndarray, seq: int) -> None:
    """Raise PeerDiedError if a rank that has not reached ``seq`` (column 0 of its header
    row) has exited (its pid is in column 1)."""
    for r in range(counters.shape[0]):
        if counters[r, 0] < seq and not pid_alive(int(counters[r, 1])):
            raise PeerDiedError(f"rank process {int(counters[r, 1])} exited")


def shm_supported() -> bool:
    """Ordered stores/loads are assumed (x86-64); elsewhere use gloo."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


def _reserve(fd: int, path: str, size: int) -> None:
    """Size the new segment ``fd`` with its pages reserved (a sparse file on a full tmpfs
    faults with SIGBUS when a page is first written), or raise a ConfigError that says what
    is missing."""
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            os.ftruncate(fd, size)  # a filesystem without fallocate: sparse, as before
            return
        try:
            st = os.statvfs(os.path.dirname(path))
            free = f"{st.f_bavail * st.f_frsize / (1 << 20):.0f} MiB free of " + (
                f"{st.f_blocks * st.f_frsize / (1 << 20):.0f} MiB"
            )
        except OSError:
            free = "its free space unknown"
        raise ConfigError(
            f"{os.path.dirname(path)} has no room for the {size / (1 << 20):.0f} MiB "
            f"shared-memory segment {os.path.basename(path)} of this worker's TP/PP ranks "
            f"({free}; {e.strerror}): give the container a larger /dev/shm (docker run "
            "--shm-size, compose shm_size, a Kubernetes emptyDir with medium Memory), "
            "lower PDSERVE_SHM_SLOT_MB / PDSERVE_SHM_CONTROL_MB, or set PDSERVE_SHM_COMM=0 "
            "(gloo over loopback, slower)"
        ) from None


class _Segment:
    """A named shared-memory file in /dev/shm, mapped; the name goes once every rank has it
    open (``unlink``), the mapping with the process. (Not ``multiprocessing.shared_memory``:
    its ``__del__`` fails at exit while tensors still view the buffer, and it starts a
    resource-tracker process per rank.)"""

    def __init__(self, name: str, size: int, create: bool) -> None:
        self.path = f"/dev/shm/{name}"
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                _reserve(fd, self.path, size)
            self.buf = mmap.mmap(fd, size)
        except BaseException:
            if create:
                self.unlink()
            raise
        finally:
            os.close(fd)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _open_segment(name: str, size: int, rank: int, group: Any) -> _Segment:
    """Rank 0 creates, the others open, then the name is removed (two barriers on group).
    A start that fails in between (a rank that never opens it) removes it as well."""
    import torch.distributed as dist

    seg = _Segment(name, size, create=True) if rank == 0 else None
    try:
        dist.barrier(group=group)
        if seg is None:
            seg = _Segment(name, size, create=False)
        dist.barrier(group=group)
    except BaseException:
        if rank == 0 and seg is not None:
            seg.unlink()
        raise
    if rank == 0:
        seg.unlink()
    return seg


class ShmComm:
    """One stage's TP group on one node. Build it on every rank of the group at the same
    time (it uses ``group`` for the rendezvous and for tensors larger than a slot)."""

    def __init__(self, name: str, rank: int, size: int, group: Any) -> None:
        self.rank, self.size, self.group = rank, size, group
        total = size * HEADER + 2 * size * SLOT_BYTES
        self._seg = _open_segment(name, total, rank, group)
        buf = self._seg.buf
        self._counters = np.ndarray((size, HEADER // 8), dtype=np.int64, buffer=buf)
        self._counters[rank, 1] = os.getpid()
        self._data = torch.frombuffer(buf, dtype=torch.uint8, offset=size * HEADER)
        self._data = self._data.view(2, size, SLOT_BYTES)
        self._seq = 0

    def _publish_and_wait(self, seq: int) -> None:
        counters = self._counters
        counters[self.rank, 0] = seq
        spins = 0
        deadline = None
        checked = 0.0
        while True:
            if int(counters[:, 0].min()) >= seq:
                return
            spins += 1
            if spins > 200:
                now = time.monotonic()
                if now - checked > 0.05:
                    _check_peers(counters, seq)
                    checked = now
                if deadline is None:
                    deadline = now + WAIT_TIMEOUT_S
                elif now > deadline:
                    raise CommTimeoutError(
                        f"TP peer missed collective {seq} for {WAIT_TIMEOUT_S:.0f} s: "
                        f"counters {counters[:, 0].tolist()}"
                    )
                os.sched_yield()

    def _slots(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's copy of ``x`` for this collective (``None`` when ``x`` does not fit a
        slot: the caller uses its group's own collective)."""
        nbytes = x.numel() * x.element_size()
        if nbytes > SLOT_BYTES or not x.is_contiguous():
            return None
        self._seq += 1
        parity = self._data[self._seq % 2]
        parity[self.rank, :nbytes].view(x.dtype).view(x.shape).copy_(x)
        self._publish_and_wait(self._seq)
        return [parity[r, :nbytes].view(x.dtype).view(x.shape) for r in range(self.size)]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor | None:
        """Sum ``x`` over the group into ``x`` (rank order: the same bits on every rank), or
        ``None`` (``x`` unchanged) when it does not fit a slot."""
        slots = self._slots(x)
        if slots is None:
            return None
        torch.add(slots[0], slots[1], out=x)
        for s in slots[2:]:
            x += s
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` concatenated along the last dimension in rank order, or
        ``None`` when it does not fit a slot."""
        slots = self._slots(x.contiguous())
        if slots is None:
            return None
        return torch.cat(slots, dim=-1)  # a copy: the slots are reused two collectives on


CONTROL_BYTES = int(env_float("PDSERVE_SHM_CONTROL_MB", 16, minimum=0.0625) * (1 << 20))
IDLE_SLEEP_S = 0.0005  # a waiting rank's nap once no message came for BUSY_WAIT_S
BUSY_WAIT_S = 0.02


class ShmBroadcast:
    """Rank 0's control messages to the other ranks of its node through shared memory (the
    step's plain data, pickled), instead of gloo's two loopback broadcasts per message.

    One buffer: message ``k`` is written only after every reader acknowledged ``k - 1`` (a
    reader acknowledges as soon as it has unpickled its copy), then its sequence number is
    published. A reader spins, then yields the core for up to ``BUSY_WAIT_S`` (the gap between
    two steps), then naps ``IDLE_SLEEP_S`` at a time: an idle worker costs its ranks a wake-up
    per half millisecond, not a core. A message larger than the
    buffer is announced with length -1 and goes through ``group`` (gloo) instead.
    ``alive`` (rank 0) is called while it waits for a slow reader, so a dead rank raises
    instead of hanging the writer."""

    def __init__(self, name: str, rank: int, size: int, group: Any) -> None:
        self.rank, self.size, self.group = rank, size, group
        header = HEADER * (size + 1)
        # row 0: (sequence number, length, writer pid); row r: reader r's acknowledged
        # sequence number and pid
        self._seg = _open_segment(name, header + CONTROL_BYTES, rank, group)
        buf = self._seg.buf
        self._head = np.ndarray((size + 1, HEADER // 8), dtype=np.int64, buffer=buf)
        if rank == 0:
            self._head[0, 2] = os.getpid()
        else:
            self._head[rank, 1] = os.getpid()
        self._data = memoryview(buf)[header:]
        self._seq = 0

    def send(self, msg: object, alive: Any = None, timeout_s: float = WAIT_TIMEOUT_S) -> None:
        """Publish ``msg`` once every reader took the last one (waiting at most ``timeout_s``
        for that: :class:`CommTimeoutError`)."""
        import pickle

        payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        seq, head = self._seq + 1, self._head
        spins, start = 0, time.monotonic()
        last_check = start
        while int(head[1 : self.size, 0].min()) < seq - 1:  # a reader is on the last message
            spins += 1
            if spins > 200:
                now = time.monotonic()
                if now - last_check > 0.05:
                    if alive is not None:
                        alive()
                    _check_peers(head[1 : self.size], seq - 1)
                    last_check = now
                if now - start > timeout_s:
                    raise CommTimeoutError(
                        f"a rank has not taken control message {seq - 1} for "
                        f"{timeout_s:g} s: {head[1 : self.size, 0].tolist()}"
                    )
                time.sleep(IDLE_SLEEP_S)
        big = len(payload) > CONTROL_BYTES
        if not big:
            self._data[: len(payload)] = payload
        head[0, 1] = -1 if big else len(payload)
        head[0, 0] = seq
        self._seq = seq
        if big:  # every reader is on its way to the same broadcast (bounded on this side)
            from shared.engine.distributed import broadcast_object

            broadcast_object(msg, self.group, 0, timeout_s)

    def recv(self) -> object:
        """The next message; waits as long as rank 0 sends none (the worker is idle)."""
        import pickle

        self._seq += 1
        seq, head = self._seq, self._head
        spins, start = 0, 0.0
        while int(head[0, 0]) < seq:
            spins += 1
            if spins < 200:
                continue
            if spins == 200:
                start = time.monotonic()
            if time.monotonic() - start < BUSY_WAIT_S:  # between steps: yield, stay awake
                os.sched_yield()
            else:  # idle: nap
                time.sleep(IDLE_SLEEP_S)
        n = int(head[0, 1])
        if n < 0:
            from shared.engine.distributed import broadcast_object

            head[self.rank, 0] = seq
            return broadcast_object(None, self.group, self.rank, None)
        msg = pickle.loads(bytes(self._data[:n]))
        head[self.rank, 0] = seq
        return msg
