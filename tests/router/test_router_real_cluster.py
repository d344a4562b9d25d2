"""The router in front of real workers (1 prefill + 2 decode engines on the tiny model): a decode
worker SIGKILLed mid-stream, and the greedy output still equals the undisturbed run."""

from __future__ import annotations

import os
import signal
import time

import grpc
import httpx
import pytest

from shared.proto import pdserve_pb2 as pb
from tests.cluster_utils import channel_to, decode_stub, make_cluster

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    c = make_cluster(
        tiny_llama,
        tmp_path_factory.mktemp("rc"),
        "--router-arg=--local-prefill-threshold=0",
        "--router-arg=--worker-cooldown=30",
        prefill=1,
        decode=2,
    )
    try:
        url = c.start()
        yield c, url
    finally:
        c.stop()


def _decode_stats(c):
    out = {}
    for name in ("decode-0", "decode-1"):
        child = next(ch for ch in c.children if ch.name == name)
        if child.proc.poll() is None:
            with channel_to(c.ready[name]["grpc"]) as ch:
                out[name] = decode_stub(ch).Stats(pb.StatsRequest(), timeout=10)
    return out


def _wait_routable(c, url: str, worker: str, ids: list[int], timeout: float = 10.0) -> None:
    """Until ``worker`` holds the last full block of ``ids`` in the directory and the router's
    copy of the directory applied every event written so far."""
    import redis
    from prometheus_client.parser import text_string_to_metric_families

    from shared.directory import DirectoryKeys
    from shared.hashing import block_hashes, hash_seed

    keys = DirectoryKeys()
    model = c.served_model_name
    last = block_hashes(ids, 16, hash_seed(model))[-1]
    client = redis.Redis.from_url(c.redis_url, decode_responses=True)
    deadline = time.monotonic() + timeout
    try:
        while True:
            held = any(m.startswith(f"{worker}:") for m in client.smembers(keys.block(model, last)))
            written = int(client.get(keys.events_counter(model)) or 0)
            text = httpx.get(f"{url}/metrics", timeout=5).text
            applied = {
                s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            }
            if (
                held
                and applied.get("pdserve:router_directory_mirror_synced")
                and applied.get("pdserve:router_directory_mirror_last_event") == written
            ):
                return
            assert time.monotonic() < deadline, f"{worker}'s blocks never reached the router"
            time.sleep(0.02)
    finally:
        client.close()


def test_cached_prefix_routes_to_its_decode_worker(cluster):
    """Runs before the kill test (file order): a follow-up sharing a long prefix goes to the
    decode worker that already holds it, for three different prefixes."""
    import random

    import openai

    c, url = cluster
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    rng = random.Random(5)
    for trial in range(3):
        prefix = [rng.randrange(3, 2000) for _ in range(320)]
        before = _decode_stats(c)
        client.completions.create(
            model=c.served_model_name, prompt=prefix, max_tokens=2, temperature=0
        )
        mid = _decode_stats(c)
        first = [n for n in mid if mid[n].prefix_cache_queries > before[n].prefix_cache_queries]
        assert len(first) == 1, f"trial {trial}: served by {first}"
        _wait_routable(c, url, first[0], prefix)
        follow = prefix + [rng.randrange(3, 2000) for _ in range(40)]
        client.completions.create(
            model=c.served_model_name, prompt=follow, max_tokens=2, temperature=0
        )
        after = _decode_stats(c)
        hit = [n for n in after if after[n].prefix_cache_hits - mid[n].prefix_cache_hits >= 320]
        assert hit == first, f"trial {trial}: prefix on {first}, follow-up hit on {hit}"


