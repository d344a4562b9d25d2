"""A worker that runs its small steps on one thread and the rest on all of them
(``shared/engine/model_runner.py::small_step_tokens``) gives transformers' greedy tokens, and
really switches: prefill chunks on 2 threads, single-sequence decode steps on 1."""

from __future__ import annotations

import random

import pytest
import torch

from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams
from tests.engine.helpers import hf_greedy, mismatches

pytestmark = pytest.mark.integration


def test_switching_threads_keeps_transformers_tokens(tiny_llama, monkeypatch):
    monkeypatch.setenv("PDSERVE_SMALL_STEP_TOKENS", "4")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(str(tiny_llama), device="cpu", kv_cache_memory="64MiB", max_num_seqs=3)
        runner = llm.engine.runner
        seen: list[int] = []
        forward = runner.model.forward

        def watched(*a, **k):
            seen.append(torch.get_num_threads())
            return forward(*a, **k)

        monkeypatch.setattr(runner.model, "forward", watched)
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 2048) for _ in range(rng.randint(20, 90))] for _ in range(5)]
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        )
        got = [o.outputs[0].token_ids for o in outs]
        assert mismatches(got, hf_greedy(tiny_llama, prompts, 24)) == []
        assert set(seen) == {1, 2}, "prefills on 2 threads, the last decode steps on 1"
    finally:
        torch.set_num_threads(before)
