"""``pdserve up`` supervision: a child that exits is started again after a backoff that doubles
(up to 30 s) and resets once the child stayed up; the rest of the cluster is left alone."""

from __future__ import annotations

import pytest

from shared.cli import launcher
from shared.cli.launcher import Child, Cluster, cluster_args

pytestmark = pytest.mark.unit


class FakeProc:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    pids = iter(range(1000, 2000))
    started: list[list[str]] = []

    def popen(cmd, **kw):
        started.append(cmd)
        return FakeProc(next(pids))

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    c = Cluster(cluster_args(["--run-dir", str(tmp_path), "--restart-backoff", "1"]))
    for name in ("prefill-0", "decode-0", "router"):
        log = tmp_path / f"{name}.log"
        log.write_text("...\n")
        c.children.append(Child(name, FakeProc(next(pids)), log, None, argv=[name, "--x"]))
    c.started = started
    return c


def test_an_exited_child_restarts_after_its_backoff_and_the_others_are_left_alone(cluster):
    dec = cluster.children[1]
    dec.proc.returncode = -9
    t = 100.0
    lines = cluster.supervise(t)
    assert len(lines) == 1 and "decode-0 exited with -9; restarting it in 1.0 s" in lines[0]
    assert cluster.started == [] and dec.restart_at == t + 1
    assert cluster.supervise(t + 0.5) == []  # still waiting
    lines = cluster.supervise(t + 1.0)
    assert lines == [f"[pdserve] decode-0 started again (restart 1, pid {dec.proc.pid})"]
    assert cluster.started[-1][-2:] == ["decode-0", "--x"]  # the same argv
    assert [c.restarts for c in cluster.children] == [0, 1, 0]
    assert "restart 1" in dec.log.read_text()


def test_the_backoff_doubles_up_to_30_s_and_resets_after_a_stable_minute(cluster):
    dec = cluster.children[1]
    t = 0.0
    delays = []
    for _ in range(7):
        dec.proc.returncode = 1
        cluster.supervise(t)
        delays.append(dec.restart_at - t)
        t = dec.restart_at
        cluster.supervise(t)  # restarted
        t += 1.0  # crashes again a second later
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    cluster.supervise(t + 61.0)  # up for a minute
    dec.proc.returncode = 1
    cluster.supervise(t + 62.0)
    assert dec.restart_at - (t + 62.0) == 1.0
