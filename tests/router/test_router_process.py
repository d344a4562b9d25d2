"""The router as a real ``pdserve router`` process, and its no-torch dependency rule."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from router_harness import MODEL_NAME, ROOT, free_port

PDSERVE = [sys.executable, "-m", "shared.cli"]


def test_router_never_imports_torch(tiny_model):
    code = f"""
import sys
import router.server, router.dispatch, router.serving_chat, router.serving_completions
from router.config import RouterConfig
from router.server import create_app, load_model_files
cfg = RouterConfig(model={str(tiny_model)!r}, served_model_name="tiny", redis_url="redis://127.0.0.1:1")
load_model_files(cfg)
create_app(cfg)
bad = sorted(m for m in ("torch", "transformers", "triton", "ucxx", "kvtransfer") if m in sys.modules)
print("BAD" if bad else "CLEAN", bad)
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("CLEAN"), out.stdout


def _start_router(tiny_model, redis_server, prefix, tmp_path, *extra):
    """``pdserve router`` as a process, healthy; its output goes to a file (a pipe read only
    after exit could fill up and block the router)."""
    port = free_port()
    log = tmp_path / f"router-{port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            PDSERVE
            + [
                "router",
                "--model",
                str(tiny_model),
                "--served-model-name",
                MODEL_NAME,
                "--redis-url",
                redis_server.url,
                "--directory-prefix",
                prefix,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--worker-refresh-interval",
                "0.1",
                "--disable-uvicorn-access-log",
                *extra,
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    try:
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return proc, url, log
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "router never became healthy"
            time.sleep(0.1)
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        raise


@pytest.mark.integration
def test_pdserve_router_process_serves_and_stops(
    tiny_model, make_worker, redis_server, prefix, tmp_path
):
    make_worker("proc-d0")
    proc, url, log = _start_router(tiny_model, redis_server, prefix, tmp_path)
    try:
        import openai

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=20)
        out = client.chat.completions.create(
            model=MODEL_NAME,
            max_tokens=3,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"ignore_eos": True},
        )
        assert out.usage.completion_tokens == 3
        with open(f"/proc/{proc.pid}/maps") as f:
            assert "libtorch" not in f.read()  # the running router has no torch loaded
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught
        assert proc.wait(15) in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@pytest.mark.integration
def test_sigterm_with_a_stream_in_flight_ends_within_the_shutdown_timeout(
    tiny_model, make_worker, redis_server, prefix, tmp_path
):
    """An endless stream does not keep the router alive: SIGTERM closes it after
    ``--shutdown-timeout`` and the process exits."""
    make_worker("proc-slow", token_delay=0.05)
    proc, url, log = _start_router(
        tiny_model, redis_server, prefix, tmp_path, "--shutdown-timeout", "1"
    )
    try:
        body = {
            "model": MODEL_NAME,
            "prompt": "keep going",
            "max_tokens": 2000,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200, resp.read()
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # 2000 x 50 ms
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) in (0, -signal.SIGTERM)
        assert time.monotonic() - t0 < 8
        assert "Application shutdown complete" in log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def test_pdserve_router_rejects_a_bad_model_dir(tmp_path):
    out = subprocess.run(
        PDSERVE
        + ["router", "--model", str(tmp_path / "missing"), "--redis-url", "redis://127.0.0.1:1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert "not a Hugging Face model directory" in out.stderr


def test_pdserve_router_needs_workers_or_redis(tiny_model):
    out = subprocess.run(
        PDSERVE + ["router", "--model", str(tiny_model)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
        env={**os.environ, "PDSERVE_REDIS_URL": ""},
    )
    assert out.returncode == 2 and "--redis-url" in out.stderr


@pytest.mark.integration
@pytest.mark.parametrize("decode_stream", ["mux", "per-request"])
def test_a_router_paused_past_its_timeouts_loses_no_stream_and_cools_no_worker(
    tiny_model, make_worker, redis_server, prefix, tmp_path, decode_stream
):
    """The router process itself stopped (SIGSTOP: a debugger, a paused VM) for longer than
    ``--worker-stall-timeout`` and ``--stall-timeout``, with a stream in flight on the only
    decode worker. On resume the router used to take its own silence for the worker's:
    the stall timer or keepalive failed the call, the worker was excluded and cooled down,
    and with no other decode worker the stream ended in an error and new requests got 503
    for ``--worker-cooldown``. Now the pause is not counted and the stream goes on (resumed
    on the same worker where its call broke): every token once, in order."""
    from router_harness import load_fake_worker_module

    from router.tokenizer import RouterTokenizer

    fw = load_fake_worker_module()
    tok = RouterTokenizer.from_model_dir(tiny_model)
    make_worker("pause-d0", token_delay=0.02)
    proc, url, log = _start_router(
        tiny_model,
        redis_server,
        prefix,
        tmp_path,
        "--worker-stall-timeout",
        "1",
        "--stall-timeout",
        "2",
        "--decode-stream",
        decode_stream,
    )
    prompt = "a router that sleeps"
    try:
        body = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": 200,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        }
        text, errors = [], []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200, resp.read()
            paused = False
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk["error"])
                    continue
                text += [c["text"] for c in chunk["choices"]]
                if not paused and len(text) >= 10:
                    paused = True
                    proc.send_signal(signal.SIGSTOP)
                    # past both stall timeouts (1 s for the mux call, 2 s for the stream);
                    # gRPC's keepalive (3 s pings, 3 s timeouts) may fire too
                    time.sleep(4.5)
                    proc.send_signal(signal.SIGCONT)
        resumed_at = time.monotonic()
        # a new request right after the resume is served by the same (only) worker
        after = httpx.post(
            f"{url}/v1/completions",
            json={"model": MODEL_NAME, "prompt": "and wakes", "max_tokens": 4},
            timeout=30,
        )
        took = time.monotonic() - resumed_at
        expected, _ = fw.expected_output(
            tok.encode(prompt), max_tokens=200, vocab=2048, ignore_eos=True
        )
        assert errors == []
        assert "".join(text) == tok.decode(expected)  # nothing lost, nothing twice
        assert after.status_code == 200, after.text
        assert took < 5, took
        logged = log.read_text()
        assert "cooling down" not in logged, logged
        assert "did not run for" in logged  # the router knew it had been paused
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
