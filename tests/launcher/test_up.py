"""``pdserve up`` as users run it: a subprocess, an OpenAI SDK chat request, a clean stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import openai
import psutil
import pytest

from shared.cpu_bind import plan_cpus
from tests.cluster_utils import free_port, wait_until

pytestmark = pytest.mark.integration


def assert_bound(pid: int, cpus: list[int] | None, spill: list[int] | None = None) -> None:
    """``pid`` runs on exactly ``cpus`` (``None``: on every CPU), and so do its threads but
    those of the engine, which may also take ``spill`` (a long step's, shared/cpu_bind.py)."""
    want = set(cpus) if cpus is not None else os.sched_getaffinity(0)
    assert os.sched_getaffinity(pid) == want
    for t in psutil.Process(pid).threads():
        got = os.sched_getaffinity(t.id)
        assert want <= got <= want | set(spill or []), (pid, t.id, got)


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
            "--prefill",  # disaggregated (on 2 cores the default is one colocated worker)
            "1",
            "--enable-auto-tool-choice",  # passed on to the router (else tools below are a 400)
            "--tool-call-parser",
            "hermes",
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
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        auto = client.chat.completions.create(  # tool_choice "auto": the router's parser
            model=model, messages=[{"role": "user", "content": "hi"}], tools=tools, max_tokens=4
        )
        assert auto.choices[0].finish_reason in ("length", "stop", "tool_calls")

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


def test_pdserve_up_restarts_a_killed_worker_and_keeps_running(tmp_path):
    """kill -9 of the decode worker: ``pdserve up`` starts it again (the cluster is not
    stopped), it registers again and serves; only Ctrl-C / SIGTERM ends ``pdserve up``."""
    port = free_port()
    env = dict(os.environ, PDSERVE_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    log = open(tmp_path / "up.log", "w+")  # noqa: SIM115 - read while the process runs
    run_dir = tmp_path / "run"
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
            str(run_dir),
            "--restart-backoff",
            "0.5",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )

    def text() -> str:
        log.seek(0)
        return log.read()

    try:
        wait_until(
            lambda: "Ctrl-C to stop" in text() or proc.poll() is not None,
            timeout=240,
            interval=0.5,
            what="pdserve up to start",
        )
        assert proc.poll() is None, text()
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
        )
        model = client.models.list().data[0].id
        first = json.loads((run_dir / "decode-0.ready.json").read_text())["pid"]
        plan = plan_cpus([1])  # colocated on this few cores: what the launcher made
        assert_bound(first, plan.workers[0] if plan else None, plan.spill if plan else None)
        children = psutil.Process(proc.pid).children(recursive=True)
        router = next(c for c in children if "router" in c.cmdline())
        redis = next(c for c in children if "redis-server" in c.name())
        for other in (router, redis):
            assert_bound(other.pid, plan.others if plan and plan.others else None)
        os.kill(first, signal.SIGKILL)
        wait_until(
            lambda: "decode-0 ready again (restart 1)" in text(),
            timeout=120,
            interval=0.5,
            what="the decode worker to be restarted",
        )
        assert proc.poll() is None, "pdserve up must keep running"
        assert "decode-0 exited with -9" in text()
        second = json.loads((run_dir / "decode-0.ready.json").read_text())["pid"]
        assert second != first and psutil.pid_exists(second)
        # the same cores again
        assert_bound(second, plan.workers[0] if plan else None, plan.spill if plan else None)

        def served():
            try:
                r = client.completions.create(
                    model=model, prompt="again", max_tokens=4, temperature=0
                )
            except openai.APIError:
                return None  # the router has not seen the new registration yet
            return r.usage.completion_tokens == 4

        assert wait_until(served, timeout=30, interval=0.5, what="a request served after it")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
