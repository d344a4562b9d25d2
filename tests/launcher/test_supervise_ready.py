"""``pdserve up`` supervision of a restart that never becomes ready: the first start had
``--startup-timeout`` to write its ready file (``wait_ready``); a restarted child gets as long,
then its process group (it and its TP/PP ranks) is killed and it is restarted after its
backoff. It used to stay up, never ready, for ever (a rank of it that never joined)."""

from __future__ import annotations

import signal

import pytest

from shared.cli import launcher
from shared.cli.launcher import Child, Cluster, cluster_args
from tests.launcher.test_supervise import FakeProc

pytestmark = pytest.mark.unit


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    pids = iter(range(1000, 2000))
    killed: list[tuple[int, int]] = []

    def popen(cmd, **kw):
        return FakeProc(next(pids))

    def killpg(pid, sig):
        killed.append((pid, sig))
        for c in cl.children:  # the group dies
            if c.proc.pid == pid:
                c.proc.returncode = -sig

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    monkeypatch.setattr(launcher.os, "killpg", killpg)
    cl = Cluster(
        cluster_args(
            ["--run-dir", str(tmp_path), "--restart-backoff", "1", "--startup-timeout", "100"]
        )
    )
    log = tmp_path / "decode-0.log"
    log.write_text("...\n")
    ready = tmp_path / "decode-0.ready.json"
    cl.children.append(Child("decode-0", FakeProc(next(pids)), log, ready, argv=["decode", "--x"]))
    cl.killed = killed
    return cl


def test_a_restart_not_ready_within_the_startup_timeout_is_killed_and_restarted(cluster):
    dec = cluster.children[0]
    dec.proc.returncode = 1
    cluster.supervise(0.0)  # noticed
    cluster.supervise(1.0)  # restarted (restart 1), not ready yet
    first = dec.proc
    assert dec.restarts == 1 and not dec.announced_ready and first.returncode is None
    assert cluster.supervise(50.0) == [] and cluster.killed == []
    lines = cluster.supervise(101.5)  # --startup-timeout (100 s) after the restart
    assert len(lines) == 1 and "decode-0 not ready 100 s after restart 1" in lines[0]
    assert cluster.killed == [(first.pid, signal.SIGKILL)]
    lines = cluster.supervise(102.0)  # exited (killed): restarted after the backoff
    assert "decode-0 exited with -9; restarting it in 2.0 s" in lines[0]
    cluster.supervise(104.0)
    assert dec.restarts == 2 and dec.proc is not first and dec.proc.returncode is None


def test_a_restart_that_becomes_ready_in_time_is_left_alone(cluster):
    dec = cluster.children[0]
    dec.proc.returncode = 1
    cluster.supervise(0.0)
    cluster.supervise(1.0)
    dec.ready_file.write_text('{"grpc": "127.0.0.1:1"}')
    lines = cluster.supervise(90.0)
    assert lines == ["[pdserve] decode-0 ready again (restart 1) gRPC 127.0.0.1:1"]
    assert cluster.supervise(500.0) == [] and cluster.killed == []


def test_the_first_start_is_left_to_wait_ready(cluster):
    """The first start's bound is ``wait_ready``'s (it fails ``pdserve up``): supervision
    does not kill a child that has not been restarted."""
    assert cluster.supervise(1000.0) == [] and cluster.killed == []
