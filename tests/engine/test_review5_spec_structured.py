"""Review 5 of speculative decoding and structured outputs (2026-12-06).

- A constrained request aborted while its step was in flight (pipeline parallelism, two steps in
  flight over the real runner) left its grammar matcher in the sampler for good: the abort's
  drop came with the next dispatch, and collecting the older step built the matcher again.
- xgrammar's compiler cache had no bound (``cache_limit_bytes=-1``): every distinct schema a
  client sent stayed in memory, whatever the LRU of compiled handles held.
- A draft model's KV twin pool was allocated on top of the KV budget, and its catch-up forward
  was not bounded by ``max_num_batched_tokens``.
"""

from __future__ import annotations

import pytest

from shared.config import EngineArgs
from shared.engine import EngineCore
from shared.engine.sampling_params import SamplingParams, StructuredOutputsParams


def _pp_run(model, depth: int, abort: bool) -> tuple[dict[str, list[int]], EngineCore]:
    e = EngineCore(EngineArgs(model=str(model), device="cpu", kv_cache_memory="16MiB"))
    e._depth = depth  # the engine's pipelined loop over the real runner's dispatch/collect
    so = StructuredOutputsParams(json_object=True)
    outs: dict[str, list[int]] = {}
    aborted: set[str] = set()

    def step() -> None:
        for o in e.step():
            assert o.request_id not in aborted, "an aborted request's draws reached its output"
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)

    for i in range(4):
        sp = SamplingParams(temperature=0, max_tokens=12, structured_outputs=so)
        e.add_request(f"g{i}", [5 + i, 6, 7, 8], sp)
        e.add_request(f"p{i}", [9 + i, 10, 11], SamplingParams(temperature=0, max_tokens=12))
        for _ in range(3):
            step()
        if abort:
            e.abort_request([f"g{i}"])
            aborted.add(f"g{i}")
    while e.has_unfinished_requests():
        step()
        e.check_integrity()
    return outs, e


@pytest.mark.integration
def test_an_aborted_constrained_request_leaves_no_matcher_in_flight(tiny_llama):
    ref, _ = _pp_run(tiny_llama, 1, abort=False)
    got, e = _pp_run(tiny_llama, 2, abort=True)
    assert e.max_inflight_steps == 2  # the aborts came while a step was in flight
    assert sorted(e.runner.sampler.matchers._m) == []
    assert e.runner._uncollected == []
    # the others' tokens are those of plain decoding
    for i in range(4):
        assert got[f"p{i}"] == ref[f"p{i}"]
    assert e.kv.pool.num_free_blocks == e.kv.pool.num_blocks


@pytest.mark.integration
def test_xgrammar_compile_cache_is_bounded(tiny_llama, monkeypatch):
    import json

    from shared.engine.structured_output import GrammarCompiler

    mc = EngineArgs(model=str(tiny_llama)).create_model_config()

    def compiler() -> GrammarCompiler:
        gc = GrammarCompiler(str(tiny_llama), mc.vocab_size, mc.eos_token_ids)
        gc.compile(StructuredOutputsParams(regex="a+"))
        return gc

    monkeypatch.delenv("PDSERVE_GRAMMAR_CACHE_MIB", raising=False)
    assert compiler()._compiler.cache_limit_bytes == 512 << 20  # type: ignore[attr-defined]
    monkeypatch.setenv("PDSERVE_GRAMMAR_CACHE_MIB", "1")
    gc = compiler()
    assert gc._compiler.cache_limit_bytes == 1 << 20  # type: ignore[attr-defined]
    for n in range(120):  # about 16 KiB each: 1.9 MiB unbounded
        schema = {"type": "object", "properties": {f"k{n}": {"type": "string"}}}
        gc.compile(StructuredOutputsParams(json=json.dumps(schema)))
    assert 0 < gc._compiler.get_cache_size_bytes() <= 1 << 20  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def draft_dir(tiny_llama, tmp_path_factory):
    from shared.cli.tiny_model import truncate_layers

    return truncate_layers(tiny_llama, tmp_path_factory.mktemp("draft") / "d1", 1)


def _draft_engine(tiny_llama, draft_dir, speculate: bool = True, **kw) -> EngineCore:
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}
    args = {"kv_cache_memory": "8MiB", "max_model_len": 400, "max_num_batched_tokens": 64}
    args["max_num_seqs"] = 8
    args.update(kw)
    return EngineCore(
        EngineArgs(
            model=str(tiny_llama),
            device="cpu",
            speculative_config=spec if speculate else None,
            **args,  # type: ignore[arg-type]
        )
    )


@pytest.mark.integration
def test_the_draft_twin_pool_fits_in_the_kv_budget(tiny_llama, draft_dir):
    budget = 8 << 20
    e = _draft_engine(tiny_llama, draft_dir)
    r = e.runner
    target = r.kv_cache.numel() * r.kv_cache.element_size()
    twin = r.drafter.kv.numel() * r.drafter.kv.element_size()
    assert r.drafter.kv.shape[0] == r.kv_cache.shape[0] == e.num_blocks
    assert target + twin <= budget
    # the largest split that fits: one more block of each would not
    assert target + twin + r.block_bytes + r.drafter.block_bytes > budget
    # without a draft model the pool takes the whole budget, as before
    plain = _draft_engine(tiny_llama, draft_dir, speculate=False)
    assert plain.num_blocks == budget // plain.runner.block_bytes > e.num_blocks


@pytest.mark.integration
def test_the_draft_catch_up_is_bounded_by_max_num_batched_tokens(tiny_llama, draft_dir):
    import random

    def run(speculate: bool) -> tuple[dict[str, list[int]], list[int]]:
        e = _draft_engine(tiny_llama, draft_dir, speculate, kv_cache_memory="32MiB")
        sizes: list[int] = []
        if speculate:
            dr = e.runner.drafter
            forward = dr._forward

            def counted(chunks):  # type: ignore[no-untyped-def]
                sizes.append(sum(len(t) for _, _, t in chunks))
                return forward(chunks)

            dr._forward = counted
        rng = random.Random(1)
        for i in range(6):
            base = [rng.randrange(3, 2048) for _ in range(40)]
            sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            e.add_request(f"r{i}", base * 4, sp)  # a 160-token prompt: its draft catch-up
        outs: dict[str, list[int]] = {}
        while e.has_unfinished_requests():
            for o in e.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            e.check_integrity()
        return outs, sizes

    ref, _ = run(False)
    got, sizes = run(True)
    assert sizes and max(sizes) <= 64
    assert got == ref
