"""Greedy token equality with ``transformers`` under every engine path (fp32)."""

from __future__ import annotations

import json
import shutil

import pytest

from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams
from tests.engine.helpers import hf_greedy, mismatches, random_prompts, shared_prefix_prompts

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def run_engine(model_dir, prompts, **engine_args):
    llm = LLM(str(model_dir), **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    llm.engine.check_integrity()
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.num_blocks, "blocks leaked"
    return llm, [o.outputs[0].token_ids for o in outs]


CONFIGS = {
    "default": {},
    "chunked_budget_64": dict(max_num_batched_tokens=64, max_num_seqs=32),
    "max_num_seqs_1": dict(max_num_seqs=1),
    # prompts chunked to 48 tokens a step while others decode (a disaggregated decode worker)
    "prefill_while_decoding_48": dict(max_prefill_tokens_while_decoding=48, max_num_seqs=32),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "preempt_recompute": dict(num_gpu_blocks_override=100, max_model_len=1100),
    "preempt_swap": dict(
        num_gpu_blocks_override=100, max_model_len=1100, preemption_mode="swap", swap_space=0.05
    ),
    "block_size_32": dict(block_size=32),
    "block_size_8": dict(block_size=8),
    "torch_reference_attention": dict(attention_backend="torch"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(tiny_llama, name):
    prompts = random_prompts(seed=1)
    assert len(prompts) >= 32 and min(map(len, prompts)) == 1 and max(map(len, prompts)) == 1000
    llm, ours = run_engine(tiny_llama, prompts, **CONFIGS[name])
    assert not mismatches(ours, hf_greedy(tiny_llama, prompts, MAX_NEW))
    stats = llm.engine.stats()
    if name.startswith("preempt"):
        assert stats.num_preemptions > 0, "the pool was meant to be too small for the batch"
    if name == "preempt_swap":
        assert llm.engine.scheduler.num_swapped_out > 0


def test_prefix_caching_shared_prefixes(tiny_llama):
    prompts = shared_prefix_prompts(seed=2)
    llm = LLM(str(tiny_llama))
    ref = hf_greedy(tiny_llama, prompts, MAX_NEW)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert not mismatches([o.outputs[0].token_ids for o in first], ref)
    hits_after_first = llm.engine.stats().prefix_cache_hits
    assert hits_after_first > 0, "requests sharing prefixes in one batch should hit the cache"
    second = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert not mismatches([o.outputs[0].token_ids for o in second], ref)
    assert all(o.num_cached_tokens >= 160 for o in second)
    assert llm.engine.stats().prefix_cache_hits > hits_after_first
    llm.engine.check_integrity()


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "llama3"])
def test_architectures_match_transformers(make_model, arch):
    model_dir = make_model("tiny", arch)
    prompts = random_prompts(seed=3)
    _, ours = run_engine(model_dir, prompts, max_num_batched_tokens=256, max_num_seqs=32)
    assert not mismatches(ours, hf_greedy(model_dir, prompts, MAX_NEW))


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_a_config_in_transformers_5_layout_matches_transformers(make_model, tmp_path, arch):
    """transformers 5 saves RoPE's settings as ``rope_parameters`` and no longer writes
    ``rope_theta`` / ``rope_scaling``: those models loaded without a word and ran with theta
    10,000 and no scaling (wrong tokens on every prompt, found by review)."""
    src = make_model("tiny", arch)
    model_dir = tmp_path / arch
    shutil.copytree(src, model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    params = {"rope_theta": cfg.pop("rope_theta")}
    params.update(cfg.pop("rope_scaling", None) or {"rope_type": "default"})
    assert params["rope_theta"] != 10000.0  # the old default would not show the bug
    cfg["rope_parameters"] = params
    (model_dir / "config.json").write_text(json.dumps(cfg))
    prompts = random_prompts(seed=5, lengths=[3, 17, 64, 300])
    _, ours = run_engine(model_dir, prompts, max_num_batched_tokens=256, max_num_seqs=8)
    assert not mismatches(ours, hf_greedy(model_dir, prompts, MAX_NEW))
