"""The paged bf16 prefill kernel (``paged_prefill_bf16``), this tree's against the extension
built from ``--baseline-source``, interleaved in one process, on each tile the CPU has (AMX,
AVX512-BF16): step shapes of vLLM's prefix_repetition workload (31 chunks of 64 tokens after
shared 1,024-token prefixes) and of the random ones (2 x 1,024 and 8 x 256 from scratch), the
small model's heads (8 query, 4 KV, head size 32, 4 layers). Prints the median ms per step of
each and the largest output difference between the two::

    git show REV:kernels/csrc/cpu_paged.cpp > /tmp/base_paged.cpp
    .venv/bin/python bench/prefill_tile_ab.py --baseline-source /tmp/base_paged.cpp
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import cpp_build, cpu_paged

HQ, HKV, D, BS, LAYERS, PREFIX = 8, 4, 32, 16, 4, 1024


def make_case(chunks: list[tuple[int, int, int | None]], g: torch.Generator):
    """Inputs of one step: ``chunks`` of (context before, new tokens, shared prefix group)."""
    pb = PREFIX // BS
    n_blocks = 4 * pb + sum((c + n) // BS + 2 for c, n, _ in chunks) + 8
    kv = torch.randn(n_blocks, LAYERS, 2, BS, HKV, D, generator=g).to(torch.bfloat16)
    tables, lens, qsl, nxt = [], [], [0], 4 * pb
    for c, n, grp in chunks:
        row = []
        for b in range(-(-(c + n) // BS)):
            if grp is not None and b < pb:
                row.append(grp * pb + b)
            else:
                row.append(nxt)
                nxt += 1
        tables.append(row)
        lens.append(c + n)
        qsl.append(qsl[-1] + n)
    width = max(len(r) for r in tables)
    bt = torch.tensor([r + [0] * (width - len(r)) for r in tables], dtype=torch.int32)
    q = torch.randn(qsl[-1], HQ, D, generator=g).to(torch.bfloat16)
    return q, kv, bt, torch.tensor(lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-source", required=True, help="cpu_paged.cpp to compare with")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    old = cpp_build.build("pdserve_pf_base", Path(a.baseline_source), cpu_paged._FLAGS)
    new = cpu_paged._bf16_ext()
    if new is None:
        print("no AVX512-BF16 build here: nothing to compare")
        return
    g = torch.Generator().manual_seed(0)
    cases = {
        "prefix_repetition: 31 x 64 after a shared 1,024": make_case(
            [(PREFIX, 64, i % 4) for i in range(31)], g
        ),
        "random: 2 x 1,024 from scratch": make_case([(0, 1024, None)] * 2, g),
        "random: 8 x 256 from scratch": make_case([(0, 256, None)] * 8, g),
    }
    print(f"{a.threads} thread(s), ms per step (4 layers), median of {a.rounds}")
    tiles = [True, False] if new.prefill_amx_available() else [False]
    for amx in tiles:
        print("AMX tile" if amx else "AVX512-BF16 tile")
        for name, (q, kv, bt, lens, qsl) in cases.items():

            def step(ext, q=q, kv=kv, bt=bt, lens=lens, qsl=qsl, amx=amx):
                return [
                    ext.paged_prefill_bf16(q, kv, layer, bt, lens, qsl, D**-0.5, amx)
                    for layer in range(LAYERS)
                ]

            diff = max(
                (x.float() - y.float()).abs().max().item() for x, y in zip(step(old), step(new))
            )
            t: dict[str, list[float]] = {"base": [], "now": []}
            for _ in range(a.rounds):
                for key, ext in (("base", old), ("now", new)):
                    t0 = time.perf_counter()
                    step(ext)
                    t[key].append(time.perf_counter() - t0)
            base, now = (statistics.median(t[k]) * 1e3 for k in ("base", "now"))
            print(
                f"  {name:48s} base {base:7.2f}  now {now:7.2f}  now / base {now / base:.3f}"
                f"  largest |difference| {diff:.2e}"
            )


if __name__ == "__main__":
    main()
