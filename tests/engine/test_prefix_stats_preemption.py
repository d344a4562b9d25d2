"""The prefix-cache stats (``pdserve:prefix_cache_queries`` / ``hits``) count each request's
lookup once, at its first admission (found by review, 2026-12-06): a request preempted for
recompute looked its prompt (and its output so far) up again when re-admitted, and that
lookup counted too, hits on the blocks it had computed itself included: 6 prompts of 40
tokens with 3 preemptions made 467 queried tokens. vLLM keeps a preempted request's lookups
out of vllm:prefix_cache_queries / hits."""

from __future__ import annotations

import random

import pytest

from shared.engine.sampling_params import SamplingParams
from tests.engine.fakes import fake_engine

pytestmark = pytest.mark.unit


def test_a_readmission_after_preemption_counts_no_prefix_lookup(tmp_path):
    # 24 blocks of 16 tokens for 6 requests of 40 + 60 tokens (7 blocks each): they preempt
    e = fake_engine(
        tmp_path,
        num_blocks=24,
        max_model_len=256,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        preemption_mode="recompute",
    )
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 97) for _ in range(40)] for _ in range(6)]
    sp = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0)
    for i, p in enumerate(prompts):
        e.add_request(f"r{i}", p, sp)
    got: dict[str, list[int]] = {}
    for _ in range(5000):
        if not e.has_unfinished_requests():
            break
        for o in e.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    s = e.stats()
    assert s.num_preemptions > 0, "the pool was meant to be too small for the batch"
    assert all(len(t) == 60 for t in got.values()) and len(got) == 6
    # each prompt once; no prompt shares a full block with another: no hit
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (6 * 40, 0)
