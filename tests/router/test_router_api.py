"""The OpenAI API through real HTTP (``openai`` SDK and raw SSE) against a fake decode worker."""

from __future__ import annotations

import json

import httpx
import pytest
from router_harness import (
    MODEL_NAME,
    load_fake_worker_module,
    router_with_one_worker,
)

from router.tokenizer import RouterTokenizer

pytestmark = pytest.mark.integration
fw = load_fake_worker_module()
VOCAB = 2048


@pytest.fixture(scope="module")
def cluster(tiny_model, redis_server):
    with router_with_one_worker(
        tiny_model, redis_server.url, "api", request_timeout_s=30
    ) as router:
        yield router


@pytest.fixture(scope="module")
def tok(tiny_model) -> RouterTokenizer:
    return RouterTokenizer.from_model_dir(tiny_model)


def expect(tok, prompt_ids, max_tokens, **kw):
    toks, finish = fw.expected_output(prompt_ids, max_tokens=max_tokens, vocab=VOCAB, **kw)
    text_toks = toks[:-1] if finish == "stop" else toks
    return toks, tok.decode(text_toks), finish


def prompt_with_eos(tok, within: int) -> tuple[str, int]:
    """A prompt whose fake output hits EOS within ``within`` tokens (and its position)."""
    for i in range(2000):
        p = f"story number {i}"
        toks, finish = fw.expected_output(tok.encode(p), max_tokens=within, vocab=VOCAB)
        if finish == "stop" and len(toks) > 3:
            return p, len(toks)
    raise AssertionError("no prompt found")


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_completion_text_and_exact_usage(cluster, tok):
    client = cluster.openai()
    prompt = "def fibonacci(n):"
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    ids = tok.encode(prompt)
    _, text, _ = expect(tok, ids, 24, ignore_eos=True)
    assert (
        out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == MODEL_NAME
    )
    assert isinstance(out.created, int)
    (choice,) = out.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    assert choice.text == text
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 24)
    assert out.usage.total_tokens == len(ids) + 24


def test_completion_stream_matches_and_ends_with_usage_then_done(cluster, tok):
    prompt = "the river and the mountain"
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": 30,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 30
    assert usage_chunk["usage"]["prompt_tokens"] == len(tok.encode(prompt))
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" and c["choices"][0]["index"] == 0 for c in chunks)
    assert all(c["usage"] is None for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    _, text, _ = expect(tok, tok.encode(prompt), 30, ignore_eos=True)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text


def test_chat_stream_role_chunk_first_then_content_usage_done(cluster, tok):
    client = cluster.openai()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == ""
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), False)
    assert chunks[-1].usage.prompt_tokens == len(ids)
    _, text, _ = expect(tok, ids, 12, ignore_eos=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.id == chunks[0].id and c.id.startswith("chatcmpl-") for c in chunks)


def test_chat_non_stream_shape(cluster, tok):
    client = cluster.openai()
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
        }
    ]
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_completion_tokens=10,
        extra_body={"ignore_eos": True},
    )
    assert out.object == "chat.completion"
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    flat = [{"role": "user", "content": "part one\npart two"}]
    ids = tok.encode(tok.apply_chat_template(flat, add_generation_prompt=True), False)
    assert choice.message.content == expect(tok, ids, 10, ignore_eos=True)[1]
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 10


