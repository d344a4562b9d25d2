"""bf16 prefill attention: the AVX512-BF16 kernel (``kernels/cpu_paged.py::attend_prefill``)
against torch's flash SDPA, per chunk and inside the engine, interleaved in one run.

1. per chunk: one sequence's causal chunk over its context, the small model's heads (8 query,
   4 KV, head size 32) and a larger layout (32 / 8 / 128), ms per call and the error of each
   against fp32 attention;
2. engine: the time to prefill ``--prompts`` random prompts of each ``--lens`` (one token
   generated, prefix caching off) with the kernel and with SDPA.

    python bench/prefill_attention.py --model DIR [--lens 256,1088] [--prompts 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import cpu_paged, reference
from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams


def _ms(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def chunk_table(reps: int) -> None:
    print(
        "| chunk (query, context, Hq / Hkv / D) | SDPA ms | kernel ms | kernel / SDPA | max error SDPA / kernel |"
    )
    print("|---|---:|---:|---:|---|")
    g = torch.Generator().manual_seed(0)
    for tq, ctx, hq, hkv, d in [
        (256, 256, 8, 4, 32),
        (1088, 1088, 8, 4, 32),
        (300, 1000, 8, 4, 32),
        (512, 512, 32, 8, 128),
    ]:
        q = torch.randn(tq, hq, d, generator=g).bfloat16()
        k = torch.randn(ctx, hkv, d, generator=g).bfloat16()
        v = torch.randn(ctx, hkv, d, generator=g).bfloat16()
        off, sc = ctx - tq, d**-0.5
        exact = reference._attend(q.float(), k.float(), v.float(), sc, off)
        e_sdpa = (reference._attend(q, k, v, sc, off).float() - exact).abs().max().item()
        e_kern = (cpu_paged.attend_prefill(q, k, v, sc, off).float() - exact).abs().max().item()
        a = _ms(lambda: reference._attend(q, k, v, sc, off), reps)  # noqa: B023
        b = _ms(lambda: cpu_paged.attend_prefill(q, k, v, sc, off), reps)  # noqa: B023
        print(
            f"| {tq}, {ctx}, {hq} / {hkv} / {d} | {a:.2f} | {b:.2f} | {b / a:.2f} | {e_sdpa:.4f} / {e_kern:.4f} |"
        )


def engine_prefill_ms(model: str, length: int, prompts: int, kernel: bool) -> float:
    orig = cpu_paged.attend_prefill
    if not kernel:
        cpu_paged.attend_prefill = reference._attend
    try:
        llm = LLM(model, kv_cache_memory="512MiB", enable_prefix_caching=False)
        rng = random.Random(length)
        batch = [
            {"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(length)]}
            for _ in range(prompts)
        ]
        sp = SamplingParams(temperature=0, max_tokens=1)
        llm.generate(batch[:1], sp)  # warm
        t0 = time.perf_counter()
        llm.generate(batch, sp)
        return (time.perf_counter() - t0) * 1e3
    finally:
        cpu_paged.attend_prefill = orig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--lens", default="256,1088")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if cpu_paged._bf16_ext() is None:
        print("this CPU has no AVX512-BF16 (or the extension did not build): nothing to compare")
        return 1
    torch.set_num_threads(args.threads)
    os.environ["PDSERVE_NUM_THREADS"] = str(args.threads)
    print(f"{args.threads} thread(s)")
    chunk_table(args.reps)
    print()
    print("| prompts x tokens | SDPA ms | kernel ms | kernel / SDPA |")
    print("|---|---:|---:|---:|")
    for n in (int(x) for x in args.lens.split(",")):
        sdpa, kern = [], []
        for r in range(args.rounds):
            print(f"[prefill_attention] {n} tokens, round {r + 1}/{args.rounds}", file=sys.stderr)
            sdpa.append(engine_prefill_ms(args.model, n, args.prompts, kernel=False))
            kern.append(engine_prefill_ms(args.model, n, args.prompts, kernel=True))
        a, b = statistics.median(sdpa), statistics.median(kern)
        print(f"| {args.prompts} x {n} | {a:.0f} | {b:.0f} | {b / a:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
