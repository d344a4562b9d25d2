"""The OpenAI SDK against a real cluster (router + 1 prefill + 1 decode + Redis) on loopback."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.cluster_utils import make_cluster
from tests.engine.helpers import hf_greedy, random_prompts

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    # Threshold 64: prompts D lacks more than 64 tokens of go through the prefill worker,
    # an idle D too (requests here come one at a time).
    c = make_cluster(
        tiny_llama,
        tmp_path_factory.mktemp("api"),
        "--router-arg=--local-prefill-threshold=64",
        "--router-arg=--idle-local-prefill-tokens=0",
        prefill=1,
        decode=1,
    )
    try:
        url = c.start()
        yield c, url, openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    finally:
        c.stop()


def _ids(logprobs_tokens: list[str]) -> list[int]:
    return [int(t.split(":", 1)[1]) for t in logprobs_tokens]


def _path_counts(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("pdserve:router_requests_total{"):
            path = line.split('path="', 1)[1].split('"', 1)[0]
            out[path] = float(line.split()[-1])
    return out


def test_greedy_completions_equal_transformers_disaggregated(cluster, tiny_llama):
    c, url, client = cluster
    prompts = random_prompts(31, lengths=[40, 150, 333, 700])
    ref = hf_greedy(tiny_llama, prompts, 12)
    before = _path_counts(url)
    for p, want in zip(prompts, ref):
        out = client.completions.create(
            model=c.served_model_name,
            prompt=p,
            max_tokens=12,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        assert _ids(out.choices[0].logprobs.tokens) == want
        assert out.usage.prompt_tokens == len(p) and out.usage.completion_tokens == 12
    after = _path_counts(url)
    assert after["disagg"] - before["disagg"] == 3, (before, after)  # 150, 333, 700 tokens
    assert after["local"] - before["local"] == 1, (before, after)  # 40 tokens: below threshold


def test_chat_streaming_usage_and_text(cluster):
    c, _, client = cluster
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three rivers of the world and say why they matter."},
    ]
    full = client.chat.completions.create(
        model=c.served_model_name, messages=msgs, max_tokens=10, temperature=0
    )
    stream = client.chat.completions.create(
        model=c.served_model_name,
        messages=msgs,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, roles = "", None, []
    for chunk in stream:
        if chunk.choices:
            d = chunk.choices[0].delta
            roles += [d.role] if d.role else []
            text += d.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert roles == ["assistant"]
    assert text == full.choices[0].message.content
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens > 10


def test_n2_seeded_stop_strings_and_logprobs(cluster):
    c, _, client = cluster
    out = client.completions.create(
        model=c.served_model_name,
        prompt="Once upon a time",
        n=2,
        max_tokens=16,
        temperature=0.9,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    assert sorted(ch.index for ch in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 32
    again = client.completions.create(
        model=c.served_model_name,
        prompt="Once upon a time",
        n=2,
        max_tokens=16,
        temperature=0.9,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    assert [ch.text for ch in out.choices] == [ch.text for ch in again.choices]

    base = client.completions.create(
        model=c.served_model_name,
        prompt="The mill by the river",
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = base.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"need a visible stop string from {text!r}"
    cut = client.completions.create(
        model=c.served_model_name,
        prompt="The mill by the river",
        max_tokens=20,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]

    lp = client.chat.completions.create(
        model=c.served_model_name,
        max_tokens=5,
        temperature=0,
        messages=[{"role": "user", "content": "hello"}],
        logprobs=True,
        top_logprobs=3,
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert abs(item.logprob - item.top_logprobs[0].logprob) < 1e-4  # greedy: the top one