def test_chat_echo_repeats_the_continued_message(cluster, tok):
    # vLLM's chat echo: the answer starts with the last message when it has the answer's role
    # (the assistant's, or with add_generation_prompt false the last message's). Was a 400.
    client = cluster.openai()
    msgs = [{"role": "user", "content": "tell a story"}, {"role": "assistant", "content": "Once"}]
    cont = {"echo": True, "add_generation_prompt": False, "continue_final_message": True}
    ids = tok.encode(
        tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True),
        False,
    )
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=msgs, max_tokens=6, n=2, extra_body={"ignore_eos": True, **cont}
    )
    for c in out.choices:
        assert c.message.role == "assistant"
        assert c.message.content == "Once" + expect(tok, ids, 6, index=c.index, ignore_eos=True)[1]
    assert out.usage.completion_tokens == 12  # the echo is not generated
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=msgs,
        max_tokens=6,
        n=2,
        stream=True,
        extra_body={"ignore_eos": True, **cont},
    )
    deltas: dict[int, list] = {0: [], 1: []}
    for chunk in stream:
        for c in chunk.choices:
            deltas[c.index].append(c.delta)
    for i, ds in deltas.items():
        assert ds[0].role == "assistant" and ds[0].content == ""
        assert ds[1].content == "Once"  # the echo, its own chunk before the first token
        text = "".join(d.content or "" for d in ds)
        assert text == "Once" + expect(tok, ids, 6, index=i, ignore_eos=True)[1]
    # a user's last message is not the answer's role: nothing echoed
    user_only = [{"role": "user", "content": "tell a story"}]
    uids = tok.encode(tok.apply_chat_template(user_only, add_generation_prompt=True), False)
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=user_only,
        max_tokens=6,
        extra_body={"ignore_eos": True, "echo": True},
    )
    assert out.choices[0].message.content == expect(tok, uids, 6, ignore_eos=True)[1]


def _sse(cluster, path, **body) -> list:
    with httpx.stream(
        "POST", f"{cluster.url}{path}", json={"model": MODEL_NAME, **body}, timeout=30
    ) as r:
        return sse_events(r)


def _post(cluster, path, **body):
    r = httpx.post(f"{cluster.url}{path}", json={"model": MODEL_NAME, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_echo_and_prompt_logprobs(cluster, tok):
    # vLLM's echo (was a 400) and prompt_logprobs (was a 400): the fake worker's prompt
    # logprobs (fake_prompt_logprobs) in vLLM's field and, with echo and logprobs, leading
    # OpenAI's logprobs object
    prompt = "echo me please"
    ids = tok.encode(prompt)
    toks, text, _ = expect(tok, ids, 5, ignore_eos=True)
    fake = fw.fake_prompt_logprobs(ids, 2, VOCAB)
    body = _post(
        cluster, "/v1/completions", prompt=prompt, max_tokens=5, ignore_eos=True, echo=True, n=2
    )
    assert [c["text"] for c in body["choices"]] == [
        prompt + expect(tok, ids, 5, index=i, ignore_eos=True)[1] for i in range(2)
    ]
    body = _post(
        cluster, "/v1/completions", prompt=ids, max_tokens=5, ignore_eos=True, echo=True, logprobs=2
    )
    (c,) = body["choices"]
    echoed = tok.decode(ids)
    assert c["text"] == echoed + text
    lp = c["logprobs"]
    assert lp["tokens"] == [tok.token_str(t) for t in ids + toks]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1 : len(ids)] == pytest.approx([f.logprob for f in fake])
    assert lp["text_offset"][len(ids)] == len(echoed)  # the output's offsets follow the echo
    assert c["prompt_logprobs"] == [None] + [
        {
            str(t): {
                "logprob": pytest.approx(f.logprob),
                "rank": f.rank,
                "decoded_token": tok.token_str(t),
            },
            **{
                str(x.token_id): {
                    "logprob": pytest.approx(x.logprob),
                    "rank": r,
                    "decoded_token": tok.token_str(x.token_id),
                }
                for r, x in enumerate(f.top, 1)
                if x.token_id != t
            },
        }
        for t, f in zip(ids[1:], fake)
    ]
    # max_tokens 0 with echo: the prompt alone (one token is drawn and dropped, as in vLLM)
    body = _post(cluster, "/v1/completions", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    (c,) = body["choices"]
    assert c["text"] == prompt and c["finish_reason"] == "length"
    assert len(c["logprobs"]["tokens"]) == len(ids)
    # streamed echo: the same text, the prompt in each choice's first chunk
    events = _sse(
        cluster,
        "/v1/completions",
        prompt=prompt,
        max_tokens=5,
        ignore_eos=True,
        echo=True,
        stream=True,
    )
    chunks = [e for e in events if e != "[DONE]"]
    assert chunks[0]["choices"][0]["text"].startswith(prompt)
    assert "".join(e["choices"][0]["text"] for e in chunks) == prompt + text
    # prompt_logprobs alone; chat has them at the top level
    body = _post(cluster, "/v1/completions", prompt=prompt, max_tokens=2, prompt_logprobs=0)
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and [list(d) for d in plp[1:]] == [[str(t)] for t in ids[1:]]
    assert body["choices"][0]["logprobs"] is None
    msgs = [{"role": "user", "content": "hi"}]
    chat_ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), False)
    body = _post(cluster, "/v1/chat/completions", messages=msgs, max_tokens=2, prompt_logprobs=1)
    assert len(body["prompt_logprobs"]) == len(chat_ids) and body["prompt_logprobs"][0] is None


