"""Offline engine throughput with each bf16 prefill attention tile, interleaved in one run.

``--prompts`` random prompts of ``--len`` tokens, ``--out-len`` tokens each (ignore_eos), greedy,
on ``--threads`` torch threads; each round runs the AVX512-BF16 tile and, where the CPU has
it, the AMX tile (``PDSERVE_CPU_PREFILL``), each in a fresh engine; prints output tok/s.

    python bench/prefill_isa_engine.py --model DIR [--prompts 256] [--len 256] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import cpu_paged
from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams


def run(model: str, amx: bool, prompts: int, length: int, out_len: int) -> float:
    cpu_paged._prefill_path = "amx" if amx else "avx512"
    llm = LLM(model, kv_cache_memory="1GiB")
    rng = random.Random(0)
    batch = [
        {"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(length)]}
        for _ in range(prompts)
    ]
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate(batch[:4], sp)  # warm
    t0 = time.perf_counter()
    llm.generate(batch, sp)
    return prompts * out_len / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--len", type=int, default=256)
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    ext = cpu_paged._bf16_ext()
    if ext is None:
        print("no AVX512-BF16 build here: nothing to compare")
        return 1
    torch.set_num_threads(a.threads)
    tiles = [("AVX512-BF16", False)] + ([("AMX", True)] if ext.prefill_amx_available() else [])
    got: dict[str, list[float]] = {n: [] for n, _ in tiles}
    for r in range(a.rounds):
        for name, amx in tiles:
            print(f"[prefill_isa_engine] round {r + 1}/{a.rounds}: {name}", file=sys.stderr)
            got[name].append(run(a.model, amx, a.prompts, a.len, a.out_len))
    for name, vals in got.items():
        runs = ", ".join(f"{v:.0f}" for v in vals)
        print(f"{name}: median {statistics.median(vals):.0f} out tok/s ({runs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
