"""Robust input at the HTTP edge: whatever a client sends gets an OpenAI-style 400 naming the
parameter (413 for the body) before any worker sees it, and nothing blocks the event loop."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import threading
import time

import httpx
import pytest
from router_harness import MODEL_NAME, router_with_one_worker
from test_router_errors import assert_error
from test_router_process import _start_router

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def router(tiny_model, redis_server):
    with router_with_one_worker(
        tiny_model,
        redis_server.url,
        "inp",
        max_stop_strings=4,
        max_stop_chars=64,
        max_prompts_per_request=4,
        max_choices_per_request=8,
        max_cache_salt_length=16,
        max_json_depth=8,
        max_n=8,
    ) as router:
        yield router


def post(r, path="/v1/completions", **body):
    return httpx.post(f"{r.url}{path}", json={"model": MODEL_NAME, **body}, timeout=10)


def raw(r, content: bytes, path="/v1/completions", ctype="application/json"):
    return httpx.post(
        f"{r.url}{path}", content=content, headers={"content-type": ctype}, timeout=10
    )


MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "check"),
    [
        (
            "/v1/chat/completions",
            {"messages": MSGS, "n": None, "stream": None, "logprobs": None, "echo": None},
            lambda j: len(j["choices"]) == 1 and j["choices"][0]["logprobs"] is None,
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "n": None, "echo": None, "stream": None, "ignore_eos": None},
            lambda j: len(j["choices"]) == 1 and not j["choices"][0]["text"].startswith("hi"),
        ),
        ("/v1/responses", {"input": "hi", "stream": None}, lambda j: j["object"] == "response"),
    ],
)
def test_an_explicit_null_is_the_default(router, path, body, check):
    """The SDK sends ``null`` for a parameter passed as ``None`` (frameworks forward every
    option so): OpenAI's parameters are nullable and vLLM takes the default; these were 400s
    ("n: Input should be a valid integer")."""
    limit = {"max_output_tokens": 4} if path == "/v1/responses" else {"max_tokens": 4}
    resp = post(router, path, **body, **limit)
    assert resp.status_code == 200, resp.text
    assert check(resp.json()), resp.json()


def test_null_for_a_required_parameter_is_still_a_400(router):
    assert_error(post(router, "/v1/chat/completions", messages=None, max_tokens=4), 400)


def test_the_wave1_request_is_a_400_naming_seed(router):
    # n=2 with seed 2^63-1 took every decode worker it was retried on down in wave 1
    assert_error(
        post(router, prompt="hi", n=2, seed=2**63 - 1, temperature=1, max_tokens=4),
        400,
        param="seed",
    )
    ok = post(router, prompt="hi", n=2, seed=2**63 - 2, temperature=1, max_tokens=4)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


@pytest.mark.parametrize(
    "body, param",
    [
        (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "temperature"),
        (b'{"model": "tiny", "prompt": "x", "top_p": Infinity}', "top_p"),
        (b'{"model": "tiny", "prompt": "x", "presence_penalty": -Infinity}', "presence_penalty"),
        (b'{"model": "tiny", "prompt": "x", "temperature": 1e39}', "temperature"),
        (b'{"model": "tiny", "prompt": "x", "top_k": 1099511627776}', "top_k"),
        (b'{"model": "tiny", "prompt": "x", "seed": 18446744073709551616}', "seed"),
        (b'{"model": "tiny", "prompt": "x", "min_tokens": 4294967296}', "min_tokens"),
        (b'{"model": "tiny", "prompt": [4294967301]}', "prompt"),
        (b'{"model": "tiny", "prompt": "x", "stop_token_ids": [-1]}', "stop_token_ids"),
        (
            b'{"model": "tiny", "prompt": "x", "truncate_prompt_tokens": 0}',
            "truncate_prompt_tokens",
        ),
        (b'{"model": "tiny", "prompt": "x", "cache_salt": ""}', "cache_salt"),
    ],
)
def test_out_of_range_numbers_are_400s(router, body, param):
    assert_error(raw(router, body), 400, param=param)


def test_chat_min_tokens_beyond_the_budget_is_a_400(router):
    # no max_tokens: the budget is the context left; min_tokens may not exceed it
    assert_error(
        post(router, "/v1/chat/completions", messages=MSGS, min_tokens=10**6),
        400,
        param="min_tokens",
    )


@pytest.mark.parametrize(
    "content, param",
    [
        (b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
        (b'{"model": "tiny", "prompt": "x", "stop": ["\\udfff"]}', "stop.0"),
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages.0.content",
        ),
        (b'{"model": "tiny", "prompt": "x", "user": "\\udc00"}', "user"),
    ],
)
def test_lone_surrogates_are_400s(router, content, param):
    path = "/v1/chat/completions" if b"messages" in content else "/v1/completions"
    assert_error(raw(router, content, path), 400, param=param, contains="surrogate")


def test_surrogate_pairs_are_text(router):
    # clients that escape non-ASCII (json.dumps' default) send emoji as surrogate pairs
    r = raw(router, b'{"model": "tiny", "prompt": "\\ud83d\\ude00", "max_tokens": 2}')
    assert r.status_code == 200, r.text
    r = raw(
        router, b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "stop": ["\\ud83d\\ude00"]}'
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "content, contains",
    [
        (b'{"model": "tiny", "prompt": "\xc3\x28"}', "UTF-8"),
        (b'\xff\xfe{"model": "tiny"}', "UTF-8"),
        (b'{"model": "tiny", "prompt": ', "JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nests"),
    ],
)
def test_malformed_bodies_are_400s(router, content, contains):
    assert_error(raw(router, content), 400, param="body", contains=contains)


@pytest.mark.parametrize("content", [b"[]", b"null", b'"hi"', b"3"])
def test_a_body_that_is_not_an_object_says_so(router, content):
    # was "invalid request: : Input should be a valid dictionary ..." with no param
    assert_error(raw(router, content), 400, param="body", contains="must be a JSON object")


def test_a_json_body_sent_as_a_form_names_the_content_type(router):
    # curl -d without -H: a JSON body under application/x-www-form-urlencoded
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
    err = assert_error(
        raw(router, body, ctype="application/x-www-form-urlencoded"), 400, param="body"
    )
    assert "Content-Type: application/json" in err["message"]
    assert "x-www-form-urlencoded" in err["message"]


def test_deep_nesting_is_refused_where_it_could_hurt(router):
    deep = {"a": 1}
    for _ in range(20):
        deep = {"a": deep}
    tools = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    assert_error(
        post(router, "/v1/chat/completions", messages=MSGS, tools=tools),
        400,
        param="tools",
        contains="--max-json-depth",
    )
    args = json.dumps(deep)
    history = MSGS + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": args}}
            ],
        }
    ]
    assert_error(
        post(router, "/v1/chat/completions", messages=history),
        400,
        param="messages.1.tool_calls.0.function.arguments",
    )
    brackets = "[" * 5000 + "]" * 5000  # deeper than the JSON parser's recursion limit
    history[1]["tool_calls"][0]["function"]["arguments"] = brackets
    assert_error(
        post(router, "/v1/chat/completions", messages=history),
        400,
        param="messages.1.tool_calls.0.function.arguments",
    )
    assert_error(post(router, prompt="x", extra_field=[[[[[[[[[[1]]]]]]]]]]), 400, param="body")


@pytest.mark.parametrize("field", ["guided_json", "structured_outputs"])
def test_deep_schemas_are_400s_in_every_field_that_takes_one(router, field):
    # --max-json-depth covered response_format only: a schema 20 deep went on to the worker,
    # 960 deep was a 500 (json.dumps), and a string schema deeper than the JSON parser's
    # recursion limit a 500 (json.loads); found by review, 2026-12-06
    def body(schema):
        return (
            {"guided_json": schema}
            if field == "guided_json"
            else {"structured_outputs": {"json": schema}}
        )

    deep: dict = {"type": "object"}
    for _ in range(20):
        deep = {"type": "object", "properties": {"a": deep}}
    for schema in (deep, json.dumps(deep)):
        assert_error(
            post(router, prompt="x", max_tokens=2, **body(schema)),
            400,
            param=field,
            contains="--max-json-depth",
        )
    very_deep = "{" + '"a":{' * 959 + "}" * 960
    content = json.dumps({"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}).encode()
    inner = (
        (b'"guided_json": ' if field == "guided_json" else b'"structured_outputs": {"json": ')
        + very_deep.encode()
        + (b"" if field == "guided_json" else b"}")
    )
    r = raw(router, content[:-1] + b", " + inner + b"}")
    assert r.status_code == 400, r.text
    brackets = "[" * 100_000 + "]" * 100_000
    r = post(router, prompt="x", max_tokens=2, **body(brackets))
    assert_error(r, 400, param="structured_outputs", contains="nests too deeply")


def test_a_lone_surrogate_in_tool_call_arguments_is_a_400(router):
    # the body holds the escape inside a JSON string; the router parses the arguments, and the
    # parsed value went into the chat template and the tokenizer: a 500 (found by review)
    history = MSGS + [
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    # the JSON text of the arguments: an escape, which json.loads makes a
                    # lone surrogate
                    "function": {"name": "f", "arguments": '{"a": "\\ud800"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    assert_error(
        post(router, "/v1/chat/completions", messages=history, max_tokens=2),
        400,
        param="messages.1.tool_calls.0.function.arguments",
        contains="surrogate",
    )


def test_request_limits_are_400s_naming_the_parameter(router):
    assert_error(
        post(router, prompt="x", stop=["a", "b", "c", "d", "e"]),
        400,
        param="stop",
        contains="at most 4",
    )
    assert_error(
        post(router, prompt="x", stop=["a" * 40, "b" * 40]),
        400,
        param="stop",
        contains="characters",
    )
    assert_error(
        post(router, prompt="x", stop_token_ids=[5, 6, 7, 8, 9]), 400, param="stop_token_ids"
    )
    assert_error(
        post(router, prompt=["a", "b", "c", "d", "e"]),
        400,
        param="prompt",
        contains="--max-prompts-per-request",
    )
    assert_error(
        post(router, prompt=[[5], [6], [7]], n=3),
        400,
        param="n",
        contains="--max-choices-per-request",
    )
    assert_error(post(router, prompt="x", n=9), 400, param="n")
    assert_error(post(router, prompt="x", cache_salt="s" * 17), 400, param="cache_salt")
    assert post(router, prompt=["a", "b", "c", "d"], n=2, max_tokens=1).status_code == 200


def test_the_client_request_id_is_a_label_never_an_id(router):
    # two clients sending the same X-Request-Id at once: both are served (before, the second
    # collided on the worker), and each gets its label back
    def one(i):
        return httpx.post(
            f"{router.url}/v1/completions",
            timeout=20,
            headers={"x-request-id": "same"},
            json={"model": MODEL_NAME, "prompt": f"p{i}", "max_tokens": 8},
        )

    with cf.ThreadPoolExecutor(4) as pool:
        rs = list(pool.map(one, range(4)))
    assert [r.status_code for r in rs] == [200] * 4, [r.text for r in rs]
    assert all(r.headers["x-request-id"] == "same" for r in rs)
    assert len({r.json()["id"] for r in rs}) == 4


def test_health_answers_within_100ms_while_the_largest_requests_are_parsed(
    tiny_model, make_worker, redis_server, prefix, tmp_path
):
    """The router as its own process; bodies at the 1 MiB default limit in the shapes that cost
    the most to parse (token-id lists, many messages, long text to tokenize, many prompts)
    arrive back to back while /health is polled. Once 292 ms on CI: the messages validated in
    one go (~80 ms), the token ids tried as ``list[str]`` first (~50 ms), a full collection
    freeing the previous requests' cycles (~90 ms); tests/unit/test_router_event_loop.py."""
    make_worker("lat-d0")
    proc, url, log = _start_router(tiny_model, redis_server, prefix, tmp_path)
    limit = 1 << 20
    ids = json.dumps({"model": MODEL_NAME, "prompt": list(range(10_000, 10_000 + 135_000))})
    msgs = json.dumps(
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello there"}] * 22_500}
    )
    text = json.dumps({"model": MODEL_NAME, "prompt": "word " * 200_000})
    # tokenized in full, then refused for max_tokens: generating 128 prompts back to back
    # would measure the loop's streaming load (one core busy on 2 vCPUs), not the parsing
    prompts = json.dumps(
        {"model": MODEL_NAME, "prompt": ["word " * 1500] * 128, "max_tokens": 1 << 20}
    )
    bodies = [b.encode() for b in (ids, msgs, text, prompts)]
    assert all(limit * 0.8 < len(b) <= limit for b in bodies), [len(b) for b in bodies]
    stop = threading.Event()
    statuses: list[int] = []

    def load():
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                for b in bodies:
                    path = "/v1/chat/completions" if b is bodies[1] else "/v1/completions"
                    statuses.append(
                        c.post(
                            url + path, content=b, headers={"content-type": "application/json"}
                        ).status_code
                    )

    took: list[float] = []
    try:
        t = threading.Thread(target=load, daemon=True)
        t.start()
        time.sleep(0.5)
        with httpx.Client(timeout=5) as c:
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                assert c.get(url + "/health").status_code == 200
                took.append(time.perf_counter() - t0)
                time.sleep(0.02)
        stop.set()
        t.join(60)
    finally:
        stop.set()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    assert statuses and set(statuses) <= {200, 400}, sorted(set(statuses))
    assert len(took) > 50, len(took)
    # a robust bound, not the max: on 2 shared cores one sample may lose the CPU to another
    # process; the regression (~292 ms behind every large body) made most samples slow
    slow = sorted(x for x in took if x >= 0.100)
    assert len(slow) <= 2, (
        f"/health took >= 100 ms in {len(slow)} of {len(took)} samples while large requests"
        f" were parsed: {[round(x * 1e3) for x in slow]} ms"
    )
