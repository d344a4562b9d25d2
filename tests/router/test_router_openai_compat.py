"""OpenAI / vLLM API details a black-box review found different from vLLM's OpenAI server
(2026-12-06), through real HTTP against a fake decode worker."""

from __future__ import annotations

import json

import httpx
import pytest
from router_harness import MODEL_NAME, RouterThread, router_with_one_worker
from test_router_errors import assert_error

from router.config import RouterConfig

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tiny_model, redis_server):
    with router_with_one_worker(
        tiny_model, redis_server.url, "compat", request_timeout_s=30
    ) as router:
        yield router


def sse_events(r: httpx.Response) -> list:
    out = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def stream(cluster, path: str, body: dict) -> list[dict]:
    body = {"model": MODEL_NAME, "stream": True, **body}
    with httpx.stream("POST", f"{cluster.url}{path}", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r)
    if path == "/v1/responses":  # its events end with response.completed, no [DONE]
        return events
    assert events[-1] == "[DONE]"
    return events[:-1]


CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_counts_each_choice_own_tokens(cluster, path):
    # vLLM's continuous usage: a chunk's completion_tokens are its choice's tokens so far
    # (previous_num_tokens[i]), 0 in the role chunk; the router reported the request's
    # total across choices, and 1 in the role chunk. The cached count was only in the
    # final usage.
    body: dict = {"max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    body |= {"return_token_ids": True, "stream_options": CONTINUOUS}
    if path == "/v1/completions":
        body["prompt"] = "usage per choice"
    else:
        body["messages"] = [{"role": "user", "content": "usage per choice"}]
    events = stream(cluster, path, body)
    *chunks, final = events
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 12
    cached = final["usage"]["prompt_tokens_details"]
    assert cached is not None
    seen = {0: 0, 1: 0}
    for e in chunks:
        (c,) = e["choices"]
        seen[c["index"]] += len(c.get("token_ids") or ())
        usage = e["usage"]
        if c.get("delta", {}).get("role"):
            assert usage["completion_tokens"] == 0, e
        assert usage["completion_tokens"] == seen[c["index"]], e
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["prompt_tokens"] == final["usage"]["prompt_tokens"]
        assert usage["prompt_tokens_details"] == cached, e
    assert seen == {0: 6, 1: 6}


def test_continuous_usage_counts_each_choice_own_prompt(cluster):
    # vLLM's completions: a chunk's prompt_tokens are its own prompt's
    # (num_prompt_tokens[prompt_idx]), the final usage their sum
    prompts = ["one", "two prompts of different lengths"]
    lengths = [
        httpx.post(f"{cluster.url}/tokenize", json={"model": MODEL_NAME, "prompt": p}).json()[
            "count"
        ]
        for p in prompts
    ]
    assert lengths[0] != lengths[1]
    body = {"prompt": prompts, "max_tokens": 3, "ignore_eos": True, "stream_options": CONTINUOUS}
    *chunks, final = stream(cluster, "/v1/completions", body)
    assert final["usage"]["prompt_tokens"] == sum(lengths)
    for e in chunks:
        assert e["usage"]["prompt_tokens"] == lengths[e["choices"][0]["index"]], e


def test_responses_item_cut_by_max_output_tokens_is_incomplete(cluster):
    # OpenAI's output item is "incomplete" with the response when max_output_tokens cut it;
    # the router's message item said "completed" (body, output_item.done and the final event)
    body = {"model": MODEL_NAME, "input": "tell me a long story", "max_output_tokens": 4}
    r = httpx.post(f"{cluster.url}/v1/responses", json=body, timeout=30).json()
    assert r["status"] == "incomplete"
    assert r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [(i["type"], i["status"]) for i in r["output"]] == [("message", "incomplete")]
    events = stream(cluster, "/v1/responses", body)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["status"]) for i in done] == [("message", "incomplete")]
    assert events[-1]["type"] == "response.incomplete"
    assert [i["status"] for i in events[-1]["response"]["output"]] == ["incomplete"]


