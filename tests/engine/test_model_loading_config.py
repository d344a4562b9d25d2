"""config.json problems are one-line ``ConfigError``s naming the field and the file; the
rotary tables follow the engine's max_model_len."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shared.config import ConfigError, EngineArgs
from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams
from tests.engine.helpers import hf_greedy, mismatches, random_prompts


def edited(src: Path, dst: Path, **changes) -> Path:
    """A copy of ``src`` whose config.json has ``changes`` (None: the field removed)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "field",
    ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"],
)
def test_a_missing_required_field_is_named_with_the_file(tiny_llama, tmp_path, field):
    model_dir = edited(tiny_llama, tmp_path / "m", **{field: None})
    with pytest.raises(ConfigError, match=rf"config\.json: missing required field '{field}'"):
        EngineArgs(model=str(model_dir)).create_model_config()


def test_a_field_of_the_wrong_type_is_named(tiny_llama, tmp_path):
    model_dir = edited(tiny_llama, tmp_path / "m", num_key_value_heads="two")
    with pytest.raises(ConfigError, match=r"config\.json: field 'num_key_value_heads' is 'two'"):
        EngineArgs(model=str(model_dir)).create_model_config()


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"hidden_act": "gelu"}, r"config\.json: hidden_act 'gelu' is not supported"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            r"config\.json: rope_scaling rope_type 'yarn' is not supported",
        ),
        (
            {"rope_scaling": None, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
            r"config\.json: rope_parameters rope_type 'dynamic' is not supported",
        ),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            r"config\.json: rope_scaling \(llama3\) needs a number 'low_freq_factor'",
        ),
    ],
)
def test_an_unsupported_setting_is_a_config_error_at_load_and_build(
    tiny_llama, tmp_path, changes, match
):
    from kernels import reference
    from shared.models.llama import LlamaForCausalLM

    model_dir = edited(tiny_llama, tmp_path / "m", **changes)
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model=str(model_dir)).create_model_config()
    # a ModelConfig made another way is refused when the model is built
    cfg = EngineArgs(model=str(tiny_llama)).create_model_config()
    cfg.hf_config.update(changes)
    try:
        with pytest.raises(ConfigError, match=match):
            LlamaForCausalLM(cfg, reference)
    finally:
        cfg.hf_config.clear()
        cfg.hf_config.update(json.loads((tiny_llama / "config.json").read_text()))


def test_rotary_tables_follow_max_model_len_and_tokens_still_match(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", kv_cache_memory="16MiB", max_model_len=300)
    rotary = llm.engine.runner.model.rotary
    assert rotary.cos.shape[0] == rotary.sin.shape[0] == 300  # not max_position_embeddings
    prompts = random_prompts(seed=41, lengths=[4, 100, 283])
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ours = [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    ]
    assert mismatches(ours, hf_greedy(tiny_llama, prompts, 16)) == []


def test_llama3_scaling_keeps_its_original_length_under_a_short_table(make_model):
    """llama3 scaling reads original_max_position_embeddings (256) from the config: a table
    shorter than that (200 rows) changes nothing."""
    model_dir = make_model("tiny", "llama3")
    prompts = random_prompts(seed=42, lengths=[9, 150, 180])
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="16MiB", max_model_len=200)
    assert llm.engine.runner.model.rotary.cos.shape[0] == 200
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ours = [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    ]
    assert mismatches(ours, hf_greedy(model_dir, prompts, 16)) == []


@pytest.mark.parametrize("spec", [None, "ngram", "draft_model"])
def test_sequences_run_to_max_model_len_within_the_table(tiny_llama, tmp_path, spec):
    """Generation up to the model length (with speculative lookahead too) never indexes past
    the table (an index error in the fp32 path)."""
    from shared.cli.tiny_model import truncate_layers

    if spec == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 4}
    elif spec == "draft_model":
        draft = truncate_layers(tiny_llama, tmp_path / "draft", 1)
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = LLM(
        str(tiny_llama),
        device="cpu",
        kv_cache_memory="16MiB",
        max_model_len=96,
        speculative_config=spec,
    )
    assert llm.engine.runner.model.rotary.cos.shape[0] == 96
    base = random_prompts(seed=43, lengths=[20])[0]
    prompts = [base * 4, (base * 5)[:95], base[:7]]  # repeats: n-gram drafts are proposed
    sp = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    assert [len(p) + len(o.outputs[0].token_ids) for p, o in zip(prompts, outs)] == [96] * 3
