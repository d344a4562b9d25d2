"""``EngineCore.stats()``: the prefill backlog the workers export (``pdserve:
prefill_backlog_tokens``, the prefill pool's autoscaling signal in deploy/k8s)."""

from __future__ import annotations

import pytest

from shared.engine.sampling_params import SamplingParams
from tests.engine.fakes import fake_engine

pytestmark = pytest.mark.unit


def test_prefill_backlog_counts_prompt_tokens_not_yet_computed(tmp_path):
    e = fake_engine(tmp_path, max_num_batched_tokens=64)
    assert e.stats().prefill_backlog_tokens == 0
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(3):
        e.add_request(f"r{i}", [(30 * i + j) % 97 for j in range(1, 41)], sp)  # 3 x 40 tokens
    assert e.stats().prefill_backlog_tokens == 120
    e.step()  # one 64-token chunk: r0's 40 and 24 of r1's
    assert e.stats().prefill_backlog_tokens == 56
    e.step()
    assert e.stats().prefill_backlog_tokens == 0  # decode steps add no backlog
    while e.has_unfinished_requests():
        e.step()
    assert e.stats().prefill_backlog_tokens == 0
