"""Helpers shared by the router tests: fake decode worker processes and in-process routers.

Fake workers run as subprocesses (own process group, killed on teardown); routers run as
uvicorn servers in a thread of the test process on a free port, so tests can reach into their
state. The fake worker module is loaded by path under a unique name (other test directories
may have their own ``fake_worker.py``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx

from shared.subproc import popen_dying_with_parent
from tests.ports import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MODEL_NAME = "tiny"


def _process_state(pid: int) -> str:
    """What a child that did not answer is doing: its command line (the parent's, if it never
    reached ``exec``) and the kernel function it sleeps in."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200]
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError as e:
        return f"no /proc state: {e}"
    return f"cmdline {cmdline.decode(errors='replace')!r}, wchan {wchan!r}"


class FakeWorker:
    """A ``tests/router/fake_worker.py`` subprocess."""

    def __init__(self, redis_url: str | None, prefix: str, worker_id: str, **opts) -> None:
        self.worker_id = worker_id
        cmd = [
            sys.executable,
            str(HERE / "fake_worker.py"),
            "--model",
            MODEL_NAME,
            "--worker-id",
            worker_id,
            "--prefix",
            prefix,
        ]
        if redis_url:
            cmd += ["--redis-url", redis_url]
        for k, v in opts.items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            prefix=f"fake-{worker_id}-", suffix=".log"
        )
        self.proc = popen_dying_with_parent(
            cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT
        )
        line = self._readline(timeout=20)
        if not line.startswith("READY "):
            where = _process_state(self.proc.pid)
            self.kill()
            raise RuntimeError(f"fake worker did not start: {line!r} ({where}) {self.stderr()}")
        self.port = int(line.split()[1])
        self.address = f"127.0.0.1:{self.port}"

    def _readline(self, timeout: float) -> str:
        out: list[str] = []
        t = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        return out[0].strip() if out else ""

    def stderr(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def stats(self):
        import grpc

        from shared.proto import pdserve_pb2 as pb
        from shared.proto import pdserve_pb2_grpc as pb_grpc

        with grpc.insecure_channel(self.address) as ch:
            return pb_grpc.DecodeWorkerStub(ch).Stats(pb.StatsRequest(), timeout=5)

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self.proc.stdout:
            self.proc.stdout.close()
        self.log.close()


class RouterThread:
    """A router app served by uvicorn in a background thread."""

    def __init__(self, config) -> None:
        import uvicorn

        from router.server import create_app

        self.port = free_port()  # never the config's default (8000 may be taken)
        self.config = replace(config, port=self.port, host="127.0.0.1")
        self.app = create_app(self.config)
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                access_log=False,
                # as ``pdserve router`` (--shutdown-timeout), but short: a connection a test
                # left open must not hold the teardown up
                timeout_graceful_shutdown=2,
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("router did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def ctx(self):
        return self.app.state.ctx

    def wait_workers(
        self, n_decode: int, timeout: float = 10.0, n_prefill: int | None = None
    ) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            body = httpx.get(f"{self.url}/health", timeout=5).json()
            if body["decode_workers"] == n_decode and (
                n_prefill is None or body["prefill_workers"] == n_prefill
            ):
                return
            time.sleep(0.05)
        raise TimeoutError(f"router did not see {n_decode} decode workers: {body}")

    def wait_waiting(self, worker_id: str, waiting: int, timeout: float = 10.0) -> None:
        """Until the router's pool holds a load report of ``worker_id`` with ``waiting``
        requests waiting (routing reads the reports, which come every refresh)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pool = self.ctx.dispatcher.pool
            if any(r.worker_id == worker_id and r.load.waiting == waiting for r in pool.records()):
                return
            time.sleep(0.02)
        raise TimeoutError(f"the router has no report of {worker_id} with {waiting} waiting")

    def openai(self, **kw):
        import openai

        return openai.OpenAI(
            base_url=f"{self.url}/v1",
            api_key=kw.pop("api_key", "none"),
            max_retries=0,
            timeout=kw.pop("timeout", 30),
            **kw,
        )

    def metric(self, name: str, **labels) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        total = 0.0
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    def stop(self) -> None:
        """Stop serving and wait for the app's clean-up; a router thread still running after
        15 s fails the test instead of outliving it."""
        self.server.should_exit = True
        self.thread.join(15)
        if self.thread.is_alive():
            raise RuntimeError(f"router on port {self.port} did not stop within 15 s")


def load_fake_worker_module():
    """``tests/router/fake_worker.py`` as a module (for ``expected_output`` and friends)."""
    name = "pdserve_router_tests_fake_worker"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "fake_worker.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


@contextlib.contextmanager
def router_with_one_worker(
    model_dir, redis_url: str, tag: str, worker_opts: dict | None = None, **config
):
    """A fake decode worker registered under a fresh prefix and a router thread that sees it
    (``worker_opts``: the fake worker's flags; ``config``: RouterConfig fields beyond the
    defaults here); both stopped afterwards."""
    import uuid

    from router.config import RouterConfig

    prefix = f"{tag}{uuid.uuid4().hex[:6]}:"
    worker = FakeWorker(redis_url, prefix, f"{tag}-d0", **(worker_opts or {}))
    router = None
    try:
        router = RouterThread(
            RouterConfig(
                model=str(model_dir),
                served_model_name=MODEL_NAME,
                redis_url=redis_url,
                directory_prefix=prefix,
                worker_refresh_interval_s=0.1,
                **config,
            )
        )
        router.wait_workers(1)
        yield router
    finally:
        if router is not None:
            router.stop()
        worker.stop()


# A streamed request too big to sit in the sockets' buffers: 8 samples x 3000 tokens x ~600 B
# of SSE (20 top logprobs) is ~14 MB, more than the kernel buffers (up to 4 MiB each way) hold,
# so the router's sends block on a client that stops reading.
SLOW_READER_BODY = {
    "model": MODEL_NAME,
    "prompt": "slow reader",
    "max_tokens": 3000,
    "stream": True,
    "n": 8,
    "logprobs": 20,
    "temperature": 0,
    "ignore_eos": True,
}


def stalled_stream(port: int, body: dict) -> tuple[socket.socket, bytes]:
    """POST a streaming request over a socket with a 4 KiB receive buffer and read its first
    bytes; the caller then stops reading for as long as it likes (returns the socket and what
    was read)."""
    payload = json.dumps(body).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
        + payload
    )
    return s, s.recv(4096)


def read_to_end(s: socket.socket, timeout: float = 60) -> bytes:
    """The rest of a :func:`stalled_stream`'s response; closes the socket."""
    s.settimeout(timeout)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    return data
