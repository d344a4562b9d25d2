"""``shared.subproc``: children that die with their parent, with no Python between fork and exec.

The router tests failed now and then starting a fake worker ("fake worker did not start: ''")
or restarting Redis on its port: their ``Popen`` ran a ``preexec_fn``, and a child forked that
way from a process where grpc.aio is busy dies of SIGSEGV before ``exec`` about half the time
(measured: 5,561 of 10,883 spawns; 0 of 1,723 through ``popen_dying_with_parent``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shared.subproc import _SHIM, dying_with_parent_argv, popen_dying_with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux prctl")


def _wait_exec(pid: int, prog: bytes, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not Path(f"/proc/{pid}/cmdline").read_bytes().startswith(prog):
        assert time.monotonic() < deadline, "the child never ran its command"
        time.sleep(0.01)


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("new_session", [True, False])
def test_the_command_runs_under_the_popen_pid_in_its_own_group(new_session):
    proc = popen_dying_with_parent(["sleep", "30"], new_session=new_session)
    try:
        _wait_exec(proc.pid, b"sleep\0")
        assert os.getpgid(proc.pid) == proc.pid
        assert (os.getsid(proc.pid) == proc.pid) is new_session
    finally:
        proc.kill()
        proc.wait(5)


def test_environment_and_exit_status_pass_through():
    out = subprocess.run(
        dying_with_parent_argv(
            [sys.executable, "-c", "import os, sys; sys.exit(int(os.environ['X']))"]
        ),
        env={**os.environ, "X": "7"},
        check=False,
    )
    assert out.returncode == 7
    proc = popen_dying_with_parent(["sh", "-c", 'exit "$X"'], env={**os.environ, "X": "7"})
    assert proc.wait(10) == 7


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_child_dies_with_its_parent(sig):
    code = (
        "import sys, time\n"
        "from shared.subproc import popen_dying_with_parent\n"
        f"p = popen_dying_with_parent(['sleep', '60'], deathsig={int(sig)})\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        child = int(parent.stdout.readline())
        _wait_exec(child, b"sleep\0")
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # a crash: nothing stops the child
        parent.wait(5)
        parent.stdout.close()
    assert _gone(child), "the child outlived its parent"


def test_a_child_whose_parent_is_already_gone_does_not_run(tmp_path):
    """The parent can die between fork and the shim's prctl; the shim then never execs."""
    marker = tmp_path / "ran"
    not_my_parent = os.getpid()  # the shim's parent is the ``subprocess.run`` below's child
    helper = subprocess.run(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)",
            sys.executable,
            "-I",
            "-S",
            "-c",
            _SHIM,
            str(int(signal.SIGKILL)),
            str(not_my_parent),
            "touch",
            str(marker),
        ],
        check=False,
    )
    assert helper.returncode == 70
    assert not marker.exists()


def test_no_caller_runs_python_between_fork_and_exec(monkeypatch, tmp_path):
    """Every child pdserve and its tests start: embedded Redis, ``pdserve up``'s workers and the
    router tests' fake workers."""
    from shared.cli import launcher
    from shared.directory.embedded import EmbeddedRedis
    from tests.router.router_harness import FakeWorker

    real_popen = subprocess.Popen
    seen: list[list[str]] = []

    def checked_popen(args, *a, **kw):
        assert kw.get("preexec_fn") is None, f"preexec_fn for {args}"
        seen.append(list(args))
        return real_popen(args, *a, **kw)

    monkeypatch.setattr(subprocess, "Popen", checked_popen)
    with EmbeddedRedis() as redis:
        worker = FakeWorker(redis.url, "pdserve:subproc", "w-subproc")
        worker.stop()
    with open(tmp_path / "log", "wb") as log:
        child = launcher._spawn(["--help"], log, dict(os.environ))
    assert child.wait(60) == 0
    assert len(seen) == 3


@pytest.fixture
def busy_grpc_aio():
    """An event loop thread where a grpc.aio server answers 8 clients calling without pause, as
    in a test process that runs routers and fake workers."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    stop = threading.Event()
    calls = [0]

    async def serve() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)

            async def client() -> None:
                while not stop.is_set():
                    await stub.Check(health_pb2.HealthCheckRequest())
                    calls[0] += 1

            await asyncio.gather(*(client() for _ in range(8)))
        await server.stop(None)

    t = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while calls[0] < 100:
        assert time.monotonic() < deadline, "the gRPC clients never ran"
        time.sleep(0.01)
    yield
    stop.set()
    t.join(10)


def test_children_start_while_grpc_aio_is_busy(busy_grpc_aio):
    from shared.directory.embedded import EmbeddedRedis
    from tests.ports import free_port
    from tests.router.router_harness import FakeWorker

    for _ in range(20):
        assert popen_dying_with_parent(["true"]).wait(10) == 0
    port = free_port()
    for _ in range(5):  # a failed start moves Redis to another port
        with EmbeddedRedis(port=port) as redis:
            assert redis.port == port
    with EmbeddedRedis() as redis:
        for i in range(5):
            FakeWorker(redis.url, "pdserve:busy", f"w{i}").stop()
