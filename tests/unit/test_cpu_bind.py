"""CPU binding (``shared/cpu_bind.py``): the plan ``pdserve up`` makes for its workers, the
router and Redis, and a process pinning itself from ``PDSERVE_CPU_OMP_THREADS_BIND``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.cli import launcher
from shared.cli.launcher import cluster_args
from shared.config import KV_HUGEPAGES_ENV
from shared.cpu_bind import (
    BIND_ENV,
    RESERVED_ENV,
    SPILL_ENV,
    CpuBindError,
    CpuPlan,
    bind_from_env,
    bound_cpus,
    format_cpu_list,
    parse_cpu_list,
    physical_cores,
    plan_cpus,
    spill_cpus,
)

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def fake_sysfs(tmp_path: Path, cores: int, smt: int = 1) -> Path:
    """A sysfs CPU tree of ``cores`` physical cores with ``smt`` threads each, numbered like
    Linux on x86: the first thread of every core, then the second threads."""
    for t in range(smt):
        for c in range(cores):
            topo = tmp_path / f"cpu{t * cores + c}" / "topology"
            topo.mkdir(parents=True)
            (topo / "physical_package_id").write_text("0\n")
            (topo / "core_id").write_text(f"{c}\n")
    return tmp_path


@pytest.fixture(autouse=True)
def _no_user_settings(monkeypatch):
    monkeypatch.delenv(BIND_ENV, raising=False)
    monkeypatch.delenv(RESERVED_ENV, raising=False)


def test_cpu_lists_parse_and_print_like_linux():
    assert parse_cpu_list("0-3,6, 8-9") == [0, 1, 2, 3, 6, 8, 9]
    assert parse_cpu_list("2,2,1-2") == [2, 1]
    assert format_cpu_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert format_cpu_list([3]) == "3"
    for bad in ("", "a", "3-1", "-1", "1-x"):
        with pytest.raises(CpuBindError):
            parse_cpu_list(bad)


def test_smt_siblings_are_told_apart_from_cores(tmp_path):
    sysfs = fake_sysfs(tmp_path, cores=4, smt=2)
    assert physical_cores(list(range(8)), sysfs) == ([0, 1, 2, 3], [4, 5, 6, 7])
    # no topology in sysfs: every CPU its own core
    assert physical_cores([0, 1], tmp_path / "none") == ([0, 1], [])


@pytest.mark.parametrize(
    "cores,worlds,workers,others",
    [
        (2, [1], [[0]], [1]),  # this machine, colocated: vLLM's layout (model, API server)
        (2, [1, 1], [[0], [1]], []),  # no core to spare: the workers first
        (1, [1], [[0]], []),
        (8, [1, 1], [[0, 1, 2], [3, 4, 5]], [6, 7]),  # the leftover core joins the reserved
        (8, [2, 1], [[0, 1, 2, 3], [4, 5]], [6, 7]),  # a TP-2 worker: 2 cores per rank
        (4, [1, 1, 1], [[0], [1], [2]], [3]),
    ],
)
def test_auto_gives_each_rank_cores_of_its_own_and_keeps_one(
    tmp_path, cores, worlds, workers, others
):
    plan = plan_cpus(worlds, list(range(cores)), "auto", sysfs=fake_sysfs(tmp_path, cores))
    assert plan is not None and plan.workers == workers and plan.others == others
    # a lone worker rank's long steps also take the kept cores; with several, nobody's do
    assert plan.spill == (others if len(worlds) == 1 and worlds[0] == 1 else [])
    assert [plan.threads(i, w) for i, w in enumerate(worlds)] == [
        len(c) // w + len(plan.spill) for c, w in zip(workers, worlds, strict=True)
    ]


def test_auto_takes_one_cpu_per_physical_core(tmp_path):
    sysfs = fake_sysfs(tmp_path, cores=4, smt=2)
    plan = plan_cpus([1], list(range(8)), "auto", sysfs=sysfs)
    assert plan == CpuPlan([[0, 1, 2]], [3, 4, 5, 6, 7], "auto", spill=[3])  # no SMT sibling


def test_no_binding_with_more_ranks_than_cores_or_when_told(tmp_path):
    sysfs = fake_sysfs(tmp_path, 2)
    assert plan_cpus([1, 1, 1], [0, 1], "auto", sysfs=sysfs) is None
    assert plan_cpus([2, 1], [0, 1], "auto", sysfs=sysfs) is None
    assert plan_cpus([1], [0, 1], "nobind", sysfs=sysfs) is None
    assert plan_cpus([1, 1], [0, 1], "auto", threads_per_rank=2, sysfs=sysfs) is None


def test_reserved_cores_and_threads_per_rank(tmp_path, monkeypatch):
    sysfs = fake_sysfs(tmp_path, 8)
    monkeypatch.setenv(RESERVED_ENV, "3")
    plan = plan_cpus([1, 1], list(range(8)), "auto", sysfs=sysfs)
    assert plan is not None and plan.workers == [[0, 1], [2, 3]] and plan.others == [4, 5, 6, 7]
    monkeypatch.setenv(RESERVED_ENV, "-1")
    with pytest.raises(CpuBindError):
        plan_cpus([1], list(range(8)), "auto", sysfs=sysfs)
    monkeypatch.delenv(RESERVED_ENV)
    # --threads-per-worker 4 on 8 cores for 2 workers: every core to them, none kept
    plan = plan_cpus([1, 1], list(range(8)), "auto", threads_per_rank=4, sysfs=sysfs)
    assert plan is not None and plan.workers == [[0, 1, 2, 3], [4, 5, 6, 7]] and not plan.others


def test_explicit_lists_one_per_worker():
    plan = plan_cpus([1, 1], [0, 1, 2, 3], "0-1|2")
    assert plan == CpuPlan([[0, 1], [2]], [3], "0-1|2")
    with pytest.raises(CpuBindError, match="2 worker"):
        plan_cpus([1, 1], [0, 1, 2, 3], "0-3")
    with pytest.raises(CpuBindError, match="may not use"):
        plan_cpus([1], [0, 1, 2, 3], "7")


def test_pdserve_up_with_a_bad_setting_says_so(monkeypatch, tmp_path, capsys):
    """A CPU list the machine lacks stops ``pdserve up`` with one line, before any child."""
    monkeypatch.setenv(BIND_ENV, "4096")
    monkeypatch.setattr(launcher.signal, "signal", lambda *a: None)  # not the test runner's
    argv = ["--model", "m", "--prefill", "0", "--redis-url", "redis://127.0.0.1:1"]
    args = cluster_args([*argv, "--run-dir", str(tmp_path)])
    assert launcher.run(args) == 1
    err = capsys.readouterr().err
    assert "failed to start" in err and "may not use" in err


def fake_cluster(monkeypatch, argv: list[str], plan) -> tuple[launcher.Cluster, dict]:
    """A ``pdserve up`` cluster whose plan is ``plan(worlds)`` and whose children are not
    started: ``spawned[name]`` records each one's (argv, threads, env)."""
    cluster = launcher.Cluster.__new__(launcher.Cluster)
    cluster.args = cluster_args(["--model", "m", "--port", "0", *argv])
    cluster.secret_env = {}
    cluster.listener = None  # start_router binds a port the system picks
    spawned: dict[str, tuple] = {}
    monkeypatch.setattr(launcher, "plan_cpus", lambda worlds, threads_per_rank=None: plan(worlds))
    monkeypatch.setattr(cluster, "start_redis", lambda: "redis://127.0.0.1:1")
    monkeypatch.setattr(
        cluster,
        "_spawn",
        lambda name, argv, threads=None, ready=True, env=None, pass_fds=(): spawned.setdefault(
            name, (argv, threads, env)
        ),
    )
    monkeypatch.setattr(cluster, "_wait_http", lambda child, url: None)
    return cluster, spawned


