"""Llama's ``attention_bias`` (q/k/v and o_proj biases) and ``mlp_bias`` (gate/up/down
biases): created, loaded and applied as in transformers' LlamaForCausalLM."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams
from shared.models.sharding import Shard
from tests.engine.helpers import hf_greedy, mismatches, random_prompts
from tests.engine.test_model_loading_files import read_tensors

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def biased(tiny_llama, tmp_path_factory) -> Path:
    """The tiny Llama with random biases on every projection, attention_bias and mlp_bias set."""
    from safetensors.torch import save_file

    model_dir = tmp_path_factory.mktemp("biased") / "m"
    shutil.copytree(tiny_llama, model_dir)
    tensors = read_tensors(tiny_llama)
    gen = torch.Generator().manual_seed(5)
    for k in list(tensors):
        base, _, suffix = k.rpartition(".")
        if suffix == "weight" and base.rpartition(".")[2] in PROJ:
            rows = tensors[k].shape[0]
            tensors[f"{base}.bias"] = torch.randn(rows, generator=gen) * 0.1
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(attention_bias=True, mlp_bias=True)
    (model_dir / "config.json").write_text(json.dumps(cfg))
    return model_dir


def test_attention_and_mlp_biases_match_transformers(biased):
    llm = LLM(
        str(biased),
        device="cpu",
        kv_cache_memory="16MiB",
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    layer = llm.engine.runner.model.layers[0]
    for lin in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert lin.bias is not None
    prompts = random_prompts(seed=51, lengths=[1, 6, 33, 140, 300])
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    ours = [o.outputs[0].token_ids for o in outs]
    assert mismatches(ours, hf_greedy(biased, prompts, 16)) == []


def test_without_the_flags_the_biases_are_refused(biased, tmp_path):
    from shared.models.loader import ModelLoadError

    model_dir = tmp_path / "no-flags"
    shutil.copytree(biased, model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(attention_bias=False, mlp_bias=False)
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"bias"):
        LLM(str(model_dir), device="cpu", kv_cache_memory="16MiB")


def test_row_parallel_biases_are_added_by_one_tensor_parallel_rank(biased):
    """o_proj and down_proj outputs are summed over TP ranks: only rank 0 keeps the bias."""
    from kernels import reference
    from shared.config import EngineArgs
    from shared.models.llama import LlamaForCausalLM

    cfg = EngineArgs(model=str(biased)).create_model_config()
    bias = torch.arange(1.0, cfg.hidden_size + 1)
    for rank in (0, 1):
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg, reference, Shard(tp_size=2, tp_rank=rank))
        for name in ("layers.0.self_attn.o_proj.bias", "layers.0.mlp.down_proj.bias"):
            got = model.shard_tensor(name, None, bias)
            assert torch.equal(got, bias if rank == 0 else torch.zeros_like(bias))
        gate = model.shard_tensor("layers.0.mlp.gate_up_proj.bias", 0, torch.arange(256.0))
        assert torch.equal(gate, torch.arange(128.0) + 128 * rank)


def test_the_one_call_bf16_decode_step_is_not_used_with_biases_it_does_not_add(tiny_llama, biased):
    """The C++ decode step adds only a q/k/v bias: with o_proj / MLP biases the Python layer
    loop runs (it would drop them)."""
    plain = LLM(str(tiny_llama), device="cpu", kv_cache_memory="16MiB", dtype="bfloat16")
    if plain.engine.runner.model._decode_plan is None:
        pytest.skip("no one-call decode step on this CPU")
    llm = LLM(str(biased), device="cpu", kv_cache_memory="16MiB", dtype="bfloat16")
    assert llm.engine.runner.model._decode_plan is None