def test_prompt_logprobs_and_echo_through_the_cluster(cluster, tiny_llama):
    """vLLM's prompt_logprobs and echo with logprobs, through the router and real workers:
    equal to transformers' fp32 log-softmax; the decode worker computes the prompt itself (no
    prefill worker, no cache read), whatever it already holds. Runs before the kill test."""
    import random

    from tests.engine.test_prompt_logprobs import hf_prompt_logprobs

    c, url = cluster
    rng = random.Random(9)
    prompt = [rng.randrange(3, 2000) for _ in range(100)]
    body = {"model": c.served_model_name, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    plain = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    r = httpx.post(f"{url}/v1/completions", json={**body, "prompt_logprobs": 2}, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    (choice,) = got["choices"]
    assert choice["text"] == plain["text"]
    plp = choice["prompt_logprobs"]
    ref = hf_prompt_logprobs(tiny_llama, prompt)
    assert plp[0] is None and len(plp) == len(prompt)
    for p in range(1, len(prompt)):
        row, tok = ref[p - 1], prompt[p]
        entry = plp[p][str(tok)]
        assert abs(entry["logprob"] - float(row[tok])) < 1e-4, p
        assert entry["rank"] == int((row > row[tok]).sum()) + 1, p
        assert {str(t) for t in row.topk(2).indices.tolist()} <= set(plp[p]), p
    recent = httpx.get(f"{url}/dashboard/data", timeout=10).json()["recent"]
    assert recent[0]["path"] == "local" and recent[0]["prefill_worker"] == ""
    # echo with logprobs: the prompt's tokens lead, the first without a logprob
    r = httpx.post(f"{url}/v1/completions", json={**body, "echo": True, "logprobs": 1}, timeout=120)
    echo = r.json()["choices"][0]
    lps = echo["logprobs"]["token_logprobs"]
    assert len(lps) == len(prompt) + 3 and lps[0] is None
    assert lps[1 : len(prompt)] == [
        plp[p][str(prompt[p])]["logprob"] for p in range(1, len(prompt))
    ]
    assert echo["text"].endswith(plain["text"]) and len(echo["text"]) > len(plain["text"])


def test_decode_killed_mid_stream_greedy_output_unchanged(cluster):
    import openai

    c, url = cluster
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    kw = {
        "model": c.served_model_name,
        "prompt": "The history of the river and the old mill,",
        "max_tokens": 600,
        "temperature": 0,
        "logprobs": 0,
        "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True},
    }
    ref = client.completions.create(**kw)
    ref_tokens = ref.choices[0].logprobs.tokens
    assert len(ref_tokens) == 600

    # Channels opened before the stream: a new channel takes ~200 ms to connect here, and the
    # whole 600-token stream only ~500 ms, so finding the serving worker through fresh channels
    # (as this test once did) often found it after it had sent its last token: no failover.
    names = ("decode-0", "decode-1")
    channels = {n: c.security.channel(c.ready[n]["grpc"]) for n in names}
    try:
        for ch in channels.values():
            grpc.channel_ready_future(ch).result(timeout=30)
        stubs = {n: decode_stub(ch) for n, ch in channels.items()}
        stream = client.completions.create(
            stream=True, stream_options={"include_usage": True}, **kw
        )
        tokens: list[str] = []
        usage = None
        killed = None
        for chunk in stream:
            if chunk.choices:
                tokens += chunk.choices[0].logprobs.tokens
            elif chunk.usage:
                usage = chunk.usage
            if killed is None and len(tokens) >= 5:
                for name in names:
                    if stubs[name].Stats(pb.StatsRequest(), timeout=10).running:
                        child = next(ch for ch in c.children if ch.name == name)
                        os.killpg(child.proc.pid, signal.SIGKILL)
                        killed = (name, len(tokens))
                        break
    finally:
        for ch in channels.values():
            ch.close()
    assert killed is not None, "no decode worker was running the request"
    assert killed[1] < 300, f"killed only after {killed[1]} of 600 tokens had arrived"
    assert tokens == ref_tokens  # identical greedy continuation, no token lost or repeated
    assert usage.completion_tokens == 600
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    retries = [
        line for line in metrics.splitlines() if line.startswith("pdserve:router_retries_total")
    ]
    assert retries and float(retries[0].split()[-1]) >= 1  # it really failed over
    # the survivor keeps serving
    t0 = time.monotonic()
    out = client.completions.create(
        model=c.served_model_name, prompt="After the failure,", max_tokens=8, temperature=0
    )
    assert out.usage.completion_tokens >= 1 and time.monotonic() - t0 < 60


def test_a_sample_ended_by_a_stop_string_is_aborted_on_the_decode_worker(cluster):
    """n=2: the router ends one sample on a stop string and tells the decode worker to stop
    it (DecodeWorker.Abort) while the other sample goes on to its end."""
    import openai

    c, url = cluster
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    kw = {
        "model": c.served_model_name,
        "prompt": "Two different samples, please:",
        "max_tokens": 200,
        "temperature": 1.0,
        "seed": 4242,
        "n": 2,
        "extra_body": {"ignore_eos": True},
    }
    full = [
        ch.text for ch in sorted(client.completions.create(**kw).choices, key=lambda ch: ch.index)
    ]
    stop = next(
        (
            full[0][k : k + 4]
            for k in range(5, len(full[0]) - 4)
            if full[0][k : k + 4] not in full[1] and full[0][k : k + 4].strip()
        ),
        None,
    )
    assert stop is not None, full

    def stopped_samples() -> float:
        # the sample the router ended on a stop string was aborted on the decode worker, which
        # counts it as vLLM counts a stop string: finished_reason="stop" (ignore_eos: nothing
        # else stops there)
        total = 0.0
        for name in ("decode-0", "decode-1"):
            info = c.ready.get(name)
            if info is None:
                continue
            try:
                text = httpx.get(info["metrics"], timeout=5).text
            except httpx.TransportError:
                continue  # killed by an earlier test
            total += sum(
                float(ln.split()[-1])
                for ln in text.splitlines()
                if ln.startswith("pdserve:request_success_total") and 'finished_reason="stop"' in ln
            )
        return total

    before = stopped_samples()
    got = sorted(client.completions.create(stop=[stop], **kw).choices, key=lambda ch: ch.index)
    assert got[0].text == full[0][: full[0].index(stop)] and got[0].finish_reason == "stop"
    assert got[1].text == full[1] and got[1].finish_reason == "length"
    assert stopped_samples() == before + 1


def test_usage_has_the_cached_tokens_when_a_stop_string_ends_the_request(cluster):
    # the decode worker's first tokens' chunk carries the usage, so a request the router ends
    # on a stop string still reports prompt_tokens_details (null before, found by review)
    c, url = cluster
    body = {
        "model": c.served_model_name,
        "prompt": "A request that a stop string ends early, for its usage details:",
        "max_tokens": 40,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    full = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    text = full["choices"][0]["text"]
    stop = next(text[k : k + 3] for k in range(4, len(text) - 3) if text[k : k + 3].strip())
    for _ in range(2):  # the second run finds the prompt cached
        r = httpx.post(f"{url}/v1/completions", json={**body, "stop": [stop]}, timeout=120)
        got = r.json()
        assert got["choices"][0]["finish_reason"] == "stop", got
        details = got["usage"]["prompt_tokens_details"]
        assert details is not None, got["usage"]
    assert details["cached_tokens"] >= 16, details  # at least one block of the prompt