def test_return_token_ids(cluster, tok):
    # vLLM's return_token_ids (RL and agent frameworks read the ids instead of re-tokenizing):
    # the prompt's and each choice's ids, streamed per chunk. Was ignored as an unknown field.
    prompt = "token ids please"
    ids = tok.encode(prompt)
    req = dict(prompt=prompt, max_tokens=6, ignore_eos=True, n=2, return_token_ids=True)
    body = _post(cluster, "/v1/completions", **req)
    for c in body["choices"]:
        assert c["prompt_token_ids"] == ids
        assert c["token_ids"] == expect(tok, ids, 6, index=c["index"], ignore_eos=True)[0]
    chunks = [e for e in _sse(cluster, "/v1/completions", **req, stream=True) if e != "[DONE]"]
    for i in range(2):
        mine = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == i]
        assert mine[0]["prompt_token_ids"] == ids
        assert all("prompt_token_ids" not in c for c in mine[1:])
        streamed = [t for c in mine for t in c["token_ids"]]
        assert streamed == expect(tok, ids, 6, index=i, ignore_eos=True)[0]
    msgs = [{"role": "user", "content": "ids"}]
    chat_ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), False)
    want = expect(tok, chat_ids, 5, ignore_eos=True)[0]
    req = dict(messages=msgs, max_tokens=5, ignore_eos=True, return_token_ids=True)
    body = _post(cluster, "/v1/chat/completions", **req)
    assert body["prompt_token_ids"] == chat_ids and body["choices"][0]["token_ids"] == want
    chunks = [e for e in _sse(cluster, "/v1/chat/completions", **req, stream=True) if e != "[DONE]"]
    assert chunks[0]["prompt_token_ids"] == chat_ids
    assert all("prompt_token_ids" not in e for e in chunks[1:])
    assert [t for e in chunks for t in e["choices"][0]["token_ids"]] == want
    # without the flag: no ids anywhere
    body = _post(cluster, "/v1/completions", prompt=prompt, max_tokens=2)
    assert body["choices"][0]["token_ids"] is None


@pytest.mark.parametrize(
    "side, keep", [(None, slice(-4, None)), ("left", slice(-4, None)), ("right", slice(0, 4))]
)
def test_truncation_side(cluster, side, keep):
    # vLLM's truncation_side with truncate_prompt_tokens ("right" keeps the first tokens);
    # was ignored as an unknown field, so "right" silently kept the last ones
    ids = list(range(100, 110))
    extra = {} if side is None else {"truncation_side": side}
    body = _post(
        cluster,
        "/v1/completions",
        prompt=ids,
        max_tokens=1,
        truncate_prompt_tokens=4,
        return_token_ids=True,
        **extra,
    )
    assert body["choices"][0]["prompt_token_ids"] == ids[keep]


def test_n2_gives_two_distinct_choices(cluster, tok):
    client = cluster.openai()
    out = client.completions.create(
        model=MODEL_NAME, prompt="two samples", max_tokens=8, n=2, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in out.choices] == [0, 1]
    ids = tok.encode("two samples")
    for c in out.choices:
        assert c.text == expect(tok, ids, 8, index=c.index, ignore_eos=True)[1]
    assert out.choices[0].text != out.choices[1].text
    assert out.usage.completion_tokens == 16 and out.usage.prompt_tokens == len(ids)
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="two samples",
        max_tokens=8,
        n=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = {0: "", 1: ""}
    for ch in stream:
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == {0: out.choices[0].text, 1: out.choices[1].text}