def test_launcher_hands_each_child_its_cpus(monkeypatch, capsys):
    """``pdserve up`` gives each worker its list (and OpenMP places when it has several
    threads), the router the cores left, and a worker whose own flags change its rank count
    (not what the plan was made for) no list; a cluster-wide setting never reaches a child."""
    monkeypatch.setenv(BIND_ENV, "0-1|2")
    monkeypatch.setenv(KV_HUGEPAGES_ENV, "1")  # (the user's choice: no default added)
    cluster, spawned = fake_cluster(
        monkeypatch,
        ["--prefill", "1", "--decode", "1"],
        lambda worlds: CpuPlan([[0, 1], [2]], [3], "0-1|2") if worlds == [1, 1] else None,
    )
    cluster.spawn_worker("prefill", 0)
    cluster.spawn_worker("decode", 0)
    cluster.spawn_worker("decode", 1, ["--tensor-parallel-size", "2"], name="decode-tp")
    cluster.start_router()
    assert "prefill-0 on CPU 0-1, decode-0 on CPU 2; router and Redis on CPU 3" in (
        capsys.readouterr().out
    )
    _, threads, env = spawned["prefill-0"]
    assert threads == 2
    assert env == {BIND_ENV: "0-1", "OMP_PLACES": "{0},{1}", "OMP_PROC_BIND": "close"}
    _, threads, env = spawned["decode-0"]
    assert threads == 1 and env == {BIND_ENV: "2"}
    assert not spawned["decode-tp"][2]
    assert spawned["router"][2] == {BIND_ENV: "3"}
    assert BIND_ENV not in cluster._child_env(1)  # the cluster's "0-1|2" stays with it
    assert cluster._child_env(1, {BIND_ENV: "3"})[BIND_ENV] == "3"


