"""A worker that cannot start (a bad model directory, an unreadable cluster secret) says why in
one line on stderr and exits with status 2, as the router does: no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize(
    "flags,message",
    [
        (["--cluster-secret-file", "/nonexistent/secret"], "cannot read --cluster-secret-file"),
        (["--model", "/nonexistent/model"], "is not a Hugging Face model directory"),
    ],
    ids=["secret", "model"],
)
def test_a_worker_that_cannot_start_says_why_and_exits_2(tiny_llama, role, flags, message):
    argv = [sys.executable, "-m", "shared.cli", role, "--model", str(tiny_llama), *flags]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"pdserve {role}: error: " in p.stderr and message in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_bad_nixl_progress_period_says_why_and_exits_2(tiny_llama, role):
    argv = [sys.executable, "-m", "shared.cli", role, "--model", str(tiny_llama)]
    argv += ["--kv-transport", "nixl"]
    env = {**os.environ, "PDSERVE_NIXL_PROGRESS_US": "soon"}
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"pdserve {role}: error: --kv-transport nixl: PDSERVE_NIXL_PROGRESS_US='soon'" in (
        p.stderr
    ), p.stderr[-2000:]
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize(
    "var,value",
    [
        ("PDSERVE_SPILL_KV_TOKENS", "1.5"),
        ("PDSERVE_SMALL_STEP_TOKENS", "many"),
        ("PDSERVE_NUM_THREADS", "0"),
    ],
)
def test_a_bad_engine_environment_number_says_why_and_exits_2(tiny_llama, var, value):
    """Found in review: these were read with a bare ``int()``, so a typo was a ValueError
    traceback from inside the model runner."""
    argv = [sys.executable, "-m", "shared.cli", "decode", "--model", str(tiny_llama)]
    env = {**os.environ, var: value}
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"pdserve decode: error: {var}={value!r}: expected an integer" in p.stderr, p.stderr[
        -2000:
    ]
    assert "Traceback" not in p.stderr
