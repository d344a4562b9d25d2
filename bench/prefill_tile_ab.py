"""The paged bf16 prefill kernel (``paged_prefill_bf16``), this tree's against the extension
built from ``--baseline-source``, interleaved in one process, on each tile the CPU and both
builds have (AMX, AVX512-BF16, AVX2), on ``bench/prefill_attention.py``'s step shapes of vLLM's prefix_repetition and
random workloads (the small model's heads: 8 query, 4 KV, head size 32, 4 layers). Prints the
median ms per step of each and the largest output difference between the two::

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

from bench.prefill_attention import PAGED_SHAPES, paged_step, tiles_here
from kernels import cpp_build, cpu_paged

LAYERS = 4  # paged_step's model: 8 query / 4 KV heads of 32, 4 layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-source", required=True, help="cpu_paged.cpp to compare with")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    old = cpp_build.build("pdserve_pf_base", Path(a.baseline_source), cpu_paged._FLAGS)
    new = cpu_paged._load()
    # tiles both builds have (a baseline older than the AVX2 tile takes a bool: 0 / 1 only)
    tiles = [t for t in tiles_here() if t != "avx2" or hasattr(old, "prefill_avx2_available")]
    if not tiles:
        print("no prefill tile both builds run here: nothing to compare")
        return
    cases = {name: paged_step(*shape) for name, shape in PAGED_SHAPES}
    print(f"{a.threads} thread(s), ms per step (4 layers), median of {a.rounds}")
    for tile in tiles:
        code = cpu_paged._PREFILL_TILE[tile]
        print(f"{tile} tile")
        for name, (q, kv, bt, lens, qsl, sc) in cases.items():

            def step(ext, q=q, kv=kv, bt=bt, lens=lens, qsl=qsl, sc=sc, code=code):
                return [
                    ext.paged_prefill_bf16(q, kv, layer, bt, lens, qsl, sc, code)
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
                f"  {name:72s} base {base:7.2f}  now {now:7.2f}  now / base {now / base:.3f}"
                f"  largest |difference| {diff:.2e}"
            )


if __name__ == "__main__":
    main()
