"""The router's port under ``pdserve up``: held by the launcher from its start (no worker's
ephemeral port can take it), handed to every router process it starts, and a port that is
taken is a clear start-up error before any worker starts.

Found in a benchmark run (2026-12-05): ``--port`` had been picked free from the ephemeral
range, the decode worker's gRPC server was then given that same port by the kernel, the
router could not bind it, and ``pdserve up`` died with ``http.client.BadStatusLine`` from its
health check, which had reached the worker's HTTP/2 server.

Also here, the start-up's other wait: a stop asked for while the workers load ends it."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from shared.cli import launcher
from shared.cli.launcher import Child, Cluster, cluster_args
from tests.ports import free_port


class FakeProc:
    def __init__(self, pid: int, polls_until_exit: int | None = None) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._left = polls_until_exit

    def poll(self) -> int | None:
        if self._left is not None:
            self._left -= 1
            if self._left <= 0:
                self.returncode = 1
        return self.returncode


@pytest.mark.unit
def test_the_router_port_is_held_from_the_start_and_passed_to_the_router(tmp_path, monkeypatch):
    started: list[dict] = []

    def popen(cmd, **kw):
        started.append({"cmd": cmd, **kw})
        return FakeProc(4242)

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    monkeypatch.setattr(Cluster, "_wait_http", lambda self, child, url: None)
    port = free_port()
    argv = ["--run-dir", str(tmp_path), "--port", str(port), "--model", "m"]
    c = Cluster(cluster_args([*argv, "--redis-url", "redis://127.0.0.1:1/0"]))
    try:
        sock = c.listen()
        assert c.listen() is sock  # once
        with socket.socket() as other, pytest.raises(OSError):
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            other.bind(("127.0.0.1", port))  # nothing else can have it now
        # clients can connect before the router runs (they wait in the backlog)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        assert c.start_router() == f"http://127.0.0.1:{port}"
        call = started[-1]
        fd = sock.fileno()
        assert call["pass_fds"] == (fd,)
        argv = call["cmd"]
        assert argv[argv.index("--fd") + 1] == str(fd)
        router = next(ch for ch in c.children if ch.name == "router")
        router.proc.returncode = 1  # it dies: restarted on the same socket
        c.supervise(0.0)
        c.supervise(1e9)
        assert started[-1]["pass_fds"] == (fd,) and started[-1]["cmd"] == call["cmd"]
    finally:
        c.children.clear()
        c.stop()
    assert c.listener is None
    with socket.socket() as again:  # released at stop
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))


@pytest.mark.unit
def test_port_zero_takes_the_port_the_system_chose(tmp_path):
    c = Cluster(cluster_args(["--run-dir", str(tmp_path), "--port", "0"]))
    try:
        c.listen()
        assert c.args.port == c.listener.getsockname()[1] > 0
    finally:
        c.stop()


@pytest.mark.unit
def test_the_health_check_outlives_a_server_that_does_not_speak_http(tmp_path):
    """Before: ``http.client.BadStatusLine`` escaped ``_wait_http`` (it is not an OSError),
    a traceback instead of the child's exit and log."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    port = srv.getsockname()[1]
    stop = threading.Event()

    def answer() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.recv(1024)
                conn.sendall(b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x07\x00\x00\x00\x00\x00")

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        c = Cluster(cluster_args(["--run-dir", str(tmp_path), "--startup-timeout", "30"]))
        log = tmp_path / "router.log"
        log.write_text("ERROR: [Errno 98] address already in use\n")
        child = Child("router", FakeProc(1, polls_until_exit=3), log)  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="(?s)router exited with 1.*address already in use"):
            c._wait_http(child, f"http://127.0.0.1:{port}/health")
    finally:
        stop.set()
        t.join(5)
        srv.close()


@pytest.mark.integration
def test_pdserve_up_on_a_taken_port_fails_at_once_and_starts_no_worker(tmp_path):
    """Before: the workers started, and the launcher died of the health check's traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        run = tmp_path / "run"
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "shared.cli",
                "up",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--run-dir",
                str(run),
                "--kv-cache-memory",
                "64MiB",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"failed to start: the router cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert not list(run.glob("decode-*.log")) and not list(run.glob("prefill-*.log"))


@pytest.mark.unit
def test_a_stop_asked_for_while_workers_start_ends_the_wait_at_once(tmp_path):
    """Ctrl-C while the workers loaded used to wait for every one of them to be ready (and
    for the router), minutes for a large model; now the wait ends at its next poll."""
    c = Cluster(cluster_args(["--run-dir", str(tmp_path), "--startup-timeout", "20"]))
    loading = Child(
        "decode-0",
        FakeProc(7),  # type: ignore[arg-type]
        tmp_path / "decode-0.log",
        tmp_path / "decode-0.ready.json",  # never written: still loading
    )
    timer = threading.Timer(0.3, lambda: setattr(c, "stop_requested", True))
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(launcher.StartInterrupted, match="decode-0 not ready yet"):
            c.wait_ready([loading])
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 3.0
    c.stop_requested = True
    with pytest.raises(launcher.StartInterrupted, match="router not ready yet"):
        c._wait_http(Child("router", FakeProc(8), tmp_path / "r.log"), "http://127.0.0.1:1/")  # type: ignore[arg-type]


@pytest.mark.integration
def test_pdserve_up_stops_at_once_when_interrupted_while_starting(tmp_path):
    """SIGINT to ``pdserve up`` while its worker starts: it stops then, without starting the
    router, and exits 0."""
    import signal

    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "up", "--port", "0", "--run-dir", str(run)]
        + ["--kv-cache-memory", "64MiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (run / "decode-0.log").exists():  # the worker has been started
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "stop asked for while starting (decode-0 not ready yet)" in out
    assert "Ctrl-C to stop" not in out and not (run / "router.log").exists()
