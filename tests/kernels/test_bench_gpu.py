"""``kernels/bench_gpu.py`` runs its whole code path on the CPU (``--dry-run``, interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kernels

ROOT = Path(kernels.__file__).resolve().parent.parent
SCRIPT = ROOT / "kernels" / "bench_gpu.py"


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def test_help_parses_without_a_gpu():
    proc = _run("--help", timeout=60)
    assert proc.returncode == 0 and "--dry-run" in proc.stdout and "--peak-gbps" in proc.stdout


def test_dry_run_checks_every_kernel_on_cpu():
    proc = _run("--dry-run", "--skip-e2e", timeout=170)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    for needle in (
        "write_kv",
        "decode split-K=8",
        "prefill/mixed",
        "int64 offsets",
        "decode-bw",
        "SUMMARY",
    ):
        assert needle in out, needle
    assert "FAIL" not in out
    passed = [line for line in out.splitlines() if line.startswith("PASS")]
    assert len(passed) >= 21, out[-3000:]


@pytest.mark.slow
def test_dry_run_end_to_end_through_the_engine():
    """The e2e phase drives shared.engine.LLM with the Triton backend (interpreted)."""
    proc = _run("--dry-run", timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tiny model, triton kv=auto" in proc.stdout and "decode tok/s" in proc.stdout
