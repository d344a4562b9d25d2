"""Quantized checkpoints as real quantizers ship them: sharded with a linear split across two
shards, GPTQ's all-zero biases, GPTQ's ``quantize_config.json``; and ``pdserve quantize`` of a
sharded source."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shared.cli.quantize import quantize_checkpoint
from shared.models.loader import INDEX_FILE, ModelLoadError, weight_files
from tests.engine.helpers import random_prompts
from tests.engine.test_model_loading_files import greedy, read_tensors, sharded_copy, write_shards

PROMPTS = random_prompts(seed=31, lengths=[3, 45, 120])


@pytest.fixture(scope="module")
def awq(tiny_llama, tmp_path_factory) -> Path:
    return quantize_checkpoint(tiny_llama, tmp_path_factory.mktemp("awq") / "m", "awq", 4, 32)


@pytest.fixture(scope="module")
def gptq(tiny_llama, tmp_path_factory) -> Path:
    return quantize_checkpoint(tiny_llama, tmp_path_factory.mktemp("gptq") / "m", "gptq", 4, 32)


@pytest.fixture(scope="module")
def want(awq, gptq) -> dict[str, list[list[int]]]:
    return {"awq": greedy(awq, PROMPTS), "gptq": greedy(gptq, PROMPTS)}


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_a_linear_split_across_shards_loads(method, awq, gptq, want, tmp_path):
    """Every linear's qweight in the first shard, its other tensors (qzeros, scales, g_idx)
    in the second: refused as 'missing awq tensor' after the first file before."""
    model_dir = copy_of(awq if method == "awq" else gptq, tmp_path / method)
    tensors = read_tensors(model_dir)
    keys = sorted(tensors)
    first = [k for k in keys if not k.startswith("model.layers.") or k.endswith(".qweight")]
    second = [k for k in keys if k not in first]
    write_shards(model_dir, tensors, [first, second])
    assert greedy(model_dir, PROMPTS) == want[method]


def test_a_linear_incomplete_in_every_shard_is_named(awq, tmp_path):
    model_dir = copy_of(awq, tmp_path / "incomplete")
    tensors = read_tensors(model_dir)
    del tensors["model.layers.1.mlp.down_proj.scales"]
    keys = sorted(tensors)
    write_shards(model_dir, tensors, [keys[: len(keys) // 2], keys[len(keys) // 2 :]])
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.down_proj.*scales"):
        greedy(model_dir, PROMPTS[:1])


def _rewrite(model_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


def test_gptq_all_zero_biases_are_dropped_and_a_nonzero_one_is_named(gptq, want, tmp_path):
    model_dir = copy_of(gptq, tmp_path / "zero-bias")
    tensors = read_tensors(model_dir)
    for k in [k for k in tensors if k.endswith(".qweight")]:
        base = k.rpartition(".")[0]
        tensors[f"{base}.bias"] = torch.zeros(tensors[f"{base}.scales"].shape[1])
    _rewrite(model_dir, tensors)
    assert greedy(model_dir, PROMPTS) == want["gptq"]

    tensors["model.layers.1.self_attn.o_proj.bias"][3] = 0.5
    _rewrite(model_dir, tensors)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.o_proj\.bias"):
        greedy(model_dir, PROMPTS[:1])


def test_gptq_with_only_quantize_config_json_loads(gptq, want, tmp_path):
    """AutoGPTQ's own layout: the scheme in ``quantize_config.json`` (no quant_method in it),
    config.json without ``quantization_config``."""
    model_dir = copy_of(gptq, tmp_path / "autogptq")
    cfg = json.loads((model_dir / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    qc.pop("quant_method")
    (model_dir / "config.json").write_text(json.dumps(cfg))
    (model_dir / "quantize_config.json").write_text(json.dumps(qc))
    assert greedy(model_dir, PROMPTS) == want["gptq"]
    assert greedy(model_dir, PROMPTS[:1], quantization="gptq") == want["gptq"][:1]


def test_quantizing_a_sharded_source_writes_no_stale_index(tiny_llama, awq, want, tmp_path):
    src = sharded_copy(tiny_llama, tmp_path / "sharded")
    dst = quantize_checkpoint(src, tmp_path / "out", "awq", 4, 32)
    assert not (dst / INDEX_FILE).exists()
    assert [p.name for p in weight_files(dst)] == ["model.safetensors"]
    assert sorted(p.name for p in dst.iterdir()) == sorted(p.name for p in awq.iterdir())
    assert greedy(dst, PROMPTS) == want["awq"]
