"""Failure rules: retries, mid-stream resume, cancellation and deadlines, through real HTTP."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import httpx
import openai
import pytest
from router_harness import MODEL_NAME, load_fake_worker_module

from router.tokenizer import RouterTokenizer

pytestmark = pytest.mark.integration
fw = load_fake_worker_module()


@pytest.fixture(params=["mux", "per-request"])
def router_config(router_config, request):
    """Every test here with both ``--decode-stream`` modes: the shared GenerateMux call per
    worker (the default) and one Generate call per request end streams by the same rules."""
    return replace(router_config, decode_stream=request.param)


@pytest.fixture(scope="module")
def tok(tiny_model) -> RouterTokenizer:
    return RouterTokenizer.from_model_dir(tiny_model)


def wait_idle(worker, timeout: float = 3.0) -> float:
    """Seconds until the worker has no running request (its stream was cancelled)."""
    t0 = time.monotonic()
    while worker.stats().running:
        assert time.monotonic() - t0 < timeout, "the decode stream was not cancelled"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_decode_killed_mid_stream_resumes_identically(make_worker, make_router, router_config, tok):
    doomed = make_worker("doomed", token_delay=0.01, die_after_tokens=7)
    backup = make_worker("backup", token_delay=0.01, report_waiting=3)
    r = make_router(router_config)
    r.wait_workers(2)
    r.wait_waiting("backup", 3)  # so the other one is picked first
    prompt = "a long story about the sea"
    stream = r.openai().completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert doomed.proc.wait(5) is not None  # it really died mid-stream
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens]
    expected, _ = fw.expected_output(tok.encode(prompt), max_tokens=40, vocab=2048, ignore_eos=True)
    assert text == tok.decode(expected)  # nothing lost, nothing repeated
    assert tokens == [tok.token_str(t) for t in expected]
    assert chunks[-1].usage.completion_tokens == 40
    assert r.metric("pdserve:router_retries_total") == 1
    assert backup.stats().prefix_cache_queries == 1


def test_prompt_logprobs_survive_a_failover(make_worker, make_router, router_config, tok):
    """They come with the first token; the attempt that resumes after the crash does not ask
    for them again (the backup would compute the whole prompt for nothing), and the answer
    carries the first attempt's."""
    make_worker("doomed", token_delay=0.01, die_after_tokens=5)
    backup = make_worker("backup", report_waiting=3)
    r = make_router(router_config)
    r.wait_workers(2)
    r.wait_waiting("backup", 3)  # so the other one is picked first
    prompt = "prompt logprobs outlive a crash"
    ids = tok.encode(prompt)
    resp = httpx.post(
        f"{r.url}/v1/completions",
        json={
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": 12,
            "ignore_eos": True,
            "prompt_logprobs": 1,
        },
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    (c,) = resp.json()["choices"]
    expected, _ = fw.expected_output(ids, max_tokens=12, vocab=2048, ignore_eos=True)
    assert c["text"] == tok.decode(expected)
    fake = fw.fake_prompt_logprobs(ids, 1, 2048)
    assert [d[str(t)]["logprob"] for d, t in zip(c["prompt_logprobs"][1:], ids[1:])] == (
        pytest.approx([f.logprob for f in fake])
    )
    assert r.metric("pdserve:router_retries_total") == 1
    assert backup.stats().prefix_cache_queries == 1  # the resumed attempt went there
    assert "prompt_logprobs asked on a resume" not in backup.stderr()


def test_failover_with_n2_non_streaming(make_worker, make_router, router_config, tok):
    make_worker("doomed", token_delay=0.01, die_after_tokens=9)  # 9 tokens over 2 samples
    make_worker("backup", report_waiting=3)
    r = make_router(router_config)
    r.wait_workers(2)
    r.wait_waiting("backup", 3)  # so the other one is picked first
    prompt = "two samples survive a crash"
    out = r.openai().completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=20, n=2, extra_body={"ignore_eos": True}
    )
    for c in out.choices:
        expected, _ = fw.expected_output(
            tok.encode(prompt), max_tokens=20, vocab=2048, index=c.index, ignore_eos=True
        )
        assert c.text == tok.decode(expected) and c.finish_reason == "length"
    assert out.usage.completion_tokens == 40
    assert r.metric("pdserve:router_retries_total") == 1


