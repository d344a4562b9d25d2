"""``pdserve up`` as users run it: a subprocess, an OpenAI SDK chat request, a clean stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import openai
import psutil
import pytest

from tests.cluster_utils import free_port, wait_until

pytestmark = pytest.mark.integration


def test_pdserve_up_serves_chat_and_stops_cleanly(tmp_path):
    port = free_port()
    env = dict(os.environ, PDSERVE_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    log = open(tmp_path / "up.log", "w+")  # noqa: SIM115 - read while the process runs
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shared.cli",
            "up",
            "--port",
            str(port),
            "--kv-cache-memory",
            "64MiB",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:

        def banner():
            log.seek(0)
            text = log.read()
            if proc.poll() is not None:
                raise AssertionError(f"pdserve up exited early:\n{text}")
            return text if "Ctrl-C to stop" in text else None

        text = wait_until(banner, timeout=240, interval=0.5, what="pdserve up to print its banner")
        assert f"http://127.0.0.1:{port}/v1" in text and "/dashboard" in text
        assert text.count("KV cache:") == 2, "one capacity line per worker"
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 4, "redis + router + prefill + decode"

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        model = client.models.list().data[0].id
        resp = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say hello to the cluster."}],
            max_tokens=8,
            temperature=0,
        )
        assert resp.choices[0].finish_reason in ("length", "stop")
        assert isinstance(resp.choices[0].message.content, str)
        assert 1 <= resp.usage.completion_tokens <= 8 and resp.usage.prompt_tokens > 5

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        log.seek(0)
        assert "[pdserve] stopped" in log.read()
        time.sleep(0.5)
        alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"processes left behind: {[c.cmdline() for c in alive]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
