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
  rank; each rank's blocks hold its layers and KV heads only);
* ``("step", moves, chunks, logit_rows)``: one forward pass (:meth:`ModelRunner.run_step`);
* ``("export", block_ids)`` / ``("import", block_ids)``: gather the blocks' shards into rank
  0's canonical transfer pool / scatter them from it (KV transfer across layouts);
* ``("stop",)``.

Failure rules: a rank that exits is seen by rank 0's process watch (:meth:`check_alive`, each
engine-loop turn) or by the next collective failing, either way the engine loop dies and the
worker turns NOT_SERVING and exits (its supervisor restarts it); a rank whose rank 0 is gone
exits within a second (parent watch) or at its next collective.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shared.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, env_float

logger = logging.getLogger(__name__)

#: Bound on one collective (a step's all-reduce, a broadcast while busy). Idle ranks wait on
#: the control broadcast; a lost peer fails it at once (its sockets close).
COLLECTIVE_TIMEOUT_S = env_float("PDSERVE_DIST_TIMEOUT_S", 7 * 24 * 3600, minimum=0.001)


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


class RankDiedError(RuntimeError):
    """A rank process of this worker exited; the worker cannot step any more."""


def init_process_group(
    pc: ParallelConfig, rank: int, device_type: str, port: int, store: Any = None
) -> Any:
    """Join the worker's process group; returns the control group (gloo). ``store``: the
    rendezvous server rank 0 already listens with (see ``rendezvous_store``)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    # the other ranks' tcp:// rendezvous prefixes its keys with "default_pg": so does this one
    where: dict[str, Any] = (
        {"init_method": f"tcp://{pc.master_addr}:{port}"}
        if store is None
        else {"store": dist.PrefixStore("default_pg", store)}
    )
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=pc.world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        **where,
    )
    if backend == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


def stage_groups(pc: ParallelConfig) -> list[Any]:
    """Every stage's TP group (``new_group`` is collective: every rank builds all of them)."""
    tp = pc.tensor_parallel_size
    if tp == 1:
        return [None] * pc.pipeline_parallel_size
    if pc.pipeline_parallel_size == 1:
        return [dist.group.WORLD]
    return [
        dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pc.pipeline_parallel_size)
    ]


def _shm_enabled(pc: ParallelConfig) -> bool:
    """Every rank on this node, a platform shm_comm supports, not turned off
    (``PDSERVE_SHM_COMM=0``)."""
    from shared.engine.shm_comm import shm_supported

    return pc.nnodes == 1 and shm_supported() and os.environ.get("PDSERVE_SHM_COMM", "1") != "0"


def control_channel(pc: ParallelConfig, rank: int, control: Any, port: int) -> Any:
    """Shared-memory control messages (shared/engine/shm_comm.py::ShmBroadcast) when
    ``_shm_enabled``; ``None``: gloo broadcasts."""
    from shared.engine.shm_comm import ShmBroadcast

    if not _shm_enabled(pc):
        return None
    return ShmBroadcast(f"pdserve-{port}-ctl", rank, pc.world_size, control)


def stage_comm(
    pc: ParallelConfig, rank: int, device_type: str, groups: list[Any], port: int
) -> Any:
    """This rank's shared-memory TP collectives (shared/engine/shm_comm.py) for a CPU stage
    when ``_shm_enabled``; ``None``: the group's own backend."""
    from shared.engine.shm_comm import ShmComm

    tp = pc.tensor_parallel_size
    if tp == 1 or device_type != "cpu" or not _shm_enabled(pc):
        return None
    stage = rank // tp
    return ShmComm(f"pdserve-{port}-tp{stage}", rank % tp, tp, groups[stage])


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
        store = None
        if parallel.master_port:
            self.port = parallel.master_port
        else:
            # Listen before the ranks learn the port: a port picked free, closed and bound later
            # could be taken in between (a worker failed to start with EADDRINUSE that way).
            store = dist.TCPStore(
                parallel.master_addr,
                0,
                parallel.world_size,
                is_master=True,
                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                wait_for_workers=False,
            )
            self.port = int(store.port)
        self.procs = spawn_ranks(spec, range(1, parallel.local_world_size), self.port)
        logger.info(
            "TP %d x PP %d: rank 0 (pid %d) and ranks %s of this node (pids %s); rendezvous "
            "tcp://%s:%d",
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            os.getpid(),
            list(range(1, parallel.local_world_size)),
            [p.pid for p in self.procs],
            parallel.master_addr,
            self.port,
        )
        self.device_type = torch.device(spec.device).type
        self.control = init_process_group(parallel, 0, self.device_type, self.port, store)
        self.groups = stage_groups(parallel)
        self.comm = stage_comm(parallel, 0, self.device_type, self.groups, self.port)
        self.channel = control_channel(parallel, 0, self.control, self.port)
        self._closed = False
        self._died: str | None = None

    def broadcast(self, msg: tuple) -> None:
        self.check_alive()
        if self.channel is not None:
            self.channel.send(msg, alive=self.check_alive)
            return
        box = [msg]
        dist.broadcast_object_list(box, src=0, group=self.control)

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
        if self._died is None and all(p.is_alive() for p in self.procs):
            try:
                self.broadcast(("stop",))
            except Exception:
                logger.debug("stop broadcast failed", exc_info=True)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            p.kill()
        try:
            dist.destroy_process_group()
        except Exception:
            logger.debug("destroy_process_group failed", exc_info=True)


def _watch_parent(parent_pid: int) -> None:
    """Exit when rank 0's process is gone (its collectives would fail too, but an idle rank
    waits on the control broadcast)."""

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


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
    if torch.device(dev).type == "cuda":
        dev = f"cuda:{rank % max(1, torch.cuda.device_count())}"
        torch.cuda.set_device(dev)
    device_type = torch.device(dev).type
    control = init_process_group(parallel, rank, device_type, port)
    groups = stage_groups(parallel)
    comm = stage_comm(parallel, rank, device_type, groups, port)
    channel = control_channel(parallel, rank, control, port)
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
    try:
        while True:
            if channel is not None:
                msg = channel.recv()
            else:
                box: list[Any] = [None]
                dist.broadcast_object_list(box, src=0, group=control)
                msg = box[0]
            op = msg[0]
            if op == "step":
                runner.run_step(*msg[1:])
            elif op == "alloc":
                runner.allocate_kv_cache(msg[1], msg[2])
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