def test_stop_string_truncates_and_counts_tokens_to_the_match(cluster, tok):
    client = cluster.openai()
    prompt = "stop strings please"
    ids = tok.encode(prompt)
    toks, full, _ = expect(tok, ids, 40, ignore_eos=True)
    stop = full[20:24]
    cut = full.index(stop)
    n_tokens = next(k for k in range(1, 41) if stop in tok.decode(toks[:k]))
    for stream in (False, True):
        resp = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=40,
            stop=[stop],
            stream=stream,
            stream_options={"include_usage": True} if stream else None,
            extra_body={"ignore_eos": True},
        )
        if stream:
            chunks = list(resp)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0] for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            text, finish, usage = resp.choices[0].text, resp.choices[0], resp.usage
        assert text == full[:cut]
        assert finish.finish_reason == "stop" and finish.stop_reason == stop
        assert usage.completion_tokens == n_tokens


def test_eos_ends_unless_ignore_eos(cluster, tok):
    client = cluster.openai()
    prompt, eos_at = prompt_with_eos(tok, 60)
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=60)
    assert out.choices[0].finish_reason == "stop" and out.choices[0].stop_reason is None
    assert out.usage.completion_tokens == eos_at  # the EOS token counts
    assert "</s>" not in out.choices[0].text
    out = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=60, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 60


def test_stop_token_ids(cluster, tok):
    client = cluster.openai()
    ids = tok.encode("token stop")
    toks, _, _ = expect(tok, ids, 30, ignore_eos=True)
    stop_id = toks[5]
    first = toks.index(stop_id)
    out = client.completions.create(
        model=MODEL_NAME,
        prompt="token stop",
        max_tokens=30,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]},
    )
    c = out.choices[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id
    assert out.usage.completion_tokens == first + 1
    assert c.text == tok.decode(toks[:first])


def test_completion_logprobs(cluster, tok):
    client = cluster.openai()
    out = client.completions.create(
        model=MODEL_NAME,
        prompt="log probs",
        max_tokens=6,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    toks, _, _ = expect(tok, tok.encode("log probs"), 6, ignore_eos=True)
    assert lp.tokens == [tok.token_str(t) for t in toks]
    assert len(lp.token_logprobs) == 6 and all(x < 0 for x in lp.token_logprobs)
    assert all(len(t) >= 1 and lp.tokens[i] in t for i, t in enumerate(lp.top_logprobs))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_logprobs_stream_and_not(cluster, tok):
    client = cluster.openai()
    msgs = [{"role": "user", "content": "lp"}]
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=msgs,
        max_tokens=5,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token for c in content)
    toks, _, _ = expect(
        tok,
        tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), False),
        5,
        ignore_eos=True,
    )
    raw = b"".join(bytes(c.bytes) for c in content)
    assert raw == b"".join(tok.token_bytes(t) for t in toks)  # exact bytes, even split UTF-8
    # the text is the same bytes, minus an incomplete character at the very end (never emitted)
    full = raw.decode(errors="replace")
    text = out.choices[0].message.content
    assert full.startswith(text) and set(full[len(text) :]) <= {"\ufffd"}
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=msgs,
        max_tokens=5,
        logprobs=True,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = [
        c
        for ch in stream
        if ch.choices and ch.choices[0].logprobs
        for c in ch.choices[0].logprobs.content
    ]
    assert [c.token for c in streamed] == [c.token for c in content]


