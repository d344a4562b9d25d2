"""Tensor and pipeline parallelism (shared/engine/distributed.py, shared/models/sharding.py):
real rank processes on gloo, the same greedy tokens as one rank and as ``transformers`` in
fp32 under chunked prefill, prefix caching and preemption; the KV gather/scatter that transfer
across layouts uses; a rank that dies."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from shared.config import ConfigError, EngineArgs, ParallelConfig
from shared.engine import LLM
from shared.engine.distributed import RankDiedError
from shared.engine.sampling_params import SamplingParams
from shared.models.sharding import Shard
from tests.engine.helpers import hf_greedy, mismatches, random_prompts, shared_prefix_prompts

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
# a pool too small for the batch (preemption), a step budget that chunks every long prompt
TIGHT = dict(
    max_num_batched_tokens=64, max_num_seqs=32, num_gpu_blocks_override=100, max_model_len=1100
)

LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "pp2": dict(pipeline_parallel_size=2),
    "tp2_pp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2),
    "tp4_replicated_kv": dict(tensor_parallel_size=4),  # 2 KV heads over 4 ranks
}


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def single_rank(tiny_llama):
    """TP 1's tokens on the same prompts and the same tight pool."""
    llm = LLM(str(tiny_llama), **TIGHT)
    prompts = random_prompts(seed=11)
    shared = shared_prefix_prompts(seed=12, n=12)
    return prompts, shared, _generate(llm, prompts), _generate(llm, shared)


# tp4 (four ranks on CI's two cores: the longest) runs in the slow tier; the default tier
# keeps TP 4's replicated KV heads through the export/import test below
@pytest.mark.parametrize(
    "layout",
    [pytest.param(k, marks=pytest.mark.slow) if k == "tp4_replicated_kv" else k for k in LAYOUTS],
)
def test_layout_matches_one_rank_and_transformers(tiny_llama, single_rank, layout):
    prompts, shared, one_rank, one_rank_shared = single_rank
    llm = LLM(str(tiny_llama), **TIGHT, **LAYOUTS[layout])
    try:
        ours = _generate(llm, prompts)
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0, "the pool was meant to be too small for the batch"
        # pipeline stages work on different steps at once (micro-batches)
        pp = LAYOUTS[layout].get("pipeline_parallel_size", 1)
        assert llm.engine.max_inflight_steps == (pp if pp > 1 else 0)
        assert not mismatches(ours, one_rank)
        assert not mismatches(ours, hf_greedy(tiny_llama, prompts, MAX_NEW))
        # prefix caching: a batch of shared prefixes, then the same batch again (all cached)
        first = _generate(llm, shared)
        hits = llm.engine.stats().prefix_cache_hits
        again = _generate(llm, shared)
        assert llm.engine.stats().prefix_cache_hits > hits
        assert first == again == one_rank_shared
        llm.engine.check_integrity()
        assert llm.engine.kv.pool.num_free_blocks == llm.engine.num_blocks, "blocks leaked"
    finally:
        llm.engine.shutdown()


def test_swap_preemption_and_qwen2_tied_head_under_tp2_pp2(make_model):
    model = make_model("tiny", "qwen2")  # q/k/v biases, LM head tied to the embedding
    prompts = random_prompts(seed=13)
    llm = LLM(
        str(model),
        **TIGHT,
        preemption_mode="swap",
        swap_space=0.05,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
    )
    try:
        ours = _generate(llm, prompts)
        assert llm.engine.scheduler.num_swapped_out > 0
        assert not mismatches(ours, hf_greedy(model, prompts, MAX_NEW))
    finally:
        llm.engine.shutdown()


