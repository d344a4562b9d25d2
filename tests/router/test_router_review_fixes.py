"""Router findings of the second review (2026-12-06), each failing before its fix: the length
``/v1/models`` and ``/tokenize`` report is the one admission enforces; a refused request adds
nothing to ``pdserve:router_prompt_tokens_total``; unknown field names cannot forge log lines."""

from __future__ import annotations

import logging
import threading
import time

import httpx
import pytest
from router_harness import MODEL_NAME, router_with_one_worker

pytestmark = pytest.mark.integration


def test_models_and_tokenize_report_the_length_the_workers_enforce(tiny_model, redis_server):
    """A decode worker started with a shorter --max-model-len than the router's: admission
    refused a 1,500-token prompt at 1,024 while both endpoints still said 4,096."""
    with router_with_one_worker(
        tiny_model, redis_server.url, "mml", {"max_model_len": 1024}, max_model_len=4096
    ) as router:
        models = httpx.get(f"{router.url}/v1/models", timeout=10).json()
        assert models["data"][0]["max_model_len"] == 1024
        tok = httpx.post(
            f"{router.url}/tokenize", json={"model": MODEL_NAME, "prompt": "hi"}, timeout=10
        ).json()
        assert tok["max_model_len"] == 1024
        refused = httpx.post(
            f"{router.url}/v1/completions",
            json={"model": MODEL_NAME, "prompt": [7] * 1500, "max_tokens": 1},
            timeout=10,
        )
        assert refused.status_code == 400 and "1024" in refused.json()["error"]["message"]


def test_a_refused_request_adds_no_prompt_tokens(tiny_model, redis_server):
    with router_with_one_worker(
        tiny_model, redis_server.url, "ptok", {"token_delay": 0.1}, max_inflight_requests=1
    ) as router:
        before = router.metric("pdserve:router_prompt_tokens_total")
        slow = threading.Thread(
            target=lambda: httpx.post(
                f"{router.url}/v1/completions",
                json={
                    "model": MODEL_NAME,
                    "prompt": [7] * 10,
                    "max_tokens": 30,
                    "ignore_eos": True,
                },
                timeout=60,
            )
        )
        slow.start()
        deadline = time.monotonic() + 10
        while router.metric("pdserve:router_prompt_tokens_total") == before:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        codes = [
            httpx.post(
                f"{router.url}/v1/completions",
                json={"model": MODEL_NAME, "prompt": [7] * 100, "max_tokens": 2},
                timeout=10,
            ).status_code
            for _ in range(3)
        ]
        slow.join()
        assert codes == [429, 429, 429]
        assert router.metric("pdserve:router_prompt_tokens_total") - before == 10


def test_unknown_field_names_are_logged_quoted_on_one_line(tiny_model, redis_server):
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    handler = Keep()
    log = logging.getLogger("router.serving")
    log.addHandler(handler)
    forged = "x\n2026-12-06 03:00:00,000 INFO router.server: admin API key rotated"
    try:
        with router_with_one_worker(tiny_model, redis_server.url, "logf") as router:
            r = httpx.post(
                f"{router.url}/v1/completions",
                json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, forged: 1},
                timeout=10,
            )
            assert r.status_code == 200
            many = {f"k{i}": 1 for i in range(50)}
            r = httpx.post(
                f"{router.url}/v1/completions",
                json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, **many},
                timeout=10,
            )
            assert r.status_code == 200
    finally:
        log.removeHandler(handler)
    lines = [r for r in records if "unknown request fields" in r]
    assert len(lines) == 2
    assert all(len(r.splitlines()) == 1 for r in lines)  # no line of the client's making
    assert "'x\\n2026-12-06" in lines[0]
    assert lines[1].endswith("and 30 more")
