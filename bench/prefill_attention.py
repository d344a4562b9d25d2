"""bf16 prefill attention: the C++ prefill tiles this CPU runs (``kernels/cpu_paged.py``:
AVX512-BF16, AMX, AVX2; ``prefill_path``) against torch's flash SDPA, per chunk and inside the
engine, interleaved in one run.

1. per chunk: one sequence's causal chunk over its context, the small model's heads (8 query,
   4 KV, head size 32) and a larger layout (32 / 8 / 128), ms per call and the error of each
   against fp32 attention;
2. engine: the time to prefill ``--prompts`` random prompts of each ``--lens`` (one token
   generated, prefix caching off) with the kernel and with SDPA;
3. ``--paged``: a whole step's chunks from the block pool in one call (``paged_prefill_bf16``,
   each block packed once for every sequence holding it) against the per-sequence loop over
   gathered K/V it replaced (same tile arithmetic, so the outputs are checked equal), on each
   tile the CPU runs, on steps shaped like vLLM's prefix_repetition and random workloads; and
   the engine's time to prefill ``--prompts`` prefix_repetition prompts (4 x 1,024 shared + 64
   own tokens, prefix caching on) before (loop, the CPU's first tile) and now (the default).

    python bench/prefill_attention.py --model DIR [--lens 256,1088] [--prompts 16] [--threads 1]
    python bench/prefill_attention.py --model DIR --paged --prompts 64 [--threads 1]
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


_TILE_NAMES = {"avx512": "AVX512-BF16", "amx": "AMX", "avx2": "AVX2"}


def tiles_here() -> list[str]:
    """The C++ prefill tiles this CPU and build run, in :func:`cpu_paged.prefill_path`'s names."""
    here = cpu_paged.prefill_paths_here()
    return [t for t in ("avx512", "amx", "avx2") if here[t]]


def chunk_table(reps: int) -> None:
    """Per chunk: SDPA against each tile this CPU runs."""
    tiles = [(_TILE_NAMES[t], t) for t in tiles_here()]
    head = " | ".join(f"{n} ms | {n} / SDPA" for n, _ in tiles)
    print(f"| chunk (query, context, Hq / Hkv / D) | SDPA ms | {head} | max error SDPA / tiles |")
    print("|---|---:|" + "---:|---:|" * len(tiles) + "---|")
    g = torch.Generator().manual_seed(0)
    for tq, ctx, hq, hkv, d in [
        (256, 256, 8, 4, 32),
        (1088, 1088, 8, 4, 32),
        (64, 1088, 8, 4, 32),
        (300, 1000, 8, 4, 32),
        (512, 512, 32, 8, 128),
    ]:
        q = torch.randn(tq, hq, d, generator=g).bfloat16()
        k = torch.randn(ctx, hkv, d, generator=g).bfloat16()
        v = torch.randn(ctx, hkv, d, generator=g).bfloat16()
        off, sc = ctx - tq, d**-0.5
        exact = reference._attend(q.float(), k.float(), v.float(), sc, off)
        errs = [(reference._attend(q, k, v, sc, off).float() - exact).abs().max().item()]
        a = _ms(lambda: reference._attend(q, k, v, sc, off), reps)  # noqa: B023
        cells = []
        for _, on in tiles:
            fn = _isa(on, cpu_paged.attend_prefill)
            errs.append((fn(q, k, v, sc, off).float() - exact).abs().max().item())
            b = _ms(lambda: fn(q, k, v, sc, off), reps)  # noqa: B023
            cells.append(f"{b:.2f} | {b / a:.2f}")
        err = " / ".join(f"{e:.4f}" for e in errs)
        print(f"| {tq}, {ctx}, {hq} / {hkv} / {d} | {a:.2f} | {' | '.join(cells)} | {err} |")


def engine_prefill_ms(model: str, length: int, prompts: int, kernel: bool) -> float:
    orig = cpu_paged._prefill_path
    if not kernel:
        cpu_paged._prefill_path = "sdpa"
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
        cpu_paged._prefill_path = orig


def _loop_attention(q, kv, layer, tables, lens, qsl, scale, k_scale=None, v_scale=None):
    """The path before ``paged_prefill_bf16``: per-sequence gather, then the chunk kernel."""
    if bool((qsl[1:] - qsl[:-1] == 1).all()):
        return cpu_paged.paged_decode_attention(q, kv, layer, tables, lens, scale)
    return cpu_paged.gathered_attention(q, kv, layer, tables, lens, qsl, scale)


def paged_step(groups: int, per_group: int, prefix: int, own: int, first_full: int, bs: int = 16):
    """A step's chunks: ``first_full`` sequences prefill their whole prompt (prefix + own), the
    other ``groups * per_group - first_full`` only their own tokens after a cached prefix
    shared with their group. Small-model heads (8 q / 4 kv of 32), 4 layers."""
    g = torch.Generator().manual_seed(groups * 1000 + per_group)
    hq, hkv, d, layers = 8, 4, 32, 4
    ctx = prefix + own
    n = groups * per_group
    nbps = -(-ctx // bs)
    pre = prefix // bs
    nb = groups * pre + n * (nbps - pre) + 8
    kv = torch.randn(nb, layers, 2, bs, hkv, d, generator=g).bfloat16()
    tables = torch.zeros(n, nbps, dtype=torch.int32)
    nxt = groups * pre
    for s in range(n):
        grp = s % groups
        tables[s, :pre] = torch.arange(grp * pre, (grp + 1) * pre, dtype=torch.int32)
        tables[s, pre:] = torch.arange(nxt, nxt + nbps - pre, dtype=torch.int32)
        nxt += nbps - pre
    q_lens = [ctx if s < first_full else own for s in range(n)]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), hq, d, generator=g).bfloat16()
    lens = torch.full((n,), ctx, dtype=torch.int32)
    return q, kv, tables, lens, qsl, d**-0.5