def test_seeded_sampling_is_the_same_as_one_rank(tiny_llama):
    prompts = random_prompts(seed=14)[:8]
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    outs = []
    for layout in ({}, LAYOUTS["tp2"]):
        llm = LLM(str(tiny_llama), max_num_seqs=8, **layout)
        try:
            res = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            outs.append([list(o.outputs[0].token_ids) for o in res])
        finally:
            llm.engine.shutdown()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_prompt_logprobs_across_ranks(tiny_llama, layout):
    """The prompt rows' logits come back from the last stage / rank 0 like the sampling rows:
    the same prompt logprobs as transformers, chunked (64-token budget)."""
    from tests.engine.test_prompt_logprobs import check_against_hf

    prompts = random_prompts(seed=15, lengths=[1, 90, 200])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    llm = LLM(str(tiny_llama), max_num_seqs=8, max_num_batched_tokens=64, **LAYOUTS[layout])
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.engine.shutdown()
    for p, o in zip(prompts, outs):
        check_against_hf(tiny_llama, p, o.prompt_logprobs)


# tp2_pp2's gather is tp2's plus pp2's stage ranges (both kept in the default tier)
@pytest.mark.parametrize(
    "layout", ["tp2", pytest.param("tp2_pp2", marks=pytest.mark.slow), "tp4_replicated_kv"]
)
def test_export_then_import_round_trips_the_canonical_blocks(tiny_llama, layout):
    """What KV transfer across layouts rests on: the gathered canonical blocks equal a TP 1
    worker's pool for the same prompt, and scattering them into other blocks of every rank
    reproduces the same tokens from there."""
    prompt = random_prompts(seed=15, lengths=[70])[0]
    one = LLM(str(tiny_llama), max_num_seqs=4, num_gpu_blocks_override=64, max_model_len=1024)
    ref_tokens = _generate(one, [prompt])[0]
    ref_pool = one.engine.runner.kv_cache
    llm = LLM(
        str(tiny_llama),
        max_num_seqs=4,
        num_gpu_blocks_override=64,
        max_model_len=1024,
        **LAYOUTS[layout],
    )
    try:
        assert _generate(llm, [prompt])[0] == ref_tokens
        runner = llm.engine.runner
        # both engines allocate blocks in the same order from the same empty pool
        n_blocks = len(prompt) // 16
        ids = [b for b in range(64) if ref_pool[b].abs().sum() > 0][:n_blocks]
        assert len(ids) == n_blocks
        runner.export_blocks(ids)
        staged = runner.transfer_pool
        # the same KV up to the all-reduces' summation order
        torch.testing.assert_close(staged[ids], ref_pool[ids], rtol=1e-4, atol=1e-5)
        # scatter into blocks no request uses, then read them back through a fresh gather
        snapshot = staged[ids].clone()
        free = [b for b in range(63, 0, -1) if b not in ids][:n_blocks]
        staged[free] = snapshot
        staged[ids] = 0
        runner.import_blocks(free)
        staged[free] = 0
        runner.export_blocks(free)
        assert torch.equal(staged[free], snapshot)
    finally:
        llm.engine.shutdown()


def test_a_killed_rank_ends_the_engine_in_bounded_time(tiny_llama):
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, max_num_seqs=4)
    try:
        executor = llm.engine.runner.executor
        (rank1,) = executor.procs
        os.kill(rank1.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        with pytest.raises(RankDiedError, match="rank1"):
            while time.monotonic() < deadline:  # what the engine loop calls every turn
                llm.engine.check_alive()
                time.sleep(0.05)
        # a step after the loss fails too (never hangs)
        llm.engine.add_request("x", [5, 6, 7], GREEDY)
        with pytest.raises(RankDiedError):
            llm.engine.step()
    finally:
        llm.engine.shutdown()


def test_ranks_exit_when_rank_0_is_gone(tiny_llama, tmp_path):
    """A rank whose rank 0 died exits by itself (its parent watch), leaving no orphan."""
    import subprocess
    import sys

    script = tmp_path / "rank0.py"
    script.write_text(
        "import os, sys\n"
        "from shared.engine import LLM\n"
        f"llm = LLM({str(tiny_llama)!r}, tensor_parallel_size=2, max_num_seqs=4)\n"
        "print(llm.engine.runner.executor.procs[0].pid, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    pytest.fail(f"rank 1 (pid {pid}) outlived its rank 0 by 10 s")


# ---- configuration and the sharding arithmetic (no processes) ---------------------------
@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (dict(tensor_parallel_size=3), "does not divide the model's 4 attention heads"),
        (dict(pipeline_parallel_size=3), "exceeds the model's 2 layers"),
        (dict(tensor_parallel_size=2, nnodes=3), "do not split evenly over --nnodes 3"),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), "--node-rank 2 is not in"),
        (dict(tensor_parallel_size=2, nnodes=2), "needs --master-addr and --master-port"),
        (
            dict(tensor_parallel_size=2, distributed_executor_backend="uni"),
            "uni runs one process",
        ),
        (dict(tensor_parallel_size=0), "must be >= 1"),
    ],
)
def test_layouts_the_model_cannot_take_are_refused(tiny_llama, layout, message):
    args = EngineArgs(model=str(tiny_llama), **layout)
    with pytest.raises(ConfigError, match=message):
        args.create_parallel_config().check(args.create_model_config())


