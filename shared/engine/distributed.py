"""The multi-process executor: one worker = ``TP x PP`` ranks on ``torch.distributed``.

Rank 0 is the process that serves (scheduler, gRPC, KV transfer); it starts the other ranks of
its node (``--distributed-executor-backend mp``, as vLLM's ``MultiprocExecutor``; each a
:class:`RankProcess`) and every rank joins one process group (gloo on CPU; NCCL for the
tensors on CUDA, with a gloo group for the control messages). On one CPU node the TP
collectives and the control messages go through shared memory (shared/engine/shm_comm.py). Ranks on other nodes are started
by ``pdserve <role> --nnodes N --node-rank k ...`` there (:func:`run_follower_node`).

Each step rank 0 broadcasts one control message of plain data (the packed chunks' block
tables, positions and tokens, the block moves; never a ``Request``), then every rank runs the
same forward pass over its share of the model; only rank 0 samples. Messages:

* ``("alloc", num_blocks, num_host_blocks)``: size the KV pool (the same block count on every
  rank; each rank's blocks hold its layers and KV heads only), then a barrier on the control
  group: start-up ends once every rank has loaded its share;
* ``("step", moves, chunks, logit_rows, greedy)``: one forward pass (:meth:`ModelRunner.run_step`;
  ``greedy`` too, so every rank of the last stage takes the same path through the LM head);
* ``("export", block_ids)`` / ``("import", block_ids)``: gather the blocks' shards into rank
  0's canonical transfer pool / scatter them from it (KV transfer across layouts);
* ``("stop",)``.

Failure rules: a rank that exits is seen by rank 0's process watch (:meth:`check_alive`, each
engine-loop turn) or by the next collective failing, either way the engine loop dies and the
worker turns NOT_SERVING and exits (its supervisor restarts it); a rank whose rank 0 is gone
exits within a second (parent watch) or at its next collective. A rank that is stuck (stopped,
a hung kernel) fails the busy path's wait on it after ``PDSERVE_DIST_TIMEOUT_S`` (default the
shared-memory bound ``PDSERVE_SHM_TIMEOUT_S``, 60 s) with :class:`CommTimeoutError`, the same
error as shared memory's: every wait of a step (a TP all-reduce on gloo, the pipeline's
hand-offs, rank 0's wait for the last stage's logits, the KV gather/scatter, rank 0's control
broadcast) is bounded so. Only a follower's wait for its next control message (the worker is
idle) has no useful bound (gloo's is a week). Start-up is bounded by
``PDSERVE_DIST_INIT_TIMEOUT_S`` (600 s): every rank joining, the groups, the shared-memory
segments, and every rank having loaded its share of the model (the barrier after ``alloc``);
rank 0 watches this node's rank processes meanwhile, so one that exits fails the start at once,
and a rank started with another layout (world size, TP, PP, nodes) is refused by name.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import re
import secrets
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shared.config import (
    CacheConfig,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    env_float,
)
from shared.engine.shm_comm import WAIT_TIMEOUT_S, CommTimeoutError, pid_alive

__all__ = ["CommTimeoutError", "RankDiedError"]  # the errors a lost or stuck rank raises

logger = logging.getLogger(__name__)

#: Bound on one wait of the busy path (a step's collective, a pipeline hand-off, rank 0's wait
#: for the logits, its control broadcast, the KV gather/scatter): a peer that does not answer
#: in this long is stuck, and the wait raises :class:`CommTimeoutError`. The shared-memory
#: path's bound (``PDSERVE_SHM_TIMEOUT_S``, 60 s) unless set.
COLLECTIVE_TIMEOUT_S = env_float("PDSERVE_DIST_TIMEOUT_S", WAIT_TIMEOUT_S, minimum=0.001)
#: Bound on start-up: every rank joining, the groups, the segments, every rank's model loaded.
INIT_TIMEOUT_S = env_float("PDSERVE_DIST_INIT_TIMEOUT_S", 600, minimum=0.001)
#: gloo's timeout for a follower's wait on the control group: it waits there as long as the
#: worker is idle (a rank 0 that is gone is seen by the parent watch or a closed connection).
IDLE_TIMEOUT_S = 7 * 24 * 3600

# rendezvous keys (rank 0's TCPStore)
_LAYOUT_KEY = "pdserve/layout"  # rank 0's layout: every rank compares its own
_PREFIX_KEY = "pdserve/shm"  # this start's shared-memory segment names' prefix
_MISMATCH_KEY = "pdserve/mismatch"  # a rank whose layout differs says so here


def _joined_key(rank: int) -> str:
    return f"pdserve/joined/{rank}"


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank of a worker builds its ModelRunner from (pickled to each rank)."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: str
    attention_backend: str | None
    seed: int | None
    parallel: ParallelConfig


# How long start-up waits, after a peer's connection closed, for a rank process of this node
# to show as exited (it closes its sockets a moment before its exit status exists).
EXIT_GRACE_S = 2.0


class RankDiedError(RuntimeError):
    """A rank process of this worker exited; the worker cannot step any more."""


def _layout(pc: ParallelConfig) -> str:
    return (
        f"world size {pc.world_size} (TP {pc.tensor_parallel_size} x PP "
        f"{pc.pipeline_parallel_size}) over {pc.nnodes} node(s)"
    )


def comm_error(e: BaseException, what: str, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> Exception:
    """The named error for a failed gloo wait ``e``: :class:`CommTimeoutError` for a timeout
    (a peer stuck), :class:`RankDiedError` for a connection a peer closed (it exited); ``e``
    itself for anything else."""
    text = str(e)
    first = (text.strip().splitlines() or [""])[0][:300]
    low = text.lower()
    if "timed out" in low or "timeout" in low:
        return CommTimeoutError(
            f"{what}: a peer rank did not answer within {timeout_s:g} s (PDSERVE_DIST_TIMEOUT_S; "
            f"a rank is stuck): {first}"
        )
    if "closed" in low or "reset" in low or "broken pipe" in low or "connection" in low:
        return RankDiedError(f"{what}: a peer rank's connection closed (it exited): {first}")
    return e if isinstance(e, Exception) else RuntimeError(text)


def wait_work(work: Any, what: str, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    """Wait for gloo async ``work`` (a collective, an isend/irecv) for at most ``timeout_s``;
    a timeout raises :class:`CommTimeoutError`, a peer that exited :class:`RankDiedError`."""
    try:
        work.wait(timeout=_td(timeout_s))
    except RuntimeError as e:
        raise comm_error(e, what, timeout_s) from e


def run_collective(op: Any, what: str, device_type: str) -> None:
    """Run the collective ``op(async_op)``: on CPU (gloo) asynchronously and waited with
    :func:`wait_work`'s bound (a stuck rank raises :class:`CommTimeoutError`); on CUDA as NCCL
    runs it (stream-ordered; its watchdog holds the group's timeout)."""
    if device_type == "cpu":
        wait_work(op(True), what)
    else:
        op(False)


def _wait_watched(work: Any, what: str, alive: Any, timeout_s: float) -> None:
    """As :func:`wait_work` for a collective, calling ``alive()`` (which raises when a rank
    process exited) while it waits: start-up's waits, which may be long."""
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        alive()
        if time.monotonic() > deadline:
            raise CommTimeoutError(
                f"{what}: not every rank was there within {timeout_s:g} s "
                f"(PDSERVE_DIST_INIT_TIMEOUT_S)"
            )
        time.sleep(0.02)
    wait_work(work, what, timeout_s)


def broadcast_object(
    obj: Any, group: Any, rank: int, timeout_s: float | None, alive: Any = None
) -> Any:
    """Rank 0's ``obj`` on every rank of ``group`` (gloo: its length, then its pickle). Rank 0
    passes ``timeout_s`` (its wait is bounded; with ``alive``, called while it waits, as
    start-up's waits are); a follower ``None``: it waits as long as the group's timeout (the
    control group's: idle)."""
    if rank == 0:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(payload)], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    what = "control message broadcast"

    def wait(work: Any) -> None:
        if timeout_s is None:
            work.wait()
        elif alive is not None:
            _wait_watched(work, what, alive, timeout_s)
        else:
            wait_work(work, what, timeout_s)

    try:
        wait(dist.broadcast(size, src=0, group=group, async_op=True))
        if rank == 0:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        wait(dist.broadcast(data, src=0, group=group, async_op=True))
    except (CommTimeoutError, RankDiedError):
        raise
    except RuntimeError as e:
        raise comm_error(e, what, timeout_s or IDLE_TIMEOUT_S) from e
    return obj if rank == 0 else pickle.loads(data.numpy().tobytes())


