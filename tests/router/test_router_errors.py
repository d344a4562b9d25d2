"""Every error status in OpenAI's JSON shape, and what the ``openai`` SDK makes of it."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import httpx
import openai
import pytest
from router_harness import MODEL_NAME, router_with_one_worker

pytestmark = pytest.mark.integration


def assert_error(
    resp: httpx.Response, status: int, *, param: str | None = None, contains: str = ""
) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    assert contains in err["message"]
    return err


@pytest.fixture(scope="module")
def router(tiny_model, redis_server):
    with router_with_one_worker(
        tiny_model, redis_server.url, "err", max_request_body_bytes=65536
    ) as router:
        yield router


def post(r, path="/v1/completions", **body):
    return httpx.post(f"{r.url}{path}", json={"model": MODEL_NAME, **body}, timeout=10)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "stop_token_ids": [999999]}, "stop_token_ids"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),  # --max-logprobs 20
        ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "x", "max_tokens": 0, "echo": False}, "max_tokens"),
        ({"prompt": "x", "logit_bias": {"five": 1.0}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"99999999": 1.0}}, "logit_bias"),
        ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
        ({"prompt": "x", "allowed_token_ids": [5, -1]}, "allowed_token_ids"),
        ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
        ({"prompt": "x", "min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"prompt": [999999]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "x", "n": "many"}, "n"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_invalid_parameters_are_400(router, body, param):
    assert_error(post(router, **body), 400, param=param)


def test_chat_specific_400s(router):
    msgs = [{"role": "user", "content": "x"}]
    assert_error(
        post(router, "/v1/chat/completions", messages=msgs, top_logprobs=2),
        400,
        param="top_logprobs",
    )
    tools = [{"type": "function", "function": {"name": "f"}}]
    # tools default tool_choice to "auto", which needs --enable-auto-tool-choice (vLLM's rule)
    for choice in ({}, {"tool_choice": "auto"}):
        assert_error(
            post(router, "/v1/chat/completions", messages=msgs, tools=tools, **choice),
            400,
            param="tool_choice",
            contains="--enable-auto-tool-choice",
        )
    for bad, param in (
        ({"tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
        ({"tool_choice": "none", "tools": [{"type": "retrieval"}]}, "tools.0"),
        ({"tool_choice": "none", "tools": tools * 2}, "tools.1"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ):
        assert_error(
            post(router, "/v1/chat/completions", **{"messages": msgs, "tools": tools, **bad}),
            400,
            param=param,
        )
    assert_error(
        post(
            router,
            "/v1/chat/completions",
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        ),
        400,
        contains="image_url",
    )
    assert_error(post(router, "/v1/chat/completions", messages=[]), 400, param="messages")


def test_malformed_json_is_400(router):
    resp = httpx.post(
        f"{router.url}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert_error(resp, 400)


def test_prompt_longer_than_the_model_allows_names_both_lengths(router):
    long_prompt = [5 + i % 2000 for i in range(4000)]  # max_model_len is 4096
    err = assert_error(post(router, prompt=long_prompt, max_tokens=200), 400, param="max_tokens")
    assert "4096" in err["message"] and "4200" in err["message"] and "4000" in err["message"]
    err = assert_error(post(router, prompt=[7] * 4100, max_tokens=1), 400)
    assert "4096" in err["message"] and "4100" in err["message"]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        router.openai().completions.create(model=MODEL_NAME, prompt=long_prompt, max_tokens=200)


def test_unknown_model_and_route_are_404(router):
    err = assert_error(post(router, model="gpt-4", prompt="x"), 404, param="model")
    assert err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        router.openai().chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}]
        )
    assert_error(httpx.get(f"{router.url}/v1/nothing-here"), 404)


def test_oversize_body_is_413(router):
    assert_error(post(router, prompt="x" * 70000), 413)
    # also when the body is chunked (no content-length)
    resp = httpx.post(
        f"{router.url}/v1/completions",
        content=iter([b'{"prompt": "', b"y" * 70000, b'"}']),
        headers={"content-type": "application/json"},
    )
    assert_error(resp, 413)


def test_api_key_is_required_when_configured(make_worker, make_router, router_config):
    make_worker("d0")
    r = make_router(replace(router_config, api_key="sekret"))
    r.wait_workers(1)
    assert_error(post(r, prompt="x"), 401)
    with pytest.raises(openai.AuthenticationError):
        r.openai(api_key="wrong").completions.create(model=MODEL_NAME, prompt="x", max_tokens=1)
    ok = r.openai(api_key="sekret").completions.create(model=MODEL_NAME, prompt="x", max_tokens=1)
    assert ok.usage.completion_tokens == 1
    assert httpx.get(f"{r.url}/health").status_code == 200  # probes stay open
    assert httpx.get(f"{r.url}/metrics").status_code == 401  # under the key too
    auth = {"Authorization": "Bearer sekret"}
    assert httpx.get(f"{r.url}/metrics", headers=auth).status_code == 200


def test_router_admission_limit_is_429_with_retry_after(make_worker, make_router, router_config):
    make_worker("slow", token_delay=0.05)
    r = make_router(replace(router_config, max_inflight_requests=1))
    r.wait_workers(1)
    body = {"model": MODEL_NAME, "prompt": "hold", "max_tokens": 30, "ignore_eos": True}
    first = threading.Thread(
        target=lambda: httpx.post(f"{r.url}/v1/completions", json=body, timeout=20)
    )
    first.start()
    deadline = time.monotonic() + 5
    while r.ctx.inflight == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    resp = post(r, prompt="second", max_tokens=2)
    err = assert_error(resp, 429)
    assert err["type"] == "rate_limit_error" and int(resp.headers["retry-after"]) >= 1
    with pytest.raises(openai.RateLimitError):
        r.openai().completions.create(model=MODEL_NAME, prompt="third", max_tokens=2)
    first.join(20)
    assert r.ctx.inflight == 0
    assert post(r, prompt="after", max_tokens=2).status_code == 200


def test_worker_queues_beyond_bound_are_429(make_worker, make_router, router_config):
    make_worker("queued", report_waiting=50)
    r = make_router(replace(router_config, max_waiting_per_worker=10))
    r.wait_workers(1)
    assert_error(post(r, prompt="x", max_tokens=2), 429, contains="waiting")


def test_no_worker_is_503(make_router, router_config):
    r = make_router(router_config)
    assert httpx.get(f"{r.url}/health").status_code == 503
    resp = post(r, prompt="x", max_tokens=2)
    err = assert_error(resp, 503, contains="no healthy decode worker")
    assert err["code"] == "no_worker_available" and resp.headers["retry-after"]
    with pytest.raises(openai.InternalServerError):
        r.openai().completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
    assert r.metric("pdserve:router_request_errors_total", status="503") >= 2


def test_shorter_max_model_len_advertised_by_workers_is_enforced(
    make_worker, make_router, router_config
):
    make_worker("short", max_model_len=1024)
    r = make_router(router_config)
    r.wait_workers(1)
    err = assert_error(post(r, prompt=[7] * 1000, max_tokens=100), 400, param="max_tokens")
    assert "1024" in err["message"] and "1100" in err["message"]
    assert post(r, prompt=[7] * 1000, max_tokens=24, ignore_eos=True).status_code == 200
