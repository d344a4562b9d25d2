"""Sampling at temperature > 0 on CPU: the backend's kernels (``kernels/cpu_paged.py::
race_rows``: each row's draw in one pass over its logits, the noise made in the kernel;
``cut_rows``: top-k / top-p / min-p by bisection) against the torch ops they replace (fp32 copy,
temperature, sorts for the cuts, softmax, numpy's uniform noise, ``-log``, divide,
``argmax_rows``), interleaved in one process.

Part 1 times one ``Sampler`` call per row count (vocabulary ``--vocab``, bf16 logits, rows
unseeded, each with its own seed, or unseeded with top-p 0.9 / top-k 50 / min-p 0.05). Part 2
runs the offline engine (``shared.engine.LLM``) on ``--model``: ``--prompts`` random prompts of
``--prompt-len`` tokens, ``--max-tokens`` out each, at temperature 1, at temperature 1 with
top-p 0.9 and, as a control, 0, the engine's sampler switched between the two paths in
alternating rounds (same engine, same prompts). Each row gives the median and minimum over the
rounds.

    python bench/sampler_race.py [--model DIR] [--rows 1,16,64,256] [--rounds 15]
        [--engine-rounds 3] [--threads 1]
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

from kernels import cpu_linear, cpu_paged
from shared.engine.sampler import Sampler
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler_output import SampleSpec

PATHS = ("race", "torch")


def _cell(ts: list[float]) -> str:
    return f"{statistics.median(ts):.2f} ({min(ts):.2f})"


def sampler_calls(rows: list[int], vocab: int, rounds: int) -> None:
    print(f"\nOne Sampler call, {vocab}-token vocabulary, bf16 logits: ms, median (min)")
    print("| rows | rows' sampling | race | torch | race / torch |")
    print("|---:|---|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    samplers = {
        p: Sampler(
            vocab,
            torch.device("cpu"),
            seed=0,
            argmax_rows=cpu_paged.argmax_rows,
            race_rows=cpu_paged.race_rows if p == "race" else None,
            cut_rows=cpu_paged.cut_rows if p == "race" else None,
        )
        for p in PATHS
    }
    kinds = {
        "engine's": {},
        "seeded": {},
        "top-p 0.9": {"top_p": 0.9},
        "top-k 50": {"top_k": 50},
        "min-p 0.05": {"min_p": 0.05},
    }
    for n in rows:
        logits = torch.randn(n, vocab, generator=g).bfloat16()
        for kind, cut in kinds.items():
            seeded = kind == "seeded"
            specs = [
                SampleSpec(
                    f"r{i}",
                    SamplingParams(temperature=1.0, seed=i if seeded else None, **cut),
                    0,
                    (),
                )
                for i in range(n)
            ]
            times: dict[str, list[float]] = {p: [] for p in PATHS}
            for s in samplers.values():
                s(logits, specs)
            for r in range(rounds):
                print(f"[sampler] rows {n} round {r + 1}/{rounds}", end="\r", file=sys.stderr)
                for p, s in samplers.items():
                    t0 = time.perf_counter()
                    s(logits, specs)
                    times[p].append((time.perf_counter() - t0) * 1e3)
            ratio = statistics.median(times["race"]) / statistics.median(times["torch"])
            print(
                f"| {n} | {kind} | {_cell(times['race'])} | {_cell(times['torch'])} | {ratio:.2f} |"
            )


def engine_runs(model: str, prompts: int, prompt_len: int, max_tokens: int, rounds: int) -> None:
    from shared.engine import LLM

    llm = LLM(
        model,
        kv_cache_memory="1GiB",
        max_num_batched_tokens=2048,
        max_num_seqs=max(128, prompts),
        max_model_len=4096,
    )
    sampler = llm.engine.runner.sampler
    race, cut = sampler._race_rows, sampler._cut_rows
    if race is None:
        print("the engine's sampler has no race kernel here (no C++ extension)")
        return
    rng = random.Random(0)
    batch = [
        {"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(prompt_len)]}
        for _ in range(prompts)
    ]
    print(
        f"\nOffline engine, {prompts} prompts x ({prompt_len} -> {max_tokens} tokens): output "
        "tok/s, median (min) over the rounds"
    )
    print("| sampling | race | torch | race / torch |")
    print("|---|---:|---:|---:|")
    configs = {
        "temperature 1": {"temperature": 1.0},
        "temperature 1, top-p 0.9": {"temperature": 1.0, "top_p": 0.9},
        "temperature 0 (control)": {"temperature": 0.0},
    }
    for name, cfg in configs.items():
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **cfg)
        rates: dict[str, list[float]] = {p: [] for p in PATHS}
        llm.generate(batch[:4], sp)
        for r in range(rounds):
            for p in PATHS:
                print(f"[sampler] engine {name} round {r + 1}/{rounds} {p}", file=sys.stderr)
                sampler._race_rows = race if p == "race" else None
                sampler._cut_rows = cut if p == "race" else None
                t0 = time.perf_counter()
                llm.generate(batch, sp)
                rates[p].append(prompts * max_tokens / (time.perf_counter() - t0))
        sampler._race_rows, sampler._cut_rows = race, cut
        med = {p: statistics.median(v) for p, v in rates.items()}
        cells = " | ".join(f"{med[p]:.0f} ({min(rates[p]):.0f})" for p in PATHS)
        print(f"| {name} | {cells} | {med['race'] / med['torch']:.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache/pdserve/compare/small-llama"))
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--engine-rounds", type=int, default=3, help="0: no engine part")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if not cpu_paged.available():
        print("needs the C++ extension (kernels/csrc/cpu_paged.cpp)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_linear.CpuFeatures.detect().describe()}; {args.threads} thread(s)")
    sampler_calls([int(r) for r in args.rows.split(",")], args.vocab, args.rounds)
    if args.engine_rounds > 0:
        engine_runs(args.model, args.prompts, args.prompt_len, args.max_tokens, args.engine_rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
