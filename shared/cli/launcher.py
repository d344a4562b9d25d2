"""``pdserve up``: a whole local cluster in one command.

Starts Redis (embedded unless ``--redis-url``), N prefill and M decode workers and the router
as child processes, waits until each is healthy, prints the router and dashboard URLs and every
worker's KV capacity, and stops everything on Ctrl-C / SIGTERM. It supervises its children: one
that exits or is killed is started again (the same name and flags, after a backoff that doubles
from ``--restart-backoff`` up to 30 s and resets once a child stayed up a minute), and the rest
of the cluster keeps serving meanwhile; ``pdserve up`` itself exits only on Ctrl-C / SIGTERM or
when a process cannot start in the first place (Ctrl-C while it starts stops it at once).
Children die with the launcher (PR_SET_PDEATHSIG), so nothing is left behind even if it is
killed. The router's listening socket is the launcher's, bound before anything else starts
and handed to each router process it starts (``Cluster.listen``).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from http.client import HTTPException
from pathlib import Path
from typing import Any

from shared.config import (
    KV_HUGEPAGES_ENV,
    EngineArgs,
    float_at_least,
    int_at_least,
    port_number,
    usable_cores,
)
from shared.cpu_bind import (
    BIND_ENV,
    SPILL_ENV,
    CpuBindError,
    CpuPlan,
    format_cpu_list,
    pin_process,
    plan_cpus,
)
from shared.security import SECRET_ENV, SECRET_FILE_ENV, ClusterSecurity
from shared.subproc import popen_dying_with_parent

logger = logging.getLogger(__name__)
DEFAULT_MODEL_DIR = (
    Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve")) / "models"
)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser, model_required=False)
    g = parser.add_argument_group("cluster")
    g.add_argument(
        "--prefill",
        type=int_at_least(0),
        default=None,
        help="number of prefill workers (0 = colocated). Default: from the core count, "
        f"0 up to {COLOCATED_MAX_CORES} cores (one worker is faster there, "
        "docs/benchmarks.md), else 1",
    )
    g.add_argument("--decode", type=int_at_least(1), default=1, help="number of decode workers")
    g.add_argument(
        "--redis-url", default=None, help="use this Redis (default: start an embedded one)"
    )
    g.add_argument("--host", default="127.0.0.1", help="address the router listens on (its --host)")
    g.add_argument("--port", type=port_number, default=8000, help="router port (0: any free one)")
    g.add_argument(
        "--worker-host",
        default="127.0.0.1",
        help="address the workers bind (gRPC, metrics, UCX); loopback unless the workers "
        "must be reached from other hosts",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="API key the router requires (also PDSERVE_API_KEY / VLLM_API_KEY, which the "
        "router reads itself); handed to the router in its environment, never on its "
        "command line",
    )
    g.add_argument("--api-key-file", default=None, help="file of API keys, one per line")
    g.add_argument(
        "--cluster-secret-file",
        default=os.environ.get(SECRET_FILE_ENV),
        help=f"the cluster secret to use (or {SECRET_ENV}); default: a new random secret "
        "in the run directory, readable by this user only",
    )
    g.add_argument(
        "--preset",
        default="tiny",
        choices=("tiny", "small"),
        help="test model to make and serve when --model is not given",
    )
    g.add_argument(
        "--threads-per-worker",
        type=int_at_least(1),
        default=None,
        help="torch threads per worker rank (default: cores / (workers x TP x PP), at least 1)",
    )
    g.add_argument(
        "--kv-transport",
        default=None,
        choices=("ucx", "nixl"),
        help="KV transfer data path of every worker (default: the workers' own, ucx); nixl: "
        "the decode worker reads the prompt's blocks with NIXL (CMA on one host)",
    )
    g.add_argument("--run-dir", default=None, help="logs and ready files (default: a temp dir)")
    g.add_argument("--startup-timeout", type=float, default=300.0)
    g.add_argument(
        "--restart-backoff",
        type=float_at_least(0.1),
        default=1.0,
        help="seconds before a child that exited is started again (doubles per restart, up "
        "to 30 s; resets after a minute up)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="the router parses tool calls for tool_choice 'auto' (vLLM's flag; needs "
        "--tool-call-parser)",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        help="the model's tool-call format: hermes (the test models, Qwen2.5, Hermes) or "
        "llama3_json; the router checks it",
    )
    g.add_argument("--chat-template", default=None, help="the router's chat template override")
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="the router renders a request's own chat_template (vLLM's flag; without it such "
        "a request gets a 400)",
    )
    g.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="extra flag passed to the router (repeatable), e.g. --router-arg=--max-inflight=512",
    )
    g.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="extra flag passed to every worker (repeatable)",
    )
    g.add_argument(
        "--prefill-arg",
        action="append",
        default=[],
        help="extra flag for the prefill workers only (repeatable), e.g. "
        "--prefill-arg=--tensor-parallel-size=2 (P and D may use different TP sizes)",
    )
    g.add_argument(
        "--decode-arg",
        action="append",
        default=[],
        help="extra flag for the decode (or colocated) workers only (repeatable)",
    )


# up to this many usable cores, `pdserve up` runs one colocated worker unless --prefill is
# given: on 2 cores 1 prefill + 1 decode worker share them with the router, Redis and the
# clients, and measured no faster on vLLM's suite while copying every prompt's KV
# (docs/benchmarks.md, "Topology")
COLOCATED_MAX_CORES = 2


def resolve_topology(args: argparse.Namespace) -> str | None:
    """Fill in ``--prefill`` from the core count when it was not given; the line saying so."""
    if args.prefill is not None:
        return None
    cores = usable_cores()
    args.prefill = 0 if cores <= COLOCATED_MAX_CORES else 1
    if args.prefill == 0:
        return (
            f"[pdserve] {cores} cores: {args.decode} colocated worker(s), no prefill pool "
            "(the faster layout on this few cores); --prefill 1 for disaggregated prefill"
        )
    return f"[pdserve] {cores} cores: {args.prefill} prefill + {args.decode} decode worker(s)"


# a disaggregated cluster's decode workers compute at most this share of a step's token budget
# of prompts while they decode (--max-prefill-tokens-while-decoding, unless it was given): the
# prompts they prefill themselves are the router's overflow, and each chunk stalls every stream
# in the step (docs/benchmarks.md, "Local prefills on a decode worker")
DISAGG_DECODE_PREFILL_SHARE = 0.5

MAX_BACKOFF_S = 30.0
STABLE_S = 60.0  # up this long: the next exit restarts after the initial backoff again


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path
    ready_file: Path | None = None
    argv: list[str] = field(default_factory=list)  # to start it again
    threads: int | None = None
    env: dict[str, str] = field(default_factory=dict)  # beyond the cluster's (the API key)
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0
    backoff_s: float = 0.0  # the next restart's delay (0: the initial backoff)
    restart_at: float | None = None  # when it exited and waits for its restart
    announced_ready: bool = True
    pass_fds: tuple[int, ...] = ()  # descriptors it inherits (the router's listening socket)


def _spawn(
    argv: list[str], log: Any, env: dict[str, str], pass_fds: tuple[int, ...] = ()
) -> subprocess.Popen[Any]:
    """``python -m shared.cli ARGV`` in its own process group, SIGTERM when ``pdserve up``
    dies (Linux), stdout and stderr to ``log``."""
    return popen_dying_with_parent(
        [sys.executable, "-m", "shared.cli", *argv],
        deathsig=signal.SIGTERM,
        new_session=False,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        pass_fds=pass_fds,
    )


class RunDirInUseError(RuntimeError):
    """Another running ``pdserve up`` holds this run dir."""


class StartInterrupted(Exception):
    """A stop was asked for (Ctrl-C, SIGTERM) while the cluster was still starting."""


class Cluster:
    """The processes of one local cluster; ``start()`` then ``stop()``."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.topology_note = resolve_topology(args)
        self.children: list[Child] = []
        self.redis = None
        self.redis_url = args.redis_url
        import tempfile

        self.run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = self._lock_run_dir()
        self.ready: dict[str, dict] = {}
        self.listener: socket.socket | None = None  # the router's port, held (see listen)
        # set from a signal handler: the start-up waits give up at their next poll (a large
        # model's workers load for minutes, and Ctrl-C used to wait for all of it)
        self.stop_requested = False
        self.secret_env = self._cluster_secret()
        self.security = ClusterSecurity.from_environ(self.secret_env)  # what the children use

    def _lock_run_dir(self) -> int:
        """Hold ``run_dir/.pdserve-up.lock`` for this launcher's life (the kernel lets go of
        it when the process ends, however it ends). A second ``pdserve up`` on the same run
        dir stops here, before it touches anything: it used to write a new cluster secret
        over the running cluster's before failing on the taken port, and every child the
        running cluster restarted afterwards was refused by the rest (UNAUTHENTICATED)."""
        path = self.run_dir / ".pdserve-up.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # not inherited by the children
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            raise RunDirInUseError(
                f"the run dir {self.run_dir} belongs to another running pdserve up "
                f"(it holds {path.name}); stop that one or give another --run-dir"
            ) from e
        return fd

    def _cluster_secret(self) -> dict[str, str]:
        """The environment that gives every child the cluster secret: the file or value the
        user gave, else a new random secret in a file only this user can read."""
        if self.args.cluster_secret_file:
            return {SECRET_FILE_ENV: str(Path(self.args.cluster_secret_file).resolve())}
        if os.environ.get(SECRET_ENV, "").strip():
            return {SECRET_ENV: os.environ[SECRET_ENV].strip()}
        path = self.run_dir / "cluster-secret"
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        return {SECRET_FILE_ENV: str(path)}

    def _child_env(
        self, threads: int | None, extra: dict[str, str] | None = None
    ) -> dict[str, str]:
        env = dict(os.environ)
        env.pop(SECRET_ENV, None)
        env.pop(SECRET_FILE_ENV, None)
        env.update(self.secret_env)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.pop(BIND_ENV, None)  # the cluster's lists; a child gets its own below, or none
        env.pop(SPILL_ENV, None)
        if threads:
            env["PDSERVE_NUM_THREADS"] = str(threads)
            env["OMP_NUM_THREADS"] = str(threads)
        env.update(extra or {})
        return env

    def _spawn(
        self,
        name: str,
        argv: list[str],
        threads: int | None = None,
        ready: bool = True,
        env: dict[str, str] | None = None,
        pass_fds: tuple[int, ...] = (),
    ) -> Child:
        log = self.run_dir / f"{name}.log"
        ready_file = self.run_dir / f"{name}.ready.json" if ready else None
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
            argv = argv + ["--ready-file", str(ready_file)]
        extra_env = dict(env or {})
        env = self._child_env(threads, extra_env)
        f = open(log, "ab")  # noqa: SIM115 - handed to the child, closed right after
        proc = _spawn(argv, f, env, pass_fds)
        f.close()
        child = Child(
            name,
            proc,
            log,
            ready_file,
            argv=list(argv),
            threads=threads,
            env=extra_env,
            pass_fds=pass_fds,
        )
        self.children.append(child)
        return child

    def _respawn(self, child: Child, now: float) -> None:
        """Start ``child``'s process again with the same argv (its ready file anew)."""
        if child.ready_file is not None:
            child.ready_file.unlink(missing_ok=True)
        env = self._child_env(child.threads, child.env)
        with open(child.log, "ab") as f:
            f.write(f"\n[pdserve] restart {child.restarts}\n".encode())
            f.flush()
            child.proc = _spawn(child.argv, f, env, child.pass_fds)
        child.started_at = now
        child.restart_at = None
        child.announced_ready = child.ready_file is None

    @staticmethod
    def _kill(c: Child) -> None:
        """SIGKILL ``c``'s process group (it and its TP/PP rank processes); the next
        :meth:`supervise` sees it exited and restarts it after its backoff."""
        try:
            os.killpg(c.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                c.proc.kill()
            except ProcessLookupError:
                pass

    def _schedule_restart(self, c: Child, now: float) -> float:
        """Set ``c``'s next restart after its backoff (doubling, up to 30 s); returns the delay."""
        delay = c.backoff_s or self.args.restart_backoff
        c.backoff_s = min(MAX_BACKOFF_S, delay * 2)
        c.restart_at = now + delay
        return delay

    def supervise(self, now: float | None = None) -> list[str]:
        """Restart children that exited (after their backoff); returns the lines it logged.
        Also restarts the embedded Redis on its port. Call it every half second or so."""
        now = time.monotonic() if now is None else now
        lines: list[str] = []
        if self.redis is not None and not self.redis.alive:
            lines.append("[pdserve] embedded Redis exited; starting it again on the same port")
            try:
                self.redis.restart()
                self._pin_redis()
            except Exception as e:  # noqa: BLE001 - retried at the next call
                lines.append(f"[pdserve] embedded Redis did not restart: {e}")
        for c in self.children:
            code = c.proc.poll()
            if code is None:
                if not c.announced_ready and c.ready_file is not None and c.ready_file.exists():
                    c.announced_ready = True
                    info = json.loads(c.ready_file.read_text())
                    self.ready[c.name] = info
                    lines.append(
                        f"[pdserve] {c.name} ready again (restart {c.restarts}) gRPC {info['grpc']}"
                    )
                elif (
                    not c.announced_ready
                    and c.ready_file is not None
                    and now - c.started_at > self.args.startup_timeout
                ):
                    # the first start had --startup-timeout to become ready (wait_ready): a
                    # restart gets as long, then it is killed and restarted (it may be stuck
                    # in a start-up that never ends: a rank of it that never joins, a lock)
                    lines.append(
                        f"[pdserve] {c.name} not ready {now - c.started_at:.0f} s after restart "
                        f"{c.restarts} (--startup-timeout {self.args.startup_timeout:.0f}); "
                        "killing it to start it again"
                    )
                    self._kill(c)
                    continue
                if c.announced_ready and now - c.started_at >= STABLE_S:
                    c.backoff_s = 0.0
                continue
            if c.restart_at is None:  # just noticed
                delay = self._schedule_restart(c, now)
                lines.append(
                    f"[pdserve] {c.name} exited with {code}; restarting it in "
                    f"{delay:.1f} s (restart {c.restarts + 1}). Log tail:\n"
                    f"{_tail(c.log, 12)}"
                )
            elif now >= c.restart_at:
                c.restarts += 1
                try:
                    self._respawn(c, now)
                except Exception as e:  # noqa: BLE001 - one child's restart, tried again later
                    # (its log or run dir gone, fork's EAGAIN/ENOMEM, the interpreter
                    # replaced): the other children keep serving, this one waits its backoff
                    delay = self._schedule_restart(c, now)
                    lines.append(
                        f"[pdserve] {c.name} could not be started again ({type(e).__name__}: "
                        f"{e}); trying again in {delay:.1f} s"
                    )
                    continue
                lines.append(
                    f"[pdserve] {c.name} started again (restart {c.restarts}, pid {c.proc.pid})"
                )
        for line in lines:
            _say(line)
        return lines

    def start(self) -> str:
        """Start Redis, the workers and the router; return the router's base URL."""
        a = self.args
        self.listen()
        self.start_redis()
        workers = [self.spawn_worker("prefill", i) for i in range(a.prefill)]
        workers += [self.spawn_worker("decode", i) for i in range(a.decode)]
        self.wait_ready(workers)
        return self.start_router()

    @property
    def model(self) -> str:
        if not self.args.model:
            self.args.model = ensure_test_model(self.args.preset)
        return self.args.model

    @property
    def served_model_name(self) -> str:
        return self.args.served_model_name or self.model

    def start_redis(self) -> str:
        if not self.redis_url:
            from shared.directory import EmbeddedRedis

            self.redis = EmbeddedRedis()
            self.redis_url = self.redis.start()
            self._pin_redis()
            print(f"[pdserve] embedded Redis at {self.redis_url}", flush=True)
        return self.redis_url

    def _pin_redis(self) -> None:
        plan = self.cpu_plan
        if self.redis is not None and self.redis.pid and plan is not None and plan.others:
            try:
                pin_process(self.redis.pid, plan.others)
            except OSError as e:
                logger.warning("could not pin the embedded Redis to CPU %s: %s", plan.others, e)

    def worker_worlds(self) -> list[int]:
        """Each worker's rank count (TP x PP), in start order: prefill workers, then decode."""
        a = self.args
        common = list(a.worker_arg)
        return [self._world(common + a.prefill_arg)] * a.prefill + [
            self._world(common + a.decode_arg)
        ] * a.decode

    @property
    def cpu_plan(self) -> CpuPlan | None:
        """Which CPUs each worker, the router and Redis run on (``shared/cpu_bind.py``);
        ``None``: no binding. Made once, from the flags, at the first use."""
        if not hasattr(self, "_cpu_plan"):
            self._cpu_plan = plan_cpus(
                self.worker_worlds(), threads_per_rank=self.args.threads_per_worker
            )
            names = [f"prefill-{i}" for i in range(self.args.prefill)]
            names += [f"decode-{i}" for i in range(self.args.decode)]
            print(
                self._cpu_plan.describe(names)
                if self._cpu_plan is not None
                else f"[pdserve] CPU binding: none ({self._no_plan_reason()})",
                flush=True,
            )
        return self._cpu_plan

    def _no_plan_reason(self) -> str:
        if os.environ.get(BIND_ENV, "").strip() == "nobind":
            return f"{BIND_ENV}=nobind"
        return f"{sum(self.worker_worlds())} worker rank(s) for {usable_cores()} core(s)"

    def spawn_worker(
        self, role: str, index: int, extra: list[str] | None = None, name: str | None = None
    ) -> Child:
        """Start one worker process (not waiting for it: see ``wait_ready``)."""
        a = self.args
        engine = EngineArgs.from_cli_args(a)
        engine.model = self.model
        engine.served_model_name = self.served_model_name
        if role == "decode" and a.prefill and engine.max_prefill_tokens_while_decoding is None:
            engine.max_prefill_tokens_while_decoding = DISAGG_DECODE_PREFILL_SHARE
        role_args = a.prefill_arg if role == "prefill" else a.decode_arg
        threads = a.threads_per_worker or max(1, usable_cores() // self.num_ranks())
        env: dict[str, str] = {}
        plan, slot = self.cpu_plan, index if role == "prefill" else a.prefill + index
        world = self._world([*a.worker_arg, *role_args, *(extra or [])])
        if plan is not None and slot < len(plan.workers) and self.worker_worlds()[slot] == world:
            cpus = plan.workers[slot]
            threads = plan.threads(slot, world)
            env[BIND_ENV] = format_cpu_list(cpus)
            if plan.spill:  # the lone worker: long steps on the router's cores too
                env[SPILL_ENV] = format_cpu_list(plan.spill)
            elif world == 1 and threads > 1:  # each OpenMP thread on a core of its own
                env["OMP_PLACES"] = ",".join(f"{{{c}}}" for c in cpus[:threads])
                env["OMP_PROC_BIND"] = "close"
        if a.prefill and KV_HUGEPAGES_ENV not in os.environ:
            # Disaggregated: the KV pool on 4 KiB pages. Huge pages gave a colocated worker
            # 1.04-1.16x, but a 1P + 1D cluster no throughput and a worse first token (TTFT
            # p99 1.28-1.31x at c16 in two A/Bs; docs/benchmarks.md, "The KV pool on huge pages")
            env[KV_HUGEPAGES_ENV] = "0"
        name = name or f"{role}-{index}"
        argv = [
            role,
            *engine.to_cli_args(),
            "--redis-url",
            self.start_redis(),
            "--host",
            a.worker_host,
            "--worker-id",
            name,
            *(["--kv-transport", a.kv_transport] if a.kv_transport else []),
            *a.worker_arg,
            *role_args,
            *(extra or []),
        ]
        return self._spawn(name, argv, threads, env=env)

    def _world(self, flags: list[str]) -> int:
        """TP x PP of a worker given ``flags`` beyond the cluster's: the engine flags' own
        parser, starting from the cluster's values (argparse keeps a namespace's attributes as
        its defaults)."""
        parser = argparse.ArgumentParser(add_help=False)
        EngineArgs.add_cli_args(parser, model_required=False)
        got, _ = parser.parse_known_args(flags, namespace=argparse.Namespace(**vars(self.args)))
        return int(got.tensor_parallel_size * got.pipeline_parallel_size)

    def num_ranks(self) -> int:
        """Every worker's rank processes together (TP x PP each, the per-role flags too)."""
        return max(1, sum(self.worker_worlds()))

    def listen(self) -> socket.socket:
        """The router's listening socket, bound (once) before anything else starts and held
        for the cluster's life; the router serves on it (``--fd``), restarts included.

        Every worker and the embedded Redis bind ephemeral ports. Were the router's port free
        until the router itself bound it, as it was, a worker could be given that very port
        whenever it lies in the ephemeral range (as a benchmark's kernel-picked free port
        did): the router then failed to start, and the start-up check met the worker's gRPC
        server on the router's URL. Held, it is never free, and a port another server uses
        is an error at once. Raises RuntimeError."""
        if self.listener is None:
            a = self.args
            family = socket.AF_INET6 if ":" in a.host else socket.AF_INET  # as uvicorn does
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((a.host, a.port))
                sock.listen(2048)  # uvicorn's backlog
            except OSError as e:
                sock.close()
                raise RuntimeError(f"the router cannot listen on {a.host}:{a.port}: {e}") from None
            a.port = sock.getsockname()[1]  # --port 0: the port the system chose
            self.listener = sock
        return self.listener

    def start_router(self, extra: list[str] | None = None) -> str:
        a = self.args
        fd = self.listen().fileno()
        argv = [
            "router",
            "--model",
            self.model,
            "--served-model-name",
            self.served_model_name,
            "--redis-url",
            self.start_redis(),
            "--host",
            a.host,
            "--port",
            str(a.port),
            "--fd",
            str(fd),
            # the router tokenizes, detokenizes and templates: the workers' tokenizer
            *(["--tokenizer", a.tokenizer] if a.tokenizer else []),
            *(["--max-logprobs", str(a.max_logprobs)] if a.max_logprobs != 20 else []),
            *(["--max-model-len", str(a.max_model_len)] if a.max_model_len else []),
            *(["--enable-auto-tool-choice"] if a.enable_auto_tool_choice else []),
            *(["--tool-call-parser", a.tool_call_parser] if a.tool_call_parser else []),
            *(["--chat-template", a.chat_template] if a.chat_template else []),
            *(["--trust-request-chat-template"] if a.trust_request_chat_template else []),
            *a.router_arg,
            *(extra or []),
        ]
        if a.api_key_file:
            argv += ["--api-key-file", a.api_key_file]
        env = {"PDSERVE_API_KEY": a.api_key} if a.api_key else {}
        plan = self.cpu_plan
        if plan is not None and plan.others:
            env[BIND_ENV] = format_cpu_list(plan.others)
        router = self._spawn("router", argv, ready=False, env=env, pass_fds=(fd,))
        url = f"http://{a.host}:{a.port}"
        self._wait_http(router, f"{url}/health")
        return url

    def wait_ready(self, workers: list[Child]) -> None:
        deadline = time.monotonic() + self.args.startup_timeout
        pending = list(workers)
        t0 = time.monotonic()
        while pending:
            self._check_stop(", ".join(c.name for c in pending))
            for c in list(pending):
                if c.ready_file is not None and c.ready_file.exists():
                    info = json.loads(c.ready_file.read_text())
                    self.ready[c.name] = info
                    print(
                        f"[pdserve] {c.name:<10} ready  gRPC {info['grpc']}  {info['kv_capacity']}",
                        flush=True,
                    )
                    pending.remove(c)
                elif c.proc.poll() is not None:
                    raise RuntimeError(
                        f"{c.name} exited with {c.proc.returncode}; log:\n{_tail(c.log)}"
                    )
            if pending and time.monotonic() > deadline:
                raise TimeoutError(
                    f"{', '.join(c.name for c in pending)} not ready after "
                    f"{self.args.startup_timeout:.0f}s"
                )
            if pending:
                if sys.stdout.isatty():
                    print(
                        f"\r[pdserve] starting {len(pending)} worker(s)... "
                        f"{time.monotonic() - t0:4.0f}s",
                        end="",
                        flush=True,
                    )
                time.sleep(0.2)
        if sys.stdout.isatty():
            print("\r", end="")

    def _wait_http(self, child: Child, url: str) -> None:
        deadline = time.monotonic() + self.args.startup_timeout
        while True:
            self._check_stop(child.name)
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except (OSError, HTTPException):  # not up yet, or not an HTTP server
                pass
            if child.proc.poll() is not None:
                raise RuntimeError(
                    f"{child.name} exited with {child.proc.returncode}; log:\n{_tail(child.log)}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{child.name} not healthy at {url}")
            time.sleep(0.2)

    def _check_stop(self, waiting_for: str) -> None:
        if self.stop_requested:
            raise StartInterrupted(f"stop asked for while starting ({waiting_for} not ready yet)")

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM everyone (router first, so no new work reaches the workers), then KILL
        whatever is still alive after ``timeout_s``; stop the embedded Redis last."""
        order = sorted(self.children, key=lambda c: c.name != "router")
        for c in order:
            if c.proc.poll() is None:
                try:
                    os.killpg(c.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout_s
        for c in order:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(c.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    c.proc.wait(5)
                except subprocess.TimeoutExpired:  # stuck in the kernel: the rest still stops
                    _say(f"[pdserve] {c.name} (pid {c.proc.pid}) did not exit after SIGKILL")
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self.redis is not None:
            self.redis.stop()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the run dir is free for the next pdserve up
            self._lock_fd = None


def _say(line: str, err: bool = False) -> None:
    """Print a launcher line, best effort: a closed stdout (``pdserve up | tee`` with the tee
    gone) must not stop the cluster that the line is about."""
    try:
        print(line, file=sys.stderr if err else sys.stdout, flush=True)
    except (OSError, ValueError):  # BrokenPipeError; ValueError: the stream was closed
        pass


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def ensure_test_model(preset: str = "tiny") -> str:
    """Make the test model once (under ~/.cache/pdserve/models) and return its path."""
    path = DEFAULT_MODEL_DIR / f"{preset}-llama"
    if not (path / "model.safetensors").exists():
        from shared.cli.tiny_model import make_tiny_model

        print(f"[pdserve] making the {preset} test model in {path}", flush=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        make_tiny_model(tmp, preset=preset)
        tmp.rename(path)
    return str(path)


def run(args: argparse.Namespace) -> int:
    try:
        cluster = Cluster(args)
    except RunDirInUseError as e:
        _say(f"[pdserve] failed to start: {e}", err=True)
        return 1

    def on_signal(signum, frame):
        cluster.stop_requested = True  # ends start-up's waits, or the supervision loop

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        if cluster.topology_note:
            print(cluster.topology_note, flush=True)
        url = cluster.start()
        print(
            f"[pdserve] router     {url}/v1  (OpenAI API; model {args.served_model_name or args.model or 'the test model'})"
        )
        print(f"[pdserve] dashboard  {url}/dashboard")
        print(f"[pdserve] metrics    {url}/metrics   logs in {cluster.run_dir}")
        print("[pdserve] Ctrl-C to stop", flush=True)
        while not cluster.stop_requested:
            try:  # a child that exits is restarted; the rest keeps serving
                cluster.supervise()
            except Exception:  # supervision goes on; the cluster keeps serving
                logger.exception("supervising the cluster failed; trying again")
            time.sleep(0.5)
        return 0
    except StartInterrupted as e:
        _say(f"[pdserve] {e}")
        return 0
    except (RuntimeError, TimeoutError, CpuBindError) as e:
        _say(f"[pdserve] failed to start: {e}", err=True)
        return 1
    finally:
        _say("[pdserve] stopping...")
        cluster.stop()
        _say("[pdserve] stopped")


def cluster_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``pdserve up`` flags (tests and scripts build clusters with this)."""
    parser = argparse.ArgumentParser(prog="pdserve up")
    add_cli_args(parser)
    return parser.parse_args(argv)
