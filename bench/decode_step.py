"""Decode-step time of the engine at given batch sizes, with the CPU small-batch bf16 linear
(``kernels/cpu_paged.py::small_linear``) on and off, interleaved in one run.

Each measurement builds a fresh engine, admits ``B`` prompts of ``--prompt-len`` random tokens,
runs until all are decoding, then times ``--steps`` engine steps (one token per sequence each).

    python bench/decode_step.py --model DIR [--batches 1,6,16,64] [--threads 1] [--rounds 2]
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


def time_decode_steps(
    engine, batch: int, prompt_len: int, steps: int, max_token: int = 1000
) -> float:
    """ms per engine step once ``batch`` random prompts (ids in [100, max_token)) all decode."""
    rng = random.Random(batch)
    for i in range(batch):
        engine.add_request(
            f"r{i}",
            [rng.randrange(100, max_token) for _ in range(prompt_len)],
            SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True),
        )
    for _ in range(4):  # prefill, then a few warm decode steps
        engine.step()
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1e3


def step_ms(model: str, batch: int, prompt_len: int, steps: int, small: bool) -> float:
    default = cpu_paged._SMALL_M
    cpu_paged._SMALL_M = default if small else 0
    try:
        engine = LLM(model, kv_cache_memory="512MiB").engine
        return time_decode_steps(engine, batch, prompt_len, steps)
    finally:
        cpu_paged._SMALL_M = default


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="1,6,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| batch | small-batch linear off, ms/step | on, ms/step | on / off |")
    print("|---:|---:|---:|---:|")
    for b in (int(x) for x in args.batches.split(",")):
        off, on = [], []
        for r in range(args.rounds):
            print(f"[decode_step] batch {b} round {r + 1}/{args.rounds}", file=sys.stderr)
            off.append(step_ms(args.model, b, args.prompt_len, args.steps, small=False))
            on.append(step_ms(args.model, b, args.prompt_len, args.steps, small=True))
        a, c = statistics.median(off), statistics.median(on)
        print(f"| {b} | {a:.2f} | {c:.2f} | {c / a:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
