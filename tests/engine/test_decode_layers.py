"""The decode step's decoder layers in one C++ call (``kernels/cpu_paged.py::decode_layers``,
``LlamaForCausalLM.plan_decode``) give the same bits as the Python layer loop it replaces
(``--enforce-eager``), for Llama and Qwen2 (q/k/v biases), in a bf16 engine on the CPU: with
oneDNN's packed projections (a CPU with AVX512-BF16), with the ``amx`` plan's AMX walk (a CPU
with AMX tiles) and with the ``avx2`` plan's kernel on the plain weights (any CPU with AVX2 and
FMA)."""

from __future__ import annotations

import pytest

from kernels import cpu_linear, cpu_paged
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams

# the linear plan asked for (PDSERVE_CPU_LINEAR) -> the one-call step's projection kernel
KINDS = {"onednn": "packed", "avx2": "avx2", "amx": "amx"}


def _run(model_dir, eager: bool):
    llm = LLM(
        str(model_dir),
        dtype="bfloat16",
        enforce_eager=eager,
        max_num_seqs=8,
        kv_cache_memory="32MiB",
    )
    prompts = [[(7 * i + 3 * j) % 2000 + 5 for j in range(5 + 9 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params)
    model = llm.engine.runner.model
    got = [
        (o.outputs[0].token_ids, [(lp.logprob, lp.rank, lp.top) for lp in o.outputs[0].logprobs])
        for o in outs
    ]
    return got, model._decode_plan


@pytest.mark.parametrize("path", sorted(KINDS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_one_call_decode_layers_match_the_python_loop_bit_for_bit(
    make_model, monkeypatch, arch, path
):
    kind = KINDS[path]
    if not cpu_paged.decode_layers_available(kind):
        pytest.skip(f"the CPU extension has no {kind} projections on this machine")
    monkeypatch.setenv(cpu_linear.PATH_ENV, path)
    model_dir = make_model("tiny", arch)
    fused, plan = _run(model_dir, eager=False)
    eager, no_plan = _run(model_dir, eager=True)
    assert plan is not None and no_plan is None  # the fused path ran, and only there
    assert plan.keywords["linear"] == kind  # on the projections asked for
    assert fused == eager


def test_the_amx_one_call_step_takes_projections_left_on_onednn(make_model, monkeypatch, caplog):
    """The small preset's down_proj has K = 688, not a multiple of 32: the amx plan leaves it in
    oneDNN's layout, and the one-call step still runs (that weight on oneDNN's primitive inside
    the call) with the Python loop's bits; the startup log names its path. A first version
    required every projection in tiles and left such a model on the Python loop."""
    import logging

    from shared.models.llama import Linear

    if not cpu_paged.decode_layers_available("amx"):
        pytest.skip("the CPU extension has no amx projections on this machine")
    monkeypatch.setenv(cpu_linear.PATH_ENV, "amx")
    model_dir = make_model("small", "llama")
    with caplog.at_level(logging.INFO, logger="shared.models.loader"):
        llm = LLM(str(model_dir), enforce_eager=False, max_num_seqs=8, kv_cache_memory="32MiB")
    model = llm.engine.runner.model
    downs = [layer.mlp.down_proj for layer in model.layers]
    assert all(type(d) is Linear and not d.tiles and d.packed is not None for d in downs)
    assert all(layer.self_attn.qkv_proj.tiles for layer in model.layers)
    assert model._decode_plan is not None and model._decode_plan.keywords["linear"] == "amx"
    assert "down_proj: onednn x 4" in caplog.text and "qkv_proj: amx x 4" in caplog.text
    del llm
    fused, _ = _run(model_dir, eager=False)
    eager, _ = _run(model_dir, eager=True)
    assert fused == eager
