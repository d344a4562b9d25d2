"""Helpers for the kvtransfer tests: the small model's geometry, pools, and peer processes
(``peer.py``) for the UCX integration tests. (A uniquely named module, not conftest, so that
test files can import it.)"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from kvtransfer import KVGeometry
from tests.ports import free_port as free_port  # the tests import it from here

REPO_ROOT = Path(__file__).resolve().parents[2]
PEER = Path(__file__).with_name("peer.py")


def small_geometry(**overrides) -> KVGeometry:
    """The "small" model: Llama, 4 layers, 4 KV heads, head_dim 32, bf16, block 16 = 32 KiB."""
    fields = {
        "model": "tiny-llama",
        "dtype": "bfloat16",
        "block_size": 16,
        "num_layers": 4,
        "num_kv_heads": 4,
        "head_dim": 32,
    }
    fields.update(overrides)
    return KVGeometry(**fields)


def random_pool(num_blocks: int, geometry: KVGeometry, seed: int) -> np.ndarray:
    """A raw-byte pool (numpy uint8) filled with seeded random bytes."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=num_blocks * geometry.block_bytes, dtype=np.uint8)


def block_bytes_of(pool: np.ndarray, geometry: KVGeometry, block: int) -> bytes:
    bb = geometry.block_bytes
    return pool[block * bb : (block + 1) * bb].tobytes()


class Peer:
    """A ``peer.py`` process in its own process group; every read is bounded by a timeout."""

    def __init__(
        self, role: str, geometry: KVGeometry, num_blocks: int, *args: str, timeout: float = 60.0
    ):
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  (closed in close())
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(PEER),
                role,
                json.dumps(geometry.to_wire()),
                str(num_blocks),
                *args,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            cwd=REPO_ROOT,
            env=env,
            start_new_session=True,
        )
        self._lines: queue.Queue = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        ready = self.read(timeout)
        assert ready["event"] == "ready", ready
        self.address = bytes.fromhex(ready["address"]) if ready["address"] else None

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self._lines.put(line)
            else:  # UCX logs to stdout
                self.log.append(line)
        self._lines.put(None)

    def stderr_tail(self) -> str:
        self._stderr.seek(0)
        return "".join(self.log)[-2000:] + self._stderr.read()[-3000:]

    def read(self, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"peer gave no answer within {timeout}s; stderr:\n{self.stderr_tail()}"
            ) from None
        if line is None:
            raise AssertionError(
                f"peer exited (rc={self.proc.poll()}); stderr:\n{self.stderr_tail()}"
            )
        return json.loads(line)

    def send(self, cmd: dict) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def request(self, cmd: dict, timeout: float = 30.0) -> dict:
        self.send(cmd)
        return self.read(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "quit"})
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        self._stderr.close()


def block_digests(pool: np.ndarray, geometry: KVGeometry, ids: list[int]) -> list[str]:
    """blake2b of each listed block (independent of the xxh3 checksums under test)."""
    import hashlib

    return [
        hashlib.blake2b(block_bytes_of(pool, geometry, b), digest_size=16).hexdigest() for b in ids
    ]


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP process group ``pid`` and return once every thread of ``pid`` is stopped
    (``/proc``'s state ``T``): ``killpg`` only queues the signal, and a thread still running
    on a descheduled vCPU of a loaded host could answer one more message first."""
    os.killpg(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
        if states and all(s in ("T", "t") for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped: {states}"
        time.sleep(0.001)