def test_quantized_or_draft_model_with_tp_are_refused(tiny_llama):
    with pytest.raises(ConfigError, match="quantization int8 with TP/PP > 1"):
        LLM(str(tiny_llama), quantization="int8", tensor_parallel_size=2)
    draft = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="draft model with TP/PP > 1"):
        LLM(str(tiny_llama), speculative_config=draft, pipeline_parallel_size=2)


def test_layer_ranges_are_contiguous_and_cover_every_layer():
    for layers in (2, 5, 12, 13):
        for pp in range(1, min(layers, 4) + 1):
            pc = ParallelConfig(pipeline_parallel_size=pp)
            ranges = [pc.layer_range(s, layers) for s in range(pp)]
            assert ranges[0][0] == 0 and ranges[-1][1] == layers
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            sizes = [e - s for s, e in ranges]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_heads_partition_or_replicate():
    # 8 query heads, 2 KV heads over TP 4: 2 query heads each, the KV heads replicated twice;
    # every rank's query heads use the KV head it holds (GQA group of 4)
    for r in range(4):
        s = Shard(tp_size=4, tp_rank=r)
        q0, nq = s.heads(8)
        k0, nk = s.kv_heads(2)
        assert (nq, nk) == (2, 1)
        assert {h // 4 for h in range(q0, q0 + nq)} == {k0}
    # partitioned: 8 KV heads over TP 2
    assert [Shard(tp_size=2, tp_rank=r).kv_heads(8) for r in range(2)] == [(0, 4), (4, 4)]
    # vocabulary rows: the same count everywhere, the last rank padded
    assert [Shard(tp_size=4, tp_rank=r).vocab(10) for r in range(4)] == [
        (0, 3),
        (3, 3),
        (6, 3),
        (9, 3),
    ]


def test_a_second_node_runs_its_ranks_with_the_same_flags(tiny_llama):
    """``--nnodes 2``: node 1 is ``pdserve decode ... --node-rank 1`` (no service, only its
    ranks), node 0 the engine with rank 0; here both nodes are this machine."""
    import subprocess
    import sys

    from tests.cluster_utils import free_port

    port = free_port()
    flags = ["--model", str(tiny_llama), "--max-num-seqs", "8", "--tensor-parallel-size", "2"]
    node = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    follower = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "decode", *flags, *node, "--node-rank", "1"],
        env=dict(os.environ, PYTHONPATH=os.getcwd(), PDSERVE_NUM_THREADS="1"),
    )
    try:
        llm = LLM(
            str(tiny_llama),
            max_num_seqs=8,
            tensor_parallel_size=2,
            nnodes=2,
            node_rank=0,
            master_port=port,
        )
        assert llm.engine.runner.executor.procs == []  # node 0 holds rank 0 only
        prompts = random_prompts(seed=16)[:8]
        ours = _generate(llm, prompts)
        assert not mismatches(ours, hf_greedy(tiny_llama, prompts, MAX_NEW))
        llm.engine.shutdown()
        assert follower.wait(timeout=30) == 0, "node 1 exits cleanly when rank 0 stops it"
    finally:
        if follower.poll() is None:
            follower.kill()
