"""Which weight files a checkpoint directory loads: the shards its index names, never a
Mistral-format ``consolidated.safetensors`` shipped beside them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams
from shared.models.loader import ModelLoadError, weight_files
from tests.engine.helpers import hf_greedy, mismatches, random_prompts

INDEX = "model.safetensors.index.json"


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


def write_shards(
    model_dir: Path, tensors: dict[str, torch.Tensor], shards: list[list[str]]
) -> list[str]:
    """Replace ``model_dir``'s weights by ``shards`` (tensor names per file, in order) named
    as transformers names them, with the index; returns the file names."""
    from safetensors.torch import save_file

    for f in model_dir.glob("*.safetensors"):
        f.unlink()
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, keys in zip(names, shards):
        save_file({k: tensors[k] for k in keys}, str(model_dir / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
    index = {"metadata": {"total_size": 0}, "weight_map": dict(sorted(weight_map.items()))}
    (model_dir / INDEX).write_text(json.dumps(index))
    return names


def write_consolidated(model_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The original Mistral-format file: other tensor names (``tok_embeddings``,
    ``layers.0.attention.wq``), which the loader does not know."""
    from safetensors.torch import save_file

    renamed = {
        "tok_embeddings.weight": tensors["model.embed_tokens.weight"],
        "layers.0.attention.wq.weight": tensors["model.layers.0.self_attn.q_proj.weight"],
        "output.weight": tensors["lm_head.weight"],
    }
    save_file(renamed, str(model_dir / "consolidated.safetensors"), metadata={"format": "pt"})


def sharded_copy(src: Path, dst: Path, consolidated: bool = True) -> Path:
    """``src`` in two shards (split inside layer 0) with an index, and a consolidated file."""
    shutil.copytree(src, dst)
    tensors = read_tensors(src)
    keys = sorted(tensors)
    cut = keys.index("model.layers.0.self_attn.k_proj.weight")
    write_shards(dst, tensors, [keys[:cut], keys[cut:]])
    if consolidated:
        write_consolidated(dst, tensors)
    return dst


def greedy(model_dir: Path, prompts: list[list[int]], n: int = 8, **kw) -> list[list[int]]:
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="16MiB", **kw)
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    return [o.outputs[0].token_ids for o in outs]


def test_index_shards_load_and_consolidated_beside_them_is_ignored(tiny_llama, tmp_path):
    model_dir = sharded_copy(tiny_llama, tmp_path / "mistral-style")
    assert {p.name for p in weight_files(model_dir)} == {
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    }
    prompts = random_prompts(seed=21, lengths=[5, 40, 130])
    assert mismatches(greedy(model_dir, prompts), hf_greedy(model_dir, prompts, 8)) == []


def test_a_shard_the_index_names_but_is_absent_is_named(tiny_llama, tmp_path):
    model_dir = sharded_copy(tiny_llama, tmp_path / "missing")
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors"):
        weight_files(model_dir)
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors"):
        LLM(str(model_dir), device="cpu", kv_cache_memory="16MiB")


def test_without_an_index_consolidated_is_skipped_only_beside_other_files(tiny_llama, tmp_path):
    model_dir = tmp_path / "single"
    shutil.copytree(tiny_llama, model_dir)
    write_consolidated(model_dir, read_tensors(tiny_llama))
    assert [p.name for p in weight_files(model_dir)] == ["model.safetensors"]
    prompts = random_prompts(seed=22, lengths=[7, 60])
    assert greedy(model_dir, prompts) == greedy(tiny_llama, prompts)
    (model_dir / "model.safetensors").unlink()  # consolidated alone is what there is
    assert [p.name for p in weight_files(model_dir)] == ["consolidated.safetensors"]


def test_a_corrupt_index_is_a_load_error_naming_it(tiny_llama, tmp_path):
    model_dir = sharded_copy(tiny_llama, tmp_path / "bad-index", consolidated=False)
    (model_dir / INDEX).write_text('{"metadata": {}}')
    with pytest.raises(ModelLoadError, match="weight_map"):
        weight_files(model_dir)


def test_a_draft_cut_from_a_sharded_repo_reads_its_shards_only(tiny_llama, tmp_path):
    """``truncate_layers`` (draft models) globbed every safetensors file, so a repo with a
    consolidated file copied its Mistral-named tensors into the draft, and the source's index
    beside the one output file; it reads the shards the index names and writes no index."""
    from shared.cli.tiny_model import truncate_layers

    src = sharded_copy(tiny_llama, tmp_path / "sharded")
    dst = truncate_layers(src, tmp_path / "draft", 1)
    assert not (dst / INDEX).exists()
    assert [f.name for f in weight_files(dst)] == ["model.safetensors"]
    names = set(read_tensors(dst))
    assert "tok_embeddings.weight" not in names and "model.embed_tokens.weight" in names
    assert not any(".layers.1." in n for n in names)
    assert len(greedy(dst, [[5, 6, 7]], n=2)[0]) == 2  # it loads
