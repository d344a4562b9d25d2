"""How ``pdserve up`` lays a cluster out on the machine's cores, and when a worker's small
steps run on one thread (docs/benchmarks.md, "Topology")."""

from __future__ import annotations

import pytest
import torch

from shared.cli import launcher
from shared.cli.launcher import cluster_args, resolve_topology
from shared.cpu_bind import BIND_ENV, HEAVY_SPILL_STEP_TOKENS, SPILL_ENV, SPILL_STEP_TOKENS
from shared.engine.model_runner import SMALL_STEP_TOKENS, small_step_tokens

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "cores,argv,prefill,said",
    [
        (2, [], 0, "colocated"),
        (1, [], 0, "colocated"),
        (8, [], 1, "1 prefill + 1 decode"),
        (2, ["--prefill", "1"], 1, None),  # told otherwise
        (16, ["--prefill", "0"], 0, None),
    ],
)
def test_the_default_topology_follows_the_core_count(monkeypatch, cores, argv, prefill, said):
    monkeypatch.setattr(launcher, "usable_cores", lambda: cores)
    args = cluster_args(argv)
    note = resolve_topology(args)
    assert args.prefill == prefill
    assert (note is None) == (said is None)
    if said:
        assert said in note and f"{cores} cores" in note


def test_small_steps_run_on_one_thread_only_when_the_worker_takes_every_core(monkeypatch):
    monkeypatch.delenv("PDSERVE_SMALL_STEP_TOKENS", raising=False)
    monkeypatch.delenv(BIND_ENV, raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    cpu = torch.device("cpu")
    assert small_step_tokens(cpu, 2) == SMALL_STEP_TOKENS  # 2 threads on 2 cores
    assert small_step_tokens(cpu, 1) == 0  # one thread already
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert small_step_tokens(cpu, 2) == 0  # cores to spare: both threads always
    assert small_step_tokens(torch.device("cuda"), 8) == 0
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setenv(BIND_ENV, "0-1")  # bound to cores of its own: nothing else runs there
    assert small_step_tokens(cpu, 2) == 0
    monkeypatch.delenv(BIND_ENV)
    monkeypatch.setenv("PDSERVE_SMALL_STEP_TOKENS", "0")
    assert small_step_tokens(cpu, 2) == 0
    monkeypatch.setenv("PDSERVE_SMALL_STEP_TOKENS", "16")
    assert small_step_tokens(cpu, 8) == 16


@pytest.mark.parametrize(
    "argv,ranks,threads",
    [
        (["--prefill", "1", "--decode", "1"], 2, 4),
        (["--prefill", "1", "--decode", "1", "--tensor-parallel-size", "2"], 4, 2),
        (["--prefill", "1", "--decode", "2", "--decode-arg=--tensor-parallel-size=2"], 5, 1),
        (["--prefill", "2", "--decode", "1", "--prefill-arg=-tp=2", "--worker-arg=-pp=2"], 10, 1),
        (["--prefill", "0", "--decode", "1", "-tp", "4"], 4, 2),
    ],
)
def test_worker_threads_split_the_cores_over_every_rank(monkeypatch, argv, ranks, threads):
    """Without CPU binding, `pdserve up` gives each rank process of each worker its share of
    the cores, counting TP x PP from the common and the per-role flags."""
    monkeypatch.setenv(BIND_ENV, "nobind")
    monkeypatch.setattr(launcher, "usable_cores", lambda: 8)
    cluster = launcher.Cluster.__new__(launcher.Cluster)
    cluster.args = cluster_args(["--model", "m", *argv])
    spawned = {}
    monkeypatch.setattr(cluster, "start_redis", lambda: "redis://127.0.0.1:1")
    monkeypatch.setattr(
        cluster,
        "_spawn",
        lambda name, argv, threads, env=None: spawned.setdefault(name, (argv, threads, env)),
    )
    assert cluster.num_ranks() == ranks
    cluster.spawn_worker("prefill", 0)
    cluster.spawn_worker("decode", 0)
    assert spawned["prefill-0"][1] == spawned["decode-0"][1] == threads
    for name in ("prefill-0", "decode-0"):  # no CPU list (nor OpenMP places)
        assert not {BIND_ENV, "OMP_PLACES", "OMP_PROC_BIND"} & set(spawned[name][2]), name
    prefill_argv, decode_argv = spawned["prefill-0"][0], spawned["decode-0"][0]
    for flag in cluster.args.prefill_arg:
        assert flag in prefill_argv and flag not in decode_argv
    for flag in cluster.args.decode_arg:
        assert flag in decode_argv and flag not in prefill_argv


def test_a_lone_workers_steps_spill_from_fewer_tokens_where_projections_are_heavy(monkeypatch):
    """With spill CPUs a lone worker keeps decode steps (up to 256 tokens) on its own CPU;
    where its projections are heavy (the avx2 linear plan: bf16 widened to fp32 FMAs) only
    steps of up to 4 tokens: the rest take the router's CPU too. The override still wins, and
    a worker that is not a lone bound one keeps its rule whatever its projections."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setenv(BIND_ENV, "0")
    monkeypatch.setenv(SPILL_ENV, "1")
    monkeypatch.delenv("PDSERVE_SMALL_STEP_TOKENS", raising=False)
    cpu = torch.device("cpu")
    assert small_step_tokens(cpu, 2) == SPILL_STEP_TOKENS == 256
    assert small_step_tokens(cpu, 2, heavy=True) == HEAVY_SPILL_STEP_TOKENS == 4
    assert small_step_tokens(cpu, 1, heavy=True) == 0  # one thread: nothing to narrow
    monkeypatch.setenv("PDSERVE_SMALL_STEP_TOKENS", "32")
    assert small_step_tokens(cpu, 2, heavy=True) == 32
    monkeypatch.delenv("PDSERVE_SMALL_STEP_TOKENS")
    monkeypatch.delenv(SPILL_ENV)  # bound, no spill CPUs: every step on its own cores
    assert small_step_tokens(cpu, 2, heavy=True) == small_step_tokens(cpu, 2) == 0
    monkeypatch.delenv(BIND_ENV)  # unbound, its threads take every core: the few-token rule
    assert small_step_tokens(cpu, 2, heavy=True) == small_step_tokens(cpu, 2)
    assert small_step_tokens(cpu, 2) == SMALL_STEP_TOKENS
