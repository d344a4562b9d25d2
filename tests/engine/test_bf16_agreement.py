"""bf16 serving against ``transformers`` bf16 (the fp32 path is pinned token for token in
test_vs_transformers.py; bf16 rounds differently per kernel, so it is held to agreement).

Teacher-forced: ``transformers``' bf16 greedy continuations of random prompts are fed to the
engine in one prefill, which must predict ``transformers``' next token at every continuation
position, with the CPU's prepacked linears (kernels/cpu_linear.py: oneDNN's, and the AMX walk's
where the CPU has AMX tiles) and with ``F.linear``."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import cpu_linear
from tests.engine.helpers import teacher_forced_argmax

# Measured 2026-12-02 on the random-weight small model (docs/benchmarks.md, "Linear layers"):
# floors sit ~6 points under. transformers' own row: its one-prefill argmax against its own
# token-by-token generate, i.e. how much bf16 rounding alone makes.
FLOOR = {"transformers": 0.93, "onednn": 0.93, "torch": 0.93}  # measured 0.987, 0.977, 0.977
AMX_FLOOR = 0.93  # the amx plan (AMX walk), where the CPU has tiles: 0.958, as oneDNN (2026-12-07)


@pytest.mark.integration
def test_bf16_teacher_forced_agreement_with_transformers_bf16(make_model, monkeypatch):
    from transformers import AutoModelForCausalLM

    small = make_model("small", "llama")
    hf = AutoModelForCausalLM.from_pretrained(str(small), dtype=torch.bfloat16).eval()
    hf.generation_config.eos_token_id = None
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 32000) for _ in range(32)] for _ in range(4)]
    new = 96
    from kernels import cpu_paged

    floors = dict(FLOOR)
    if cpu_paged.amx_linear_available():
        floors["amx"] = AMX_FLOOR
    hits = dict.fromkeys(floors, 0)
    total = 0
    for p in prompts:
        with torch.inference_mode():
            out = hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False)
            seq = out[0].tolist()
            hf_pred = hf(out).logits[0].float().argmax(-1)[len(p) - 1 : -1]
        target = torch.tensor(seq[len(p) :])
        hits["transformers"] += int((hf_pred == target).sum())
        for path in (k for k in floors if k != "transformers"):
            monkeypatch.setenv(cpu_linear.PATH_ENV, path)
            pred = teacher_forced_argmax(small, seq)[len(p) - 1 : -1]
            hits[path] += int((pred == target).sum())
        total += new
    agreement = {k: v / total for k, v in hits.items()}
    print("teacher-forced agreement with transformers bf16:", agreement)
    for k, floor in floors.items():
        assert agreement[k] >= floor, (k, agreement)