def test_the_lone_worker_gets_the_spill_cpus(monkeypatch, capsys):
    """Colocated on 2 cores: the worker on core 0, its long steps also on core 1 (2 threads
    then, no OpenMP places: the engine thread moves itself), the router on core 1."""
    cluster, spawned = fake_cluster(
        monkeypatch,
        ["--prefill", "0", "--decode", "1"],
        lambda worlds: CpuPlan([[0]], [1], spill=[1]),
    )
    cluster.spawn_worker("decode", 0)
    cluster.start_router()
    assert (
        "decode-0 on CPU 0 (steps of more than 256 tokens, or 4 where the projections are heavy, also on CPU 1)"
        in (capsys.readouterr().out)
    )
    assert spawned["decode-0"][1:] == (2, {BIND_ENV: "0", SPILL_ENV: "1"})
    assert spawned["router"][2] == {BIND_ENV: "1"}
    monkeypatch.setenv(SPILL_ENV, "5")
    assert SPILL_ENV not in cluster._child_env(2)


_PROBE = """
import json, os, threading, time
from shared.cpu_bind import bind_from_env
started = threading.Event()
def idle():
    started.set()
    time.sleep(5)
t = threading.Thread(target=idle, daemon=True)
t.start()
started.wait()
bound = bind_from_env()
later = []
t2 = threading.Thread(target=lambda: later.append(sorted(os.sched_getaffinity(0))))
t2.start(); t2.join()
print(json.dumps({
    "bound": bound,
    "main": sorted(os.sched_getaffinity(0)),
    "earlier_thread": sorted(os.sched_getaffinity(t.native_id)),
    "later_thread": later[0],
}))
"""


def _probe(spec: str, spill: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, **{BIND_ENV: spec, SPILL_ENV: spill})
    return subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_process_pins_every_thread_from_the_environment():
    """Threads that run before the binding move too (``taskset -a``), later ones inherit it."""
    cpu = max(os.sched_getaffinity(0))
    got = json.loads(_probe(str(cpu)).stdout)
    assert got == {"bound": [cpu], "main": [cpu], "earlier_thread": [cpu], "later_thread": [cpu]}
    everything = sorted(os.sched_getaffinity(0))
    for spec in ("auto", "nobind", "0|1"):  # the launcher's settings: nothing to pin here
        got = json.loads(_probe(spec).stdout)
        assert got["bound"] is None and got["main"] == everything


def test_a_cpu_the_process_may_not_use_is_a_clear_error():
    res = _probe("4096")
    assert res.returncode != 0 and "CpuBindError" in res.stderr and "may not use" in res.stderr
    cpu = max(os.sched_getaffinity(0))
    res = _probe(str(cpu), spill="4096")
    assert res.returncode != 0 and SPILL_ENV in res.stderr and "may not use" in res.stderr


def test_spill_cpus_are_the_engine_threads_to_take_not_the_process():
    """With spill CPUs the process still starts on its own CPUs only (the engine thread widens
    itself for long steps, ``ModelRunner``)."""
    cpus = sorted(os.sched_getaffinity(0))
    got = json.loads(_probe(str(cpus[0]), spill=str(cpus[-1])).stdout)
    assert got["bound"] == got["main"] == got["earlier_thread"] == [cpus[0]]


def test_a_sandbox_that_forbids_pinning_runs_the_process_unbound(monkeypatch, caplog):
    """``sched_setaffinity`` refused: a warning, and the process (and its engine, which reads
    the variables next) carries on unbound instead of failing to start."""
    cpu = max(os.sched_getaffinity(0))
    monkeypatch.setenv(BIND_ENV, str(cpu))
    monkeypatch.setenv(SPILL_ENV, str(cpu))

    def refuse(pid, cpus):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    with caplog.at_level("WARNING", logger="shared.cpu_bind"):
        assert bind_from_env() is None
    assert "running unbound" in caplog.text
    assert BIND_ENV not in os.environ and SPILL_ENV not in os.environ
    assert bound_cpus() is None and spill_cpus() == []


@pytest.mark.parametrize(
    ("argv", "user", "want"),
    [
        (["--prefill", "1", "--decode", "1"], None, "0"),  # disaggregated: 4 KiB pages
        (["--prefill", "0", "--decode", "1"], None, None),  # colocated: huge pages (default)
        (["--prefill", "1", "--decode", "1"], "1", None),  # the user's setting wins
    ],
)
def test_disaggregated_workers_keep_the_kv_pool_on_small_pages(monkeypatch, argv, user, want):
    """Huge pages paid on a colocated worker and cost a disaggregated cluster's first token
    (docs/benchmarks.md, "The KV pool on huge pages"): ``pdserve up`` sets the switch off for
    the workers of a cluster with prefill workers, unless the user set it."""
    if user is None:
        monkeypatch.delenv(KV_HUGEPAGES_ENV, raising=False)
    else:
        monkeypatch.setenv(KV_HUGEPAGES_ENV, user)
    cluster, spawned = fake_cluster(monkeypatch, argv, lambda worlds: None)
    roles = ["prefill", "decode"] if argv[1] == "1" else ["decode"]
    for role in roles:
        cluster.spawn_worker(role, 0)
        env = spawned[f"{role}-0"][2]
        assert env.get(KV_HUGEPAGES_ENV) == want, role
        # what the child gets: the launcher's choice, else the user's environment
        assert cluster._child_env(1, env).get(KV_HUGEPAGES_ENV) == (want or user), role
