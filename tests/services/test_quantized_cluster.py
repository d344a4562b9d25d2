"""A quantized checkpoint through the whole cluster: router, prefill and decode processes, the
KV pushed over UCX. Greedy output through the router equals ``transformers`` on the checkpoint
dequantized by the test's reference functions, and ``/v1/models`` states the scheme the workers
advertise; ``pdserve up --quantization int8`` passes the flag on to every worker."""

from __future__ import annotations

import pytest

from tests.cluster_utils import make_cluster
from tests.engine.helpers import hf_greedy, random_prompts
from tests.engine.test_quantization import ref_dequant_dir

pytestmark = pytest.mark.integration


def _complete(url: str, prompt: list[int], n: int) -> list[int]:
    import httpx

    r = httpx.post(
        f"{url}/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        },
        timeout=120,
    )
    r.raise_for_status()
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _served(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]


def test_gptq_checkpoint_disaggregated_through_the_router(tiny_llama, tmp_path):
    from shared.cli.quantize import quantize_checkpoint

    q = quantize_checkpoint(tiny_llama, tmp_path / "gptq", "gptq", 4, 32, desc_act=True)
    dense = ref_dequant_dir(q, tmp_path / "dense")
    prompts = random_prompts(31, lengths=[5, 40, 130])
    want = hf_greedy(dense, prompts, 10)
    c = make_cluster(q, tmp_path / "run")
    try:
        c.start_redis()
        workers = [c.spawn_worker("prefill", 0), c.spawn_worker("decode", 0)]
        c.wait_ready(workers)
        url = c.start_router()
        assert _served(url)["quantization"] == ["gptq (w4a16, group 32, symmetric, act-order)"]
        got = [_complete(url, p, 10) for p in prompts]
        assert got == want
    finally:
        c.stop()


def test_on_the_fly_int8_flag_reaches_the_workers(tiny_llama, tmp_path):
    c = make_cluster(tiny_llama, tmp_path / "run", "--quantization", "int8")
    try:
        c.start_redis()
        workers = [c.spawn_worker("prefill", 0), c.spawn_worker("decode", 0)]
        c.wait_ready(workers)
        url = c.start_router()
        assert _served(url)["quantization"] == ["int8 (w8a16, per-channel, symmetric)"]
        assert len(_complete(url, [5, 6, 7], 4)) == 4
    finally:
        c.stop()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_on_the_disaggregated_path(method, tiny_llama, tmp_path):
    """The decode worker speculates on KV that arrived from the prefill worker (a draft model
    rebuilds its own KV of the prompt); greedy output through the router is still
    transformers' and the drafts are counted."""
    import json

    import httpx

    from shared.cli.tiny_model import truncate_layers

    prompts = [p * 3 for p in random_prompts(32, lengths=[20, 45])]
    want = hf_greedy(tiny_llama, prompts, 24)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    if method == "draft_model":
        draft = truncate_layers(tiny_llama, tmp_path / "draft", 1)
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    c = make_cluster(tiny_llama, tmp_path / "run", "--speculative-config", json.dumps(spec))
    try:
        c.start_redis()
        workers = [c.spawn_worker("prefill", 0), c.spawn_worker("decode", 0)]
        c.wait_ready(workers)
        url = c.start_router()
        got = [_complete(url, p, 24) for p in prompts]
        assert got == want
        metrics = httpx.get(c.ready["decode-0"]["metrics"], timeout=10).text
        drafts = [
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("pdserve:spec_decode_num_draft_tokens_total")
        ]
        assert drafts and drafts[0] > 0
    finally:
        c.stop()