def test_token_id_prompts_and_batches(cluster, tok):
    client = cluster.openai()
    ids = tok.encode("raw ids")
    out = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].text == expect(tok, ids, 4, ignore_eos=True)[1]
    assert out.usage.prompt_tokens == len(ids)
    prompts = ["first prompt", "second prompt", "third"]
    out = client.completions.create(
        model=MODEL_NAME, prompt=prompts, max_tokens=4, n=2, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in out.choices] == list(range(6))
    for c in out.choices:
        p = tok.encode(prompts[c.index // 2])
        assert c.text == expect(tok, p, 4, index=c.index % 2, ignore_eos=True)[1]
    assert out.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert out.usage.completion_tokens == 24


def test_vllm_bench_serve_request_shape(cluster, tok):
    """Exactly what ``vllm bench serve --backend openai`` sends, parsed as it parses."""
    body = {
        "model": MODEL_NAME,
        "prompt": "benchmark prompt text",
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
        "repetition_penalty": 1.0,
        "logprobs": None,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    headers = {"x-request-id": "bench-123"}
    with httpx.stream(
        "POST", f"{cluster.url}/v1/completions", json=body, headers=headers, timeout=30
    ) as r:
        assert r.status_code == 200
        first_with_choices, usage, text = None, None, ""
        for i, line in enumerate(r.iter_lines()):
            chunk = line.strip().removeprefix("data: ")
            if not chunk or chunk.startswith(":") or chunk == "[DONE]":
                continue
            data = json.loads(chunk)
            if choices := data.get("choices"):
                first_with_choices = first_with_choices if first_with_choices is not None else i
                text += choices[0]["text"]
            elif u := data.get("usage"):
                usage = u
    assert first_with_choices is not None
    assert usage["completion_tokens"] == 16 and usage["prompt_tokens"] == len(
        tok.encode(body["prompt"])
    )
    assert text == expect(tok, tok.encode(body["prompt"]), 16, ignore_eos=True)[1]


def test_tokenize_detokenize_models_health_metrics(cluster, tok):
    r = httpx.post(f"{cluster.url}/tokenize", json={"model": MODEL_NAME, "prompt": "héllo"}).json()
    assert r["tokens"] == tok.encode("héllo") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 4096
    msgs = [{"role": "user", "content": "hi"}]
    r2 = httpx.post(f"{cluster.url}/tokenize", json={"messages": msgs}).json()
    assert r2["tokens"] == tok.encode(
        tok.apply_chat_template(msgs, add_generation_prompt=True), False
    )
    d = httpx.post(
        f"{cluster.url}/detokenize", json={"model": MODEL_NAME, "tokens": r["tokens"]}
    ).json()
    assert d["prompt"] == "<s>héllo"
    models = cluster.openai().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    h = httpx.get(f"{cluster.url}/health")
    assert h.status_code == 200 and h.json()["decode_workers"] == 1
    text = httpx.get(f"{cluster.url}/metrics").text
    for name in (
        "pdserve:router_requests_total",
        "pdserve:router_retries_total",
        "pdserve:router_time_to_first_token_seconds_bucket",
        "pdserve:router_inter_token_latency_seconds_bucket",
        "pdserve:router_e2e_request_latency_seconds_bucket",
    ):
        assert name in text
    # the workers' own series keep vLLM's names: a sum over every pod counts a request once
    assert "pdserve:time_to_first_token_seconds" not in text
    assert "pdserve:prompt_tokens_total" not in text
    assert cluster.metric("pdserve:router_requests_total", path="local") >= 1
    assert cluster.metric("pdserve:router_time_to_first_token_seconds_count") >= 1


def test_continuous_usage_stats(cluster, tok):
    body = {
        "model": MODEL_NAME,
        "prompt": "running usage",
        "max_tokens": 6,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=30) as r:
        events = sse_events(r)
    counts = [e["usage"]["completion_tokens"] for e in events[:-1]]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(e["usage"]["prompt_tokens"] == len(tok.encode("running usage")) for e in events[:-1])


@pytest.mark.parametrize("stream", [False, True])
def test_usage_keeps_the_cached_tokens_when_a_stop_string_ends_the_request(cluster, stream):
    # The router ends a request whose samples all hit a stop string without waiting for the
    # worker's last chunk, which carried the usage: prompt_tokens_details was null there, and
    # {"cached_tokens": N} without the stop (found by review, 2026-12-06). The first tokens'
    # chunk now carries it too.
    body = {"model": MODEL_NAME, "prompt": "usage details with a stop", "max_tokens": 16}
    body |= {"ignore_eos": True, "n": 2, "temperature": 1.0, "seed": 5}
    plain = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=30).json()
    texts = [c["text"] for c in plain["choices"]]
    stops = [t[3:5] for t in texts]
    assert all(s.strip() for s in stops), texts
    body |= {"stop": stops}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=30) as r:
            events = sse_events(r)
        usage = next(e["usage"] for e in events if e != "[DONE]" and e.get("usage"))
        finishes = [c["finish_reason"] for e in events if e != "[DONE]" for c in e["choices"]]
        assert finishes.count("stop") == 2
    else:
        r = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=30).json()
        assert [c["finish_reason"] for c in r["choices"]] == ["stop", "stop"], r
        usage = r["usage"]
    assert plain["usage"]["prompt_tokens_details"] is not None
    assert usage["prompt_tokens_details"] is not None, usage
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0