def _start_groups(
    pc: ParallelConfig, rank: int, device_type: str, store: Any, prefix: str
) -> tuple[Any, list[Any], Any, Any]:
    """Every rank, once all joined: the process group, the control group (gloo, idle timeout),
    the stages' TP groups and this rank's shared-memory channels (segment names from
    ``prefix``). Returns (control group, stage groups, TP comm, control channel)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    # the other ranks' tcp:// rendezvous prefixed its keys with "default_pg": so does this one
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=pc.world_size,
        timeout=_td(INIT_TIMEOUT_S),
        store=dist.PrefixStore("default_pg", store),
    )
    # the followers wait here between messages for as long as the worker is idle
    control = dist.new_group(backend="gloo", timeout=_td(IDLE_TIMEOUT_S))
    groups = stage_groups(pc)
    comm = stage_comm(pc, rank, device_type, groups, prefix)
    channel = control_channel(pc, rank, control, prefix)
    return control, groups, comm, channel


def arm_busy_timeouts(rank: int, pc: ParallelConfig, control: Any, groups: list[Any]) -> None:
    """Once every rank is loaded (the barrier after ``alloc``): gloo's own timeout of this
    rank's data-path groups (the world: pipeline hand-offs, KV gather/scatter; its stage's TP
    group) becomes ``COLLECTIVE_TIMEOUT_S``, and on rank 0 the control group's too (rank 0
    never waits there idle). A follower's control group keeps the idle timeout. gloo closes the
    connection a wait timed out on, so the peer's wait fails as well."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    busy = _td(COLLECTIVE_TIMEOUT_S)
    mine = [dist.group.WORLD]
    stage = groups[rank // pc.tensor_parallel_size] if groups else None
    if stage is not None and stage is not dist.group.WORLD:
        mine.append(stage)
    if rank == 0:
        mine.append(control)
    for g in mine:
        _set_pg_timeout(busy, g)


def stage_groups(pc: ParallelConfig) -> list[Any]:
    """Every stage's TP group (``new_group`` is collective: every rank builds all of them)."""
    tp = pc.tensor_parallel_size
    if tp == 1:
        return [None] * pc.pipeline_parallel_size
    if pc.pipeline_parallel_size == 1:
        return [dist.group.WORLD]
    return [
        dist.new_group(list(range(s * tp, (s + 1) * tp)), timeout=_td(INIT_TIMEOUT_S))
        for s in range(pc.pipeline_parallel_size)
    ]


def _shm_enabled(pc: ParallelConfig) -> bool:
    """Every rank on this node, a platform shm_comm supports, not turned off
    (``PDSERVE_SHM_COMM=0``)."""
    from shared.engine.shm_comm import shm_supported

    return pc.nnodes == 1 and shm_supported() and os.environ.get("PDSERVE_SHM_COMM", "1") != "0"


def control_channel(pc: ParallelConfig, rank: int, control: Any, prefix: str) -> Any:
    """Shared-memory control messages (shared/engine/shm_comm.py::ShmBroadcast) when
    ``_shm_enabled``; ``None``: gloo broadcasts."""
    from shared.engine.shm_comm import ShmBroadcast

    if not _shm_enabled(pc):
        return None
    return ShmBroadcast(f"{prefix}-ctl", rank, pc.world_size, control)


def stage_comm(
    pc: ParallelConfig, rank: int, device_type: str, groups: list[Any], prefix: str
) -> Any:
    """This rank's shared-memory TP collectives (shared/engine/shm_comm.py) for a CPU stage
    when ``_shm_enabled``; ``None``: the group's own backend."""
    from shared.engine.shm_comm import ShmComm

    tp = pc.tensor_parallel_size
    if tp == 1 or device_type != "cpu" or not _shm_enabled(pc):
        return None
    stage = rank // tp
    return ShmComm(f"{prefix}-tp{stage}", rank % tp, tp, groups[stage])


#: This start's segment names: ``pdserve-<port>-<rank 0's pid>-<random>-{ctl,tp<stage>}``
#: (unique per start: a segment a crashed start left never blocks the next one).
_SEGMENT = re.compile(r"^pdserve-(\d+)-(\d+)-[0-9a-f]+-(?:ctl|tp\d+)$")


def segment_prefix(port: int) -> str:
    return f"pdserve-{port}-{os.getpid()}-{secrets.token_hex(4)}"


def remove_segments(prefix: str | None = None, port: int | None = None) -> list[str]:
    """Unlink the /dev/shm segments of the start ``prefix``, or (``port``) those of earlier
    starts on this port whose rank 0 is gone (a start killed between creating a segment and
    every rank opening it). Returns the names removed."""
    removed = []
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return removed
    for name in names:
        if prefix is not None:
            if not name.startswith(prefix + "-"):
                continue
        else:
            m = _SEGMENT.match(name)
            if m is None or int(m.group(1)) != port or pid_alive(int(m.group(2))):
                continue
        try:
            os.unlink(f"/dev/shm/{name}")
            removed.append(name)
        except OSError:
            pass
    return removed


class RankProcess:
    """One rank's process: ``python -c`` of :func:`_child_main`, its arguments pickled on
    stdin (a fresh interpreter that never re-imports the caller's ``__main__``, unlike
    ``multiprocessing`` spawn). It exits when this process does (its parent watch)."""

    def __init__(self, rank: int, args: tuple) -> None:
        self.rank = rank
        self.name = f"rank{rank}"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from shared.engine.distributed import _child_main; _child_main()",
            ],
            stdin=subprocess.PIPE,
            env=env,
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(pickle.dumps((*args, os.getpid())))
        self.proc.stdin.close()
        self.pid = self.proc.pid

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def join(self, timeout_s: float) -> None:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.is_alive():
            self.proc.kill()
            self.proc.wait(5)