def test_failure_before_first_token_retries_on_another_worker(
    make_worker, make_router, router_config
):
    flaky = make_worker("flaky", fail_requests=1, fail_code="UNAVAILABLE")
    good = make_worker("good", report_waiting=3)
    r = make_router(router_config)
    r.wait_workers(2)
    r.wait_waiting("good", 3)  # so the other one is picked first
    out = r.openai().completions.create(
        model=MODEL_NAME, prompt="retry me", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 5
    assert r.metric("pdserve:router_retries_total") == 1
    assert good.stats().prefix_cache_queries == 1 and flaky.stats().prefix_cache_queries == 0
    # the flaky worker cools down: the next request goes straight to the other one
    r.openai().completions.create(model=MODEL_NAME, prompt="again", max_tokens=2)
    assert r.metric("pdserve:router_retries_total") == 1


@pytest.mark.parametrize("code", ["UNAUTHENTICATED", "PERMISSION_DENIED", "UNIMPLEMENTED"])
def test_a_worker_that_refuses_the_router_is_skipped_and_cooled_down(
    make_worker, make_router, router_config, code
):
    """A worker with another cluster secret (or without an RPC) answered every request with a
    502 and stayed in the rotation; another worker can serve them."""
    refuses = make_worker("refuses", fail_requests=99, fail_code=code)
    good = make_worker("good", report_waiting=3)
    r = make_router(router_config)
    r.wait_workers(2)
    r.wait_waiting("good", 3)  # so the refusing one is picked first
    for prompt in ("one", "two"):
        out = r.openai().completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert out.usage.completion_tokens == 3
    assert r.metric("pdserve:router_retries_total") == 1  # the second went to `good` at once
    assert good.stats().prefix_cache_queries == 2 and refuses.stats().prefix_cache_queries == 0


def test_stalled_worker_is_abandoned_and_the_stream_resumed(
    make_worker, make_router, router_config, tok
):
    stuck = make_worker("stuck", stall_after_tokens=5)
    make_worker("backup", report_waiting=3)
    # a stall timeout a healthy real worker process on a loaded machine never trips
    r = make_router(replace(router_config, stall_timeout_s=1.5))
    r.wait_workers(2)
    r.wait_waiting("backup", 3)  # so the other one is picked first
    t0 = time.monotonic()
    out = r.openai().completions.create(
        model=MODEL_NAME, prompt="stall", max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert time.monotonic() - t0 < 10  # abandoned after the stall, not hung
    expected, _ = fw.expected_output(
        tok.encode("stall"), max_tokens=12, vocab=2048, ignore_eos=True
    )
    assert out.choices[0].text == tok.decode(expected)
    wait_idle(stuck)  # the stalled call was cancelled


def test_bad_request_from_worker_is_400_without_retry(make_worker, make_router, router_config):
    make_worker("picky", fail_requests=5, fail_code="INVALID_ARGUMENT")
    make_worker("other", fail_requests=5, fail_code="INVALID_ARGUMENT")
    r = make_router(router_config)
    r.wait_workers(2)
    with pytest.raises(openai.BadRequestError, match="rejected"):
        r.openai().completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
    assert r.metric("pdserve:router_retries_total") == 0


def test_every_worker_at_capacity_is_429(make_worker, make_router, router_config):
    make_worker("full0", fail_requests=9, fail_code="RESOURCE_EXHAUSTED")
    make_worker("full1", fail_requests=9, fail_code="RESOURCE_EXHAUSTED")
    r = make_router(router_config)
    r.wait_workers(2)
    resp = httpx.post(
        f"{r.url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2},
        timeout=10,
    )
    assert resp.status_code == 429 and resp.headers["retry-after"]
    assert resp.json()["error"]["type"] == "rate_limit_error"


def test_retries_are_bounded_then_502(make_worker, make_router, router_config):
    for i in range(3):
        make_worker(f"broken{i}", fail_requests=9, fail_code="INTERNAL")
    r = make_router(replace(router_config, max_retries=1))
    r.wait_workers(3)
    resp = httpx.post(
        f"{r.url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2},
        timeout=10,
    )
    assert resp.status_code == 502
    err = resp.json()["error"]
    assert "2 attempts" in err["message"] and err["code"] == "upstream_error"
    assert r.metric("pdserve:router_retries_total") == 1
    pool = r.app.state.pool  # failed attempts gave back the prefill work they had counted
    assert all(
        pool.prefill_backlog(w.worker_id) == 0 and pool.decoding(w.worker_id) == 0
        for w in pool.records()
    )


def test_stop_string_cancels_the_decode_stream(make_worker, make_router, router_config, tok):
    w = make_worker("slow", token_delay=0.02)
    r = make_router(router_config)
    r.wait_workers(1)
    expected, _ = fw.expected_output(
        tok.encode("cancel me"), max_tokens=10, vocab=2048, ignore_eos=True
    )
    stop = tok.decode(expected[3:5])
    t0 = time.monotonic()
    out = r.openai().completions.create(
        model=MODEL_NAME,
        prompt="cancel me",
        max_tokens=2000,
        stop=stop,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "stop" and out.choices[0].stop_reason == stop
    assert time.monotonic() - t0 < 3  # not 2000 x 20 ms
    wait_idle(w)


def test_client_disconnect_cancels_the_decode_stream(make_worker, make_router, router_config):
    w = make_worker("slow", token_delay=0.02)
    r = make_router(router_config)
    r.wait_workers(1)
    body = {
        "model": MODEL_NAME,
        "prompt": "disconnect",
        "max_tokens": 2000,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{r.url}/v1/completions", json=body, timeout=10) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert any(line.startswith("data: ") for line in got)
        assert w.stats().running == 1
        # past its first token the stream counts as decoding, no longer as prefill backlog
        pool = r.app.state.pool
        assert pool.decoding("slow") == 1 and pool.prefill_backlog("slow") == 0
    wait_idle(w)
    assert r.ctx.inflight == 0
    assert pool.decoding("slow") == 0
    # a non-streaming request whose client gives up is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{r.url}/v1/completions", timeout=0.5, json={**body, "stream": False})
    wait_idle(w)


def test_deadline_bounds_requests(make_worker, make_router, router_config):
    make_worker("sluggish", first_token_delay=10)
    r = make_router(replace(router_config, request_timeout_s=1.0))
    r.wait_workers(1)
    t0 = time.monotonic()
    resp = httpx.post(
        f"{r.url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": "late", "max_tokens": 5},
        timeout=10,
    )
    assert resp.status_code == 504 and time.monotonic() - t0 < 3
    assert resp.json()["error"]["code"] == "request_timeout"


def test_deadline_mid_stream_ends_with_an_error_event(make_worker, make_router, router_config):
    make_worker("trickle", token_delay=0.2)
    r = make_router(replace(router_config, request_timeout_s=2.0))
    r.wait_workers(1)
    body = {
        "model": MODEL_NAME,
        "prompt": "late",
        "max_tokens": 100,
        "stream": True,
        "ignore_eos": True,
    }
    t0 = time.monotonic()
    with httpx.stream("POST", f"{r.url}/v1/completions", json=body, timeout=10) as resp:
        assert resp.status_code == 200
        data = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert time.monotonic() - t0 < 5
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "request_timeout"
    # some tokens came before the deadline, and the deadline cut the stream: one token at
    # once, then one per 0.2 s for 2 s makes at most 11 (of 100)
    assert 1 <= len(data) - 2 <= 12


def test_cached_tokens_after_a_resume_are_the_prompts(make_worker, make_router, router_config):
    """A resumed attempt's worker counts its cache over the prompt plus the tokens it resumed
    with (its engine's prompt): the usage's ``cached_tokens`` stays the count of the worker
    that processed the prompt, never more than ``prompt_tokens`` (it was 16 of 10 here)."""
    backup = make_worker("backup", token_delay=0.01, report_waiting=3)
    r = make_router(router_config)
    r.wait_workers(1)
    prompt = list(range(5, 15))  # 10 tokens: no full block, so no prefix hit routes it
    expected, _ = fw.expected_output(prompt, max_tokens=40, vocab=2048, ignore_eos=True)
    client = r.openai()
    # the backup holds the first block of the prompt plus its first 7 tokens
    client.completions.create(model=MODEL_NAME, prompt=prompt + expected[:7], max_tokens=1)
    make_worker("doomed", token_delay=0.01, die_after_tokens=7)
    r.wait_workers(2)
    r.wait_waiting("backup", 3)  # so the doomed one is picked first
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert r.metric("pdserve:router_retries_total") == 1  # it was resumed on the backup
    assert backup.stats().prefix_cache_hits == 1  # ... which found 16 tokens cached
    usage = chunks[-1].usage
    assert usage.prompt_tokens == 10 and usage.completion_tokens == 40
    assert usage.prompt_tokens_details.cached_tokens == 0  # the doomed worker's count


def _pause_router(r, seconds: float) -> None:
    """The router's event loop does not run for ``seconds`` and its process uses no CPU
    meanwhile: a SIGSTOP of the router as its own clocks see it (the router runs in this
    test's process, so it cannot be stopped with a signal here)."""
    import threading

    loop = r.ctx.dispatcher.pool._task.get_loop()
    done = threading.Event()
    loop.call_soon_threadsafe(lambda: (time.sleep(seconds), done.set()))
    assert done.wait(seconds + 10)


@pytest.mark.parametrize(
    ("failures", "pause_first", "max_retries"),
    [(1, False, 2), (1, False, 0), (2, False, 2), (1, True, 2)],
    ids=[
        "paused-mid-attempt",
        "no-retries-allowed",
        "fails-again-after",
        "paused-before-the-attempt",
    ],
)
def test_a_call_broken_by_the_routers_own_pause_does_not_blame_the_worker(
    make_worker, make_router, router_config, failures, pause_first, max_retries
):
    """A decode worker's call that broke (no word from the worker on why) right after the
    router was paused mid-attempt broke because of the pause (keepalive gave the silent
    router up): the worker is not excluded nor cooled down, and the retry goes to it again.
    With one decode worker the request used to end in an error and the next ones in 503 for
    --worker-cooldown. That retry is not counted against --max-retries (with 0 there would
    be none). A second failure, or one of an attempt begun after the pause, is the worker's
    own: the usual rules (excluded, cooled down)."""
    import threading

    from shared.pauses import NOTICEABLE_S

    only = make_worker(
        "only",
        fail_requests=failures,
        fail_code="UNAVAILABLE",
        fail_delay=4.0 if not pause_first else 0.0,
    )
    r = make_router(replace(router_config, max_retries=max_retries))
    r.wait_workers(1)
    pool = r.ctx.dispatcher.pool
    if pause_first:
        from router.dispatch import RESUME_SETTLE_S

        _pause_router(r, NOTICEABLE_S + 1.0)
        time.sleep(RESUME_SETTLE_S + 0.5)  # the request comes well after the resume
    out: list[httpx.Response] = []
    sender = threading.Thread(
        target=lambda: out.append(
            httpx.post(
                f"{r.url}/v1/completions",
                json={
                    "model": MODEL_NAME,
                    "prompt": "after a pause",
                    "max_tokens": 3,
                    "ignore_eos": True,
                },
                timeout=60,
            )
        )
    )
    sender.start()
    if not pause_first:
        t0 = time.monotonic()
        while pool.inflight("only") == 0:  # the attempt is on the worker: pause now
            assert time.monotonic() - t0 < 10
            time.sleep(0.01)
        _pause_router(r, NOTICEABLE_S + 1.0)  # the call fails 4 s after it began: after this
    sender.join(60)
    (resp,) = out
    if failures == 1 and not pause_first:
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 3
        assert r.metric("pdserve:router_retries_total") == 1
        assert only.stats().prefix_cache_queries == 1  # the retry went to the same worker
        assert pool.healthy("decode")  # not cooled down
    else:
        assert resp.status_code >= 500, resp.text
        assert not pool.healthy("decode")  # the worker's own failure cooled it down


def test_a_retry_after_the_routers_own_pause_prefers_another_worker(
    make_worker, make_router, router_config
):
    """The forgiven retry (see above) goes to another healthy decode worker when there is one
    (the first may have died during the pause), and the first is not cooled down."""
    import threading

    from shared.pauses import NOTICEABLE_S

    first = make_worker("first", fail_requests=1, fail_code="UNAVAILABLE", fail_delay=4.0)
    other = make_worker("other", report_waiting=3)
    r = make_router(router_config)
    r.wait_workers(2)
    r.wait_waiting("other", 3)  # so the first one is picked first
    pool = r.ctx.dispatcher.pool
    out: list[httpx.Response] = []
    body = {"model": MODEL_NAME, "prompt": "after a pause", "max_tokens": 3, "ignore_eos": True}
    sender = threading.Thread(
        target=lambda: out.append(httpx.post(f"{r.url}/v1/completions", json=body, timeout=60))
    )
    sender.start()
    t0 = time.monotonic()
    while pool.inflight("first") == 0:  # the attempt is on the first worker: pause now
        assert time.monotonic() - t0 < 10
        time.sleep(0.01)
    _pause_router(r, NOTICEABLE_S + 1.0)
    sender.join(60)
    (resp,) = out
    assert resp.status_code == 200, resp.text
    assert r.metric("pdserve:router_retries_total") == 1
    assert other.stats().prefix_cache_queries == 1  # the retry went to the other worker
    assert first.stats().prefix_cache_queries == 0
    assert {w.worker_id for w in pool.healthy("decode")} == {"first", "other"}  # no cooldown