# (name, paged_step's arguments): step shapes of vLLM's prefix_repetition and random workloads
PAGED_SHAPES = [
    (
        "prefix_repetition: 1 x 1,088 + 15 x 64 after a shared 1,024 (4 groups)",
        (4, 4, 1024, 64, 1),
    ),
    ("prefix_repetition: 32 x 64 after a shared 1,024 (4 groups)", (4, 8, 1024, 64, 0)),
    ("random: 2 x 1,024 from scratch (nothing shared)", (1, 2, 0, 1024, 2)),
    ("random: 8 x 256 from scratch", (1, 8, 0, 256, 8)),
]


def _isa(tile: str, fn):
    def run(*args):
        old = cpu_paged._prefill_path
        cpu_paged._prefill_path = tile
        try:
            return fn(*args)
        finally:
            cpu_paged._prefill_path = old

    return run


def paged_table(reps: int, tiles: list[str]) -> None:
    first = tiles[0]
    paths = [
        (f"loop, {_TILE_NAMES[first]} (before)", _isa(first, _loop_attention)),
        *((f"paged, {_TILE_NAMES[t]}", _isa(t, cpu_paged.paged_attention)) for t in tiles),
    ]
    print(
        "| step (chunks), 4 layers | "
        + " | ".join(f"{n} ms" for n, _ in paths)
        + " | last / first |"
    )
    print("|---|" + "---:|" * (len(paths) + 1))
    for name, shape in PAGED_SHAPES:
        q, kv, tables, lens, qsl, sc = paged_step(*shape)
        for isa in tiles:
            a_out = _isa(isa, _loop_attention)(q, kv, 0, tables, lens, qsl, sc)
            b_out = _isa(isa, cpu_paged.paged_attention)(q, kv, 0, tables, lens, qsl, sc)
            if not torch.equal(a_out, b_out):
                raise SystemExit(f"outputs differ on {name}")
        times = []
        for _, fn in paths:

            def run(fn=fn):
                for layer in range(4):
                    fn(q, kv, layer, tables, lens, qsl, sc)  # noqa: B023

            times.append(statistics.median(_ms(run, reps) for _ in range(3)))
        cells = " | ".join(f"{t:.2f}" for t in times)
        print(f"| {name} | {cells} | {times[-1] / times[0]:.2f} |")


def engine_prefixrep_ms(model: str, prompts: int, before: bool) -> float:
    """Prefill of ``prompts`` prefix_repetition prompts; ``before``: the per-sequence loop on
    the CPU's first tile (the path before the paged kernel), else the default (paged, tile by
    CPU)."""
    orig, orig_isa = cpu_paged.paged_attention, cpu_paged._prefill_path
    if before:
        cpu_paged.paged_attention = _loop_attention
        cpu_paged._prefill_path = tiles_here()[0]
    try:
        llm = LLM(model, kv_cache_memory="512MiB", enable_prefix_caching=True)
        rng = random.Random(7)
        prefixes = [[rng.randrange(100, 30000) for _ in range(1024)] for _ in range(4)]
        order = [i % 4 for i in range(prompts)]
        rng.shuffle(order)
        batch = [
            {"prompt_token_ids": prefixes[grp] + [rng.randrange(100, 30000) for _ in range(64)]}
            for grp in order
        ]
        sp = SamplingParams(temperature=0, max_tokens=1)
        llm.generate([{"prompt_token_ids": [5] * 300}], sp)  # warm, shares nothing
        t0 = time.perf_counter()
        llm.generate(batch, sp)
        return (time.perf_counter() - t0) * 1e3
    finally:
        cpu_paged.paged_attention, cpu_paged._prefill_path = orig, orig_isa


def paged_main(args) -> None:
    print(f"default prefill attention here: {cpu_paged.prefill_path()}")
    paged_table(args.reps, tiles_here())
    print()
    print("| prompts (prefix_repetition 4 x 1,024 + 64) | before ms | now ms | now / before |")
    print("|---|---:|---:|---:|")
    before, now = [], []
    for r in range(args.rounds):
        print(
            f"[prefill_attention] engine prefix_repetition, round {r + 1}/{args.rounds}",
            file=sys.stderr,
        )
        before.append(engine_prefixrep_ms(args.model, args.prompts, before=True))
        now.append(engine_prefixrep_ms(args.model, args.prompts, before=False))
    a, b = statistics.median(before), statistics.median(now)
    print(f"| {args.prompts} | {a:.0f} | {b:.0f} | {b / a:.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--lens", default="256,1088")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--paged", action="store_true", help="the paged step kernel against the loop")
    args = ap.parse_args()
    if not tiles_here():
        print(
            "no C++ prefill tile on this CPU (or the extension did not build): nothing to compare"
        )
        return 1
    torch.set_num_threads(args.threads)
    os.environ["PDSERVE_NUM_THREADS"] = str(args.threads)
    print(f"{args.threads} thread(s)")
    if args.paged:
        paged_main(args)
        return 0
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