def _child_main() -> None:
    rank_main(*pickle.load(sys.stdin.buffer))


def spawn_ranks(spec: WorkerSpec, ranks: range, port: int) -> list[RankProcess]:
    return [RankProcess(rank, (spec, rank, port)) for rank in ranks]


class MultiprocExecutor:
    """Rank 0's side: spawns this node's other ranks, broadcasts control messages, watches
    the ranks' processes."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.parallel = parallel = spec.parallel
        self.device_type = torch.device(spec.device).type
        self.procs: list[RankProcess] = []
        self.channel: Any = None
        self._closed = False
        self._died: str | None = None
        self._armed = False
        self._broken: str | None = None  # a control broadcast failed: no more on this channel
        self._starter: threading.Thread | None = None  # start-up's collectives (see _watched)
        self._start_box: dict[str, Any] = {}  # its result or error
        # Listen before the ranks learn the port: a port picked free, closed and bound later
        # could be taken in between (a worker failed to start with EADDRINUSE that way).
        self._store: Any = dist.TCPStore(
            parallel.master_addr,
            parallel.master_port or 0,
            parallel.world_size,
            is_master=True,
            timeout=_td(INIT_TIMEOUT_S),
            wait_for_workers=False,
        )
        self.port = int(self._store.port)
        self._prefix = segment_prefix(self.port)
        try:
            stale = remove_segments(port=self.port)
            if stale:
                logger.info("removed shared-memory segments of earlier starts: %s", stale)
            self._store.set(_LAYOUT_KEY, _layout(parallel))
            self._store.set(_PREFIX_KEY, self._prefix)
            self.procs = spawn_ranks(spec, range(1, parallel.local_world_size), self.port)
            logger.info(
                "TP %d x PP %d: rank 0 (pid %d) and ranks %s of this node (pids %s); "
                "rendezvous tcp://%s:%d",
                parallel.tensor_parallel_size,
                parallel.pipeline_parallel_size,
                os.getpid(),
                list(range(1, parallel.local_world_size)),
                [p.pid for p in self.procs],
                parallel.master_addr,
                self.port,
            )
            deadline = time.monotonic() + INIT_TIMEOUT_S
            self._wait_joined(deadline)
            self.control, self.groups, self.comm, self.channel = self._watched(
                lambda: _start_groups(parallel, 0, self.device_type, self._store, self._prefix),
                deadline,
            )
        except BaseException:
            self._abort()
            raise

    # ---- start-up ------------------------------------------------------------------------
    def _check_start(self) -> None:
        """Start-up's watch: a rank process of this node that exited fails the start now."""
        gone = [p for p in self.procs if not p.is_alive()]
        if gone:
            self._died = ", ".join(f"{p.name} (pid {p.pid}, exit {p.exitcode})" for p in gone)
            raise RankDiedError(
                "; ".join(
                    f"{p.name} (pid {p.pid}) exited with {p.exitcode} during start-up" for p in gone
                )
                + " (its log lines above say why)"
            )
        if self._store.check([_MISMATCH_KEY]):
            raise ConfigError(
                f"{self._store.get(_MISMATCH_KEY).decode()}: start every rank of the worker "
                "with the same --tensor-parallel-size, --pipeline-parallel-size and --nnodes"
            )

    def _wait_joined(self, deadline: float) -> None:
        """Until every other rank has checked its layout against this one and joined."""
        pc = self.parallel
        while True:
            self._check_start()
            missing = [
                r for r in range(1, pc.world_size) if not self._store.check([_joined_key(r)])
            ]
            if not missing:
                return
            if time.monotonic() > deadline:
                nodes = sorted({r // pc.local_world_size for r in missing})
                hint = (
                    f"; start node(s) {nodes} with the same flags and --nnodes {pc.nnodes} "
                    f"--node-rank k --master-addr {pc.master_addr} --master-port {self.port}"
                    if any(nodes)
                    else ""
                )
                raise CommTimeoutError(
                    f"rank(s) {missing} did not join within {INIT_TIMEOUT_S:g} s "
                    f"(PDSERVE_DIST_INIT_TIMEOUT_S; rendezvous tcp://{pc.master_addr}:"
                    f"{self.port}){hint}"
                )
            time.sleep(0.05)

    def _watched(self, fn: Any, deadline: float) -> Any:
        """``fn()`` (start-up collectives) on a helper thread while this one watches the rank
        processes: one that exits, or the deadline, fails the start at once (the helper's
        wait, blocked in gloo, ends when the killed ranks' connections close)."""
        box: dict[str, Any] = self._start_box

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e

        t = self._starter = threading.Thread(target=run, name="rank0-start", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.05)
            if not t.is_alive():
                break
            self._check_start()
            if time.monotonic() > deadline:
                raise CommTimeoutError(
                    f"the ranks' process group was not set up within {INIT_TIMEOUT_S:g} s "
                    "(PDSERVE_DIST_INIT_TIMEOUT_S)"
                )
        if "error" in box:
            err = self._start_error()
            if isinstance(err, RuntimeError) and not isinstance(
                err, (CommTimeoutError, RankDiedError)
            ):
                named = comm_error(err, "start-up", INIT_TIMEOUT_S)
                if isinstance(named, RankDiedError):
                    self._await_an_exit(EXIT_GRACE_S)
                self._check_start()  # a rank that exited says more than its closed socket
                raise named from err
            raise err
        return box.pop("value")

    def _await_an_exit(self, grace_s: float) -> None:
        """A peer's connection closed: the rank is on its way out, but its socket closes
        before the kernel has its exit status, and gloo's error can reach this thread in
        between. Wait (at most ``grace_s``) until one of this node's rank processes has
        exited, so that :meth:`_check_start` names it (the rank and its exit code) instead of
        the closed socket. A rank of another node never shows here: the wait runs out."""
        deadline = time.monotonic() + grace_s
        while all(p.is_alive() for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.01)

    def _start_error(self) -> BaseException | None:
        """The helper thread's error, its frames' locals dropped: they hold the process
        groups, which hold the rendezvous store and its listening port."""
        err = self._start_box.pop("error", None)
        if err is not None:
            traceback.clear_frames(err.__traceback__)
        return err

    def _abort(self) -> None:
        """A failed start: kill this node's ranks, remove this start's segments, leave the
        process group (when it got that far) so that this process may start another."""
        self._closed = True
        for p in self.procs:
            p.kill()
        if self._starter is not None:  # its gloo wait ends with the ranks' connections
            self._starter.join(5.0)
            self._start_error()
        removed = remove_segments(prefix=self._prefix)
        if removed:
            logger.info("removed shared-memory segments of the failed start: %s", removed)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                logger.debug("destroy_process_group failed", exc_info=True)
        self._store = None  # its port is free again (this process may start on it again)

    def wait_ready(self) -> None:
        """After ``alloc``: until every rank has loaded its share and allocated its KV (a
        barrier, watched: a rank that exits while loading fails the start now, not at the
        first request), then bound the busy path's waits (:func:`arm_busy_timeouts`)."""
        work = dist.barrier(group=self.control, async_op=True)
        _wait_watched(work, "start-up (every rank loaded)", self._check_start, INIT_TIMEOUT_S)
        if not self._armed:
            arm_busy_timeouts(0, self.parallel, self.control, self.groups)
            self._armed = True

    # ---- serving -------------------------------------------------------------------------
    def broadcast(self, msg: tuple, timeout_s: float | None = None) -> None:
        """One control message to every rank: a stuck rank fails it with
        :class:`CommTimeoutError` after ``timeout_s`` (default the channel's bound:
        ``PDSERVE_SHM_TIMEOUT_S`` in shared memory, ``PDSERVE_DIST_TIMEOUT_S`` on gloo).
        ``alloc`` is start-up's: the ranks take it once they loaded their share of the model
        (``INIT_TIMEOUT_S``, watched)."""
        self.check_alive()
        if self._broken is not None:  # a broadcast that failed may still be on the wire
            raise CommTimeoutError(f"the control channel failed earlier: {self._broken}")
        start = msg[0] == "alloc"
        if start:
            timeout_s = INIT_TIMEOUT_S
        try:
            if self.channel is not None:
                bound = WAIT_TIMEOUT_S if timeout_s is None else timeout_s
                self.channel.send(msg, alive=self.check_alive, timeout_s=bound)
                return
            bound = COLLECTIVE_TIMEOUT_S if timeout_s is None else timeout_s
            alive = self._check_start if start else None
            broadcast_object(msg, self.control, 0, bound, alive)
        except Exception as e:
            self._broken = repr(e)
            raise

    def check_alive(self) -> None:
        """Raise :class:`RankDiedError` if a rank process of this node has exited."""
        if self._died is None:
            gone = [p for p in self.procs if not p.is_alive()]
            if gone:
                self._died = ", ".join(f"{p.name} (pid {p.pid}, exit {p.exitcode})" for p in gone)
        if self._died is not None:
            raise RankDiedError(f"rank process exited: {self._died}")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        stopped = False
        if self._died is None and self._broken is None and all(p.is_alive() for p in self.procs):
            try:
                # idle ranks take it at once; a stuck one is not waited for long
                self.broadcast(("stop",), timeout_s=min(5.0, WAIT_TIMEOUT_S, COLLECTIVE_TIMEOUT_S))
                stopped = True
            except Exception:
                logger.debug("stop broadcast failed", exc_info=True)
        deadline = time.monotonic() + (timeout_s if stopped else 0.0)
        for p in self.procs:  # a rank that did not take the stop is killed now
            p.join(max(0.0, deadline - time.monotonic()))
            p.kill()
        if not stopped and self.parallel.nnodes > 1:
            # a rank on another node may be stuck: tearing gloo down could wait on it
            return
        try:
            dist.destroy_process_group()
        except Exception:
            logger.debug("destroy_process_group failed", exc_info=True)
        self._store = None  # the rendezvous port is free again


def _watch_parent(parent_pid: int) -> None:
    """Exit when rank 0's process is gone (its collectives would fail too, but an idle rank
    waits on the control broadcast)."""

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _join(pc: ParallelConfig, rank: int, port: int) -> tuple[Any, str]:
    """A follower's rendezvous with rank 0's store (waiting up to ``INIT_TIMEOUT_S`` for it):
    compare layouts (a mismatch is told to rank 0 and fails both), learn this start's segment
    prefix, say it joined. Returns (store, prefix)."""
    store = dist.TCPStore(pc.master_addr, port, None, is_master=False, timeout=_td(INIT_TIMEOUT_S))
    want, mine = store.get(_LAYOUT_KEY).decode(), _layout(pc)
    if want != mine:
        msg = f"rank {rank} (node {pc.node_rank}) was started with {mine}, rank 0 with {want}"
        store.set(_MISMATCH_KEY, msg)
        raise ConfigError(msg)
    prefix = store.get(_PREFIX_KEY).decode()
    store.set(_joined_key(rank), str(os.getpid()))
    return store, prefix


def rank_main(spec: WorkerSpec, rank: int, port: int, parent_pid: int | None) -> None:
    """A non-zero rank: join the group, load its share of the model, follow rank 0."""
    logging.basicConfig(
        level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s",
    )
    if parent_pid is not None:
        _watch_parent(parent_pid)
    from shared.engine.model_runner import ModelRunner

    parallel, dev = spec.parallel, spec.device
    try:
        if torch.device(dev).type == "cuda":
            dev = f"cuda:{rank % max(1, torch.cuda.device_count())}"
            torch.cuda.set_device(dev)
        device_type = torch.device(dev).type
        store, prefix = _join(parallel, rank, port)
        control, groups, comm, channel = _start_groups(parallel, rank, device_type, store, prefix)
        runner = ModelRunner(
            spec.model_config,
            spec.cache_config,
            spec.scheduler_config,
            dev,
            spec.attention_backend,
            spec.seed,
            parallel=parallel,
            rank=rank,
            groups=groups,
            comm=comm,
        )
        armed = False
        while True:
            # idle: as long as rank 0 sends nothing (no bound but rank 0's life)
            if channel is not None:
                msg = channel.recv()
            else:
                msg = broadcast_object(None, control, rank, None)
            op = msg[0]
            if op == "step":
                runner.run_step(*msg[1:])
            elif op == "alloc":
                runner.allocate_kv_cache(msg[1], msg[2])
                dist.barrier(group=control)  # rank 0's wait_ready: every rank is loaded
                if not armed:
                    arm_busy_timeouts(rank, parallel, control, groups)
                    armed = True
            elif op == "export":
                runner.export_blocks(msg[1])
            elif op == "import":
                runner.import_blocks(msg[1])
            elif op == "stop":
                break
            else:
                raise RuntimeError(f"unknown control message {op!r}")
    except Exception:
        logger.exception("rank %d failed; exiting", rank)
        logging.shutdown()
        os._exit(1)
    # rank 0 said stop: leave without tearing gloo down underneath its threads (their
    # destructors at interpreter exit can abort the process)
    logging.shutdown()
    os._exit(0)


def run_follower_node(spec: WorkerSpec) -> int:
    """``--node-rank k > 0``: run this node's ranks (no service) until rank 0 stops them or
    one exits; returns the exit status (0 after a stop)."""
    parallel = spec.parallel
    first = parallel.first_local_rank
    procs = spawn_ranks(spec, range(first, first + parallel.local_world_size), parallel.master_port)
    logger.info(
        "node %d of %d: ranks %s (pids %s) following tcp://%s:%d",
        parallel.node_rank,
        parallel.nnodes,
        [p.rank for p in procs],
        [p.pid for p in procs],
        parallel.master_addr,
        parallel.master_port,
    )
    try:
        while all(p.is_alive() for p in procs):
            time.sleep(0.2)
    finally:
        for p in procs:  # one ended: the others fail at their next collective, or are killed
            p.join(10)
            p.kill()
    return 1 if any(p.exitcode for p in procs) else 0
