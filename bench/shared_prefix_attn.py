"""CPU decode attention with shared prefixes: the kernel alone, before and after, one process.

Batch 64 in 4 groups of 16 sequences; each group shares a 1,024-token prefix (the same blocks,
as prefix caching gives them) and each sequence has 96 tokens of its own; 8 query / 4 KV
heads of 32, 4 layers, a bf16 cache. The same batch is also timed with block tables that share
nothing (the same bytes per sequence, all read once per sequence). Each case is timed against
the extension built from ``--baseline-source`` (e.g. ``git show fbbc52a~1:kernels/csrc/
cpu_paged.cpp``), interleaved, after checking both give the same output (or outputs within
``--max-diff`` of each other, for a change that rounds differently)::

    git show fbbc52a~1:kernels/csrc/cpu_paged.cpp > /tmp/old_paged.cpp
    .venv/bin/python bench/shared_prefix_attn.py --baseline-source /tmp/old_paged.cpp --threads 1
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kernels import cpp_build, cpu_paged

SEQS, HQ, HKV, HEAD, BLOCK, LAYERS = 64, 8, 4, 32, 16, 4
PREFIX, OWN, GROUPS = 1024, 96, 4


def tables() -> tuple[torch.Tensor, torch.Tensor, int]:
    """(shared tables, tables sharing nothing, blocks in the pool)."""
    pb, ob = PREFIX // BLOCK, -(-OWN // BLOCK)
    shared = torch.zeros(SEQS, pb + ob, dtype=torch.int32)
    distinct = torch.zeros(SEQS, pb + ob, dtype=torch.int32)
    own_base = GROUPS * pb
    distinct_base = own_base + SEQS * ob
    for s in range(SEQS):
        shared[s, :pb] = torch.arange(pb) + (s % GROUPS) * pb
        shared[s, pb:] = torch.arange(ob) + own_base + s * ob
        distinct[s] = torch.arange(pb + ob) + distinct_base + s * (pb + ob)
    return shared, distinct, distinct_base + SEQS * (pb + ob)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-source", required=True, help="cpu_paged.cpp to compare with")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument(
        "--max-diff",
        type=float,
        default=0.0,
        help="largest |difference| allowed between the two kernels' outputs (default: equal)",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    old = cpp_build.build("pdserve_old_paged", Path(args.baseline_source), cpu_paged._FLAGS)
    new = cpu_paged._load()
    shared, distinct, n_blocks = tables()
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(n_blocks, LAYERS, 2, BLOCK, HKV, HEAD, generator=g).to(torch.bfloat16)
    q = torch.randn(SEQS, HQ, HEAD, generator=g).to(torch.bfloat16)
    lens = torch.full((SEQS,), PREFIX + OWN, dtype=torch.int32)
    scale = HEAD**-0.5

    def step(ext, t: torch.Tensor) -> None:
        for layer in range(LAYERS):
            ext.paged_decode(q, kv, layer, t, lens, scale, None, None)

    cases = {
        "baseline, shared": (old, shared),
        "now, shared": (new, shared),
        "baseline, sharing nothing": (old, distinct),
        "now, sharing nothing": (new, distinct),
    }
    for t in (shared, distinct):
        a = old.paged_decode(q, kv, 0, t, lens, scale, None, None)
        b = new.paged_decode(q, kv, 0, t, lens, scale, None, None)
        diff = float((a.float() - b.float()).abs().max())
        assert diff <= args.max_diff, f"the two kernels differ by {diff}"
        print(f"largest |difference| between the kernels' outputs: {diff:.3g}")
    for ext, t in cases.values():
        step(ext, t)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(args.rounds):
        for name, (ext, t) in cases.items():
            t0 = time.perf_counter()
            step(ext, t)
            times[name].append(time.perf_counter() - t0)
        print(f"\rround {r + 1}/{args.rounds}", end="", flush=True)
    print(f"\n{args.threads} thread(s), ms per step ({LAYERS} layers): median (min)")
    for name, v in times.items():
        v.sort()
        print(f"  {name:<26} {v[len(v) // 2] * 1e3:7.2f} ({v[0] * 1e3:.2f})")
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(
        f"  now shared / baseline shared:     {med['now, shared'] / med['baseline, shared']:.2f}x"
    )
    print(
        f"  now shared / now sharing nothing: "
        f"{med['now, shared'] / med['now, sharing nothing']:.2f}x"
    )


if __name__ == "__main__":
    main()