@pytest.mark.parametrize(
    "path, field, value",
    [
        ("/v1/chat/completions", "max_tokens", -1),
        ("/v1/chat/completions", "max_completion_tokens", -5),
        ("/v1/chat/completions", "max_tokens", 0),
        ("/v1/completions", "max_tokens", -1),
        ("/v1/completions", "max_tokens", 0),
    ],
)
def test_a_budget_under_one_names_the_field_sent(cluster, path, field, value):
    # a negative budget was refused as "min_tokens (0) must not exceed max_tokens (-1)",
    # param min_tokens; 0 named max_tokens: both now name the field the client sent
    body: dict = {"model": MODEL_NAME, field: value}
    if path == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{cluster.url}{path}", json=body, timeout=10)
    assert_error(r, 400, param=field, contains=f"{field} must be at least 1, got {value}")


def test_a_negative_max_output_tokens_names_it(cluster):
    body = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": -1}
    r = httpx.post(f"{cluster.url}/v1/responses", json=body, timeout=10)
    assert_error(r, 400, param="max_output_tokens")


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_answers_as_health(cluster, method):
    # SageMaker's health probe, which vLLM serves (GET and POST): it was a 404
    resp = httpx.request(method, f"{cluster.url}/ping", timeout=10)
    health = httpx.get(f"{cluster.url}/health", timeout=10)
    assert resp.status_code == health.status_code == 200
    assert resp.json()["status"] == "ok"


def test_ping_is_503_without_decode_workers(tiny_model, redis_server):
    # the same status as /health: 503 while no decode worker is routable
    cfg = RouterConfig(
        model=str(tiny_model),
        served_model_name=MODEL_NAME,
        redis_url=redis_server.url,
        directory_prefix="compat-none:",
    )
    router = RouterThread(cfg)
    try:
        for method in ("GET", "POST"):
            resp = httpx.request(method, f"{router.url}/ping", timeout=10)
            assert resp.status_code == 503, (method, resp.text)
            assert resp.json()["status"] == "no_decode_workers"
    finally:
        router.stop()


REFUSAL = "I can't help with that."


def test_a_refusal_part_is_the_assistant_message_text(cluster):
    # vLLM's chat_utils parses {"type": "refusal"} parts as text; the router refused them (400)
    def conversation(answer) -> list[dict]:
        return [
            {"role": "user", "content": "do something bad"},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "then something good"},
        ]

    parts = [{"type": "refusal", "refusal": REFUSAL}, {"type": "text", "text": "Sorry."}]
    body = {"model": MODEL_NAME, "messages": conversation(parts)}
    r = httpx.post(f"{cluster.url}/v1/chat/completions", json=body | {"max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    got = httpx.post(f"{cluster.url}/tokenize", json=body, timeout=10)
    want = {"model": MODEL_NAME, "messages": conversation(REFUSAL + "\nSorry.")}
    expected = httpx.post(f"{cluster.url}/tokenize", json=want, timeout=10)
    assert got.status_code == 200, got.text
    assert got.json()["tokens"] == expected.json()["tokens"]
    # echo repeats the last message's text, a refusal part's included
    body = {"model": MODEL_NAME, "messages": conversation(parts)[:2], "echo": True}
    body |= {"add_generation_prompt": False, "continue_final_message": True, "max_tokens": 2}
    r = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].startswith(REFUSAL + "\nSorry.")


def test_a_refusal_part_in_a_responses_input_message(cluster):
    # an earlier answer's output message as a Responses input item may hold a refusal part
    answer = {"type": "message", "role": "assistant"}
    answer["content"] = [{"type": "refusal", "refusal": REFUSAL}]
    body = {"model": MODEL_NAME, "max_output_tokens": 2}
    body["input"] = [{"role": "user", "content": "do something bad"}, answer]
    r = httpx.post(f"{cluster.url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 200, r.text


def test_other_content_parts_are_still_refused(cluster):
    msg = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    body = {"model": MODEL_NAME, "messages": [msg]}
    r = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=10)
    assert_error(r, 400, param="messages.0.content", contains="'image_url'")
