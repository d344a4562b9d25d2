"""``pdserve up`` supervision: a child that exits is started again after a backoff that doubles
(up to 30 s) and resets once the child stayed up; the rest of the cluster is left alone."""

from __future__ import annotations

import pytest

from shared.cli import launcher
from shared.cli.launcher import Child, Cluster, cluster_args
from shared.security import SECRET_ENV, SECRET_FILE_ENV

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


def test_a_restart_that_fails_is_tried_again_later_and_the_others_are_left_alone(
    cluster, monkeypatch
):
    """A restart that raises (fork's EAGAIN, the run dir removed, the interpreter replaced)
    escaped ``supervise`` and ``run`` stopped every healthy child on the way out."""
    dec = cluster.children[1]
    fails = [BlockingIOError(11, "Resource temporarily unavailable")]

    def popen(cmd, **kw):
        if fails:
            raise fails.pop()
        cluster.started.append(cmd)
        return FakeProc(4242)

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    dec.proc.returncode = -9
    cluster.supervise(0.0)
    lines = cluster.supervise(1.0)  # the restart fails: logged, retried after the backoff
    assert len(lines) == 1 and "decode-0 could not be started again (BlockingIOError" in lines[0]
    assert dec.restart_at == 3.0 and cluster.started == []
    assert [c.proc.returncode for c in cluster.children] == [None, -9, None]
    lines = cluster.supervise(3.0)
    assert lines == ["[pdserve] decode-0 started again (restart 2, pid 4242)"]
    # the run dir gone: the child's log cannot be opened; the same
    dec.proc.returncode = 1
    cluster.supervise(10.0)
    for f in cluster.run_dir.iterdir():
        f.unlink()
    cluster.run_dir.rmdir()
    lines = cluster.supervise(20.0)
    assert "could not be started again (FileNotFoundError" in lines[0]


def test_a_closed_stdout_does_not_stop_supervision(cluster, monkeypatch):
    """``pdserve up | tee`` with the tee gone: the "exited" line's print raised BrokenPipeError
    out of ``supervise``, and the launcher stopped the cluster."""

    class Closed:
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(launcher.sys, "stdout", Closed())
    cluster.children[1].proc.returncode = 1
    assert "decode-0 exited with 1" in cluster.supervise(0.0)[0]
    assert cluster.supervise(1.0) == [
        f"[pdserve] decode-0 started again (restart 1, pid {cluster.children[1].proc.pid})"
    ]


def test_a_second_launcher_on_the_same_run_dir_stops_before_touching_it(tmp_path, monkeypatch):
    """It used to write a new cluster secret over the running cluster's, then fail on the
    taken port: every child the running cluster restarted afterwards was refused."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    first = Cluster(cluster_args(["--run-dir", str(tmp_path)]))
    secret = (tmp_path / "cluster-secret").read_text()
    with pytest.raises(launcher.RunDirInUseError, match="belongs to another running"):
        Cluster(cluster_args(["--run-dir", str(tmp_path)]))
    assert (tmp_path / "cluster-secret").read_text() == secret
    first.stop(timeout_s=0.1)  # the lock goes with the first launcher
    second = Cluster(cluster_args(["--run-dir", str(tmp_path)]))
    assert (tmp_path / "cluster-secret").read_text() != secret  # a cluster of its own
    second.stop(timeout_s=0.1)
