"""A worker that runs its small steps on one thread and the rest on all of them
(``shared/engine/model_runner.py::small_step_tokens``) gives transformers' greedy tokens, and
really switches: prefill chunks on 2 threads, single-sequence decode steps on 1."""

from __future__ import annotations

import os
import random
import threading

import pytest
import torch

from kernels import cpu_linear, cpu_paged
from shared.cpu_bind import BIND_ENV, SPILL_ENV
from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams
from tests.engine.helpers import hf_greedy, mismatches

pytestmark = pytest.mark.integration


def _greedy_watching_forwards(tiny_llama, monkeypatch, watch):
    """Five prompts through the small model on 2 torch threads (3 sequences at most), greedy;
    ``watch`` sees every forward's positional arguments first; the tokens must be
    transformers'. Returns the engine's runner."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(str(tiny_llama), device="cpu", kv_cache_memory="64MiB", max_num_seqs=3)
        runner = llm.engine.runner
        forward = runner.model.forward

        def watched(*a, **k):
            watch(*a)
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
        return runner
    finally:
        torch.set_num_threads(before)


def test_switching_threads_keeps_transformers_tokens(tiny_llama, monkeypatch):
    monkeypatch.setenv("PDSERVE_SMALL_STEP_TOKENS", "4")
    seen: list[int] = []
    _greedy_watching_forwards(
        tiny_llama, monkeypatch, lambda *a: seen.append(torch.get_num_threads())
    )
    assert set(seen) == {1, 2}, "prefills on 2 threads, the last decode steps on 1"


def test_small_steps_over_many_cached_tokens_take_every_thread(tiny_llama, monkeypatch):
    """A step of few tokens whose attention reads ``PDSERVE_SPILL_KV_TOKENS`` or more distinct
    cached tokens (a decode step of long contexts, bound by reading their K/V) runs on every
    thread; one over fewer on one (counting a shared prefix once); transformers' tokens either
    way."""
    monkeypatch.setenv("PDSERVE_SMALL_STEP_TOKENS", "4")
    monkeypatch.setenv("PDSERVE_SPILL_KV_TOKENS", "160")
    seen: list[tuple[int, int, int]] = []  # (tokens, cached tokens read, threads)

    def watch(input_ids, positions, kv_cache, meta, *rest):
        seen.append((int(input_ids.shape[0]), int(meta.seq_lens.sum()), torch.get_num_threads()))

    runner = _greedy_watching_forwards(tiny_llama, monkeypatch, watch)
    small = [(kv, th) for t, kv, th in seen if t <= 4]
    assert {th for kv, th in small if kv >= 160} == {2}
    assert {th for kv, th in small if kv < 160} == {1}
    # a prefix that several sequences share is read once: three decode rows of 100 tokens
    # (7 blocks of 16) sharing their first 6 blocks read 9 distinct blocks (144 tokens)
    shared = [([0, 1, 2, 3, 4, 5, 6 + i], 99, [7]) for i in range(3)]
    alone = [([7 * i + j for j in range(7)], 99, [7]) for i in range(3)]
    assert runner.block_size == 16
    assert not runner._reads_much_kv(shared)
    assert runner._reads_much_kv(alone)


def _spilled_steps(tiny_llama, monkeypatch) -> set[tuple[int, frozenset[int]]]:
    """Generate on a thread of its own (the engine thread's affinity changes stay there) with a
    lone bound worker's settings; transformers' tokens; the (threads, CPUs) of every forward."""
    home, spill = sorted(os.sched_getaffinity(0))[:2]
    monkeypatch.setenv(BIND_ENV, str(home))
    monkeypatch.setenv(SPILL_ENV, str(spill))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(str(tiny_llama), device="cpu", kv_cache_memory="64MiB", max_num_seqs=3)
        runner = llm.engine.runner
        seen: set[tuple[int, frozenset[int]]] = set()
        forward = runner.model.forward

        def watched(*a, **k):
            seen.add((torch.get_num_threads(), frozenset(os.sched_getaffinity(0))))
            return forward(*a, **k)

        monkeypatch.setattr(runner.model, "forward", watched)
        rng = random.Random(4)
        prompts = [[rng.randrange(3, 2048) for _ in range(rng.randint(20, 90))] for _ in range(5)]
        result: dict = {}

        def engine_thread():
            try:
                result["outs"] = llm.generate(
                    [{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                )
            except BaseException as e:  # noqa: BLE001 - re-raised below
                result["error"] = e

        t = threading.Thread(target=engine_thread)
        t.start()
        t.join(300)
        assert not t.is_alive() and "error" not in result, result.get("error")
        got = [o.outputs[0].token_ids for o in result["outs"]]
        assert mismatches(got, hf_greedy(tiny_llama, prompts, 24)) == []
        return seen
    finally:
        torch.set_num_threads(before)


needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")


@needs_two_cpus
def test_long_steps_spill_onto_the_routers_cpu(tiny_llama, monkeypatch):
    """A lone bound worker (``PDSERVE_CPU_SPILL_BIND``): the engine thread runs short steps on
    one thread on its own CPU and widens itself to the spill CPU, with a second thread, for
    long ones (here more than 4 tokens)."""
    home, spill = sorted(os.sched_getaffinity(0))[:2]
    monkeypatch.setenv("PDSERVE_SMALL_STEP_TOKENS", "4")
    seen = _spilled_steps(tiny_llama, monkeypatch)
    assert seen == {(1, frozenset({home})), (2, frozenset({home, spill}))}


@needs_two_cpus
def test_spill_with_small_steps_off_takes_both_cpus_for_every_step(tiny_llama, monkeypatch):
    """``PDSERVE_SMALL_STEP_TOKENS=0`` on a lone bound worker: every step on both CPUs (not
    two threads crowded on the worker's own one)."""
    home, spill = sorted(os.sched_getaffinity(0))[:2]
    monkeypatch.setenv("PDSERVE_SMALL_STEP_TOKENS", "0")
    seen = _spilled_steps(tiny_llama, monkeypatch)
    assert seen == {(2, frozenset({home, spill}))}


def test_the_runner_reads_heavy_projections_from_the_linear_plan(tiny_llama, monkeypatch):
    """A bf16 model on the avx2 plan spills steps of more than 4 tokens; an fp32 one (MKL's
    sgemm) keeps the 256-token rule."""
    home, spill = (
        sorted(os.sched_getaffinity(0))[:2] if len(os.sched_getaffinity(0)) > 1 else (0, 1)
    )
    monkeypatch.setenv(BIND_ENV, str(home))
    monkeypatch.setenv(SPILL_ENV, str(spill))
    monkeypatch.delenv("PDSERVE_SMALL_STEP_TOKENS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        fp32 = LLM(str(tiny_llama), device="cpu", kv_cache_memory="16MiB").engine.runner
        assert not fp32.model.heavy_projections() and fp32._small_step_tokens == 256
        if not cpu_paged.avx2_linear_available():
            pytest.skip("the AVX2 kernel is not built here")
        monkeypatch.setenv(cpu_linear.PATH_ENV, "avx2")
        bf16 = LLM(
            str(tiny_llama), device="cpu", dtype="bfloat16", kv_cache_memory="16MiB"
        ).engine.runner
        assert bf16.model.heavy_projections() and bf16._small_step_tokens == 4
    finally:
        torch.set_num_threads(before)
