"""How ``pdserve up`` lays a cluster out on the machine's cores, and when a worker's small
steps run on one thread (docs/benchmarks.md, "Topology")."""

from __future__ import annotations

import pytest
import torch

from shared.cli import launcher
from shared.cli.launcher import cluster_args, resolve_topology
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
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    cpu = torch.device("cpu")
    assert small_step_tokens(cpu, 2) == SMALL_STEP_TOKENS  # 2 threads on 2 cores
    assert small_step_tokens(cpu, 1) == 0  # one thread already
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert small_step_tokens(cpu, 2) == 0  # cores to spare: both threads always
    assert small_step_tokens(torch.device("cuda"), 8) == 0
    monkeypatch.setenv("PDSERVE_SMALL_STEP_TOKENS", "0")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert small_step_tokens(cpu, 2) == 0
    monkeypatch.setenv("PDSERVE_SMALL_STEP_TOKENS", "16")
    assert small_step_tokens(cpu, 8) == 16
