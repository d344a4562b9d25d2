"""Fixtures for the bench tests: a tiny model dir (for its tokenizer) and a mock server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.ports import free_port as _free_port

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def bench_model(tmp_path_factory) -> Path:
    """``pdserve make-tiny-model DIR`` once per session (the bench only needs its tokenizer)."""
    path = tmp_path_factory.mktemp("bench") / "tiny"
    subprocess.run(
        [sys.executable, "-m", "shared.cli", "make-tiny-model", str(path)],
        check=True,
        timeout=120,
        capture_output=True,
    )
    return path


@pytest.fixture(scope="session")
def mock_url(bench_model) -> str:
    """Base URL of the mock OpenAI server, running in its own process group."""
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "mock_openai_server.py"),
            "--port",
            str(port),
            "--model-dir",
            str(bench_model),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mock server exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("mock server did not become healthy in 60 s") from None
                time.sleep(0.1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture
def mock_get(mock_url):
    """``mock_get(path)`` -> the mock's JSON answer to ``GET path``."""

    def get(path: str):
        with urllib.request.urlopen(mock_url + path, timeout=10) as r:
            return json.loads(r.read())

    return get


@pytest.fixture
def free_port() -> int:
    return _free_port()


@pytest.fixture
def bench(bench_model, mock_url, tmp_path, capsys):
    """``bench(*args, model_name=...) -> (rc, stdout, results dict | None)``.

    Runs ``pdserve bench`` in-process against the mock with a JSON result in ``tmp_path``.
    """
    from shared.cli import main

    def run(*args: str, model_name: str = "mock", save: bool = True):
        argv = [
            "bench",
            "--model",
            str(bench_model),
            "--base-url",
            mock_url,
            "--served-model-name",
            model_name,
            "--disable-tqdm",
            "--seed",
            "1",
            *args,
        ]
        if save:
            argv += ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
        rc = main(argv)
        out = capsys.readouterr()
        path = tmp_path / "r.json"
        result = json.loads(path.read_text()) if save and path.exists() else None
        if path.exists():
            path.unlink()
        return rc, out.out + out.err, result

    return run
