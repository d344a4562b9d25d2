"""The fused bf16 element-wise ops (``kernels/cpu_paged.py``: ``rms_norm`` with the residual add,
``rope``, ``silu_mul``) against the torch ops they replace, in isolation, at a few row counts,
interleaved in one run: microseconds per call.

    python bench/fused_ops.py [--rows 1,16,64,512] [--hidden 256] [--heads 8,4,32] [--inter 688]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import cpu_paged
from shared.models.llama import RMSNorm, Rotary


def _us(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64,512")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", default="8,4,32", help="query heads, KV heads, head size")
    ap.add_argument("--inter", type=int, default=688)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    if cpu_paged._bf16_ext() is None:
        print("this CPU has no AVX512-BF16 (or the extension did not build): nothing to compare")
        return 1
    torch.set_num_threads(args.threads)
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    h, i = args.hidden, args.inter
    print(f"{args.threads} thread(s); hidden {h}, heads {hq} / {hkv} x {d}, intermediate {i}")
    print(
        "| rows | add + RMSNorm torch / fused µs | RoPE torch / fused µs | SiLU x mul torch / fused µs |"
    )
    print("|---:|---|---|---|")
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(h, 1e-6).bfloat16()
    rot = Rotary(d, 4096, 10000.0, None)
    for t in (int(x) for x in args.rows.split(",")):
        x = torch.randn(t, h, generator=g).bfloat16()
        r = torch.randn(t, h, generator=g).bfloat16()
        q = torch.randn(t, hq, d, generator=g).bfloat16()
        k = torch.randn(t, hkv, d, generator=g).bfloat16()
        pos = torch.arange(t)
        gu = torch.randn(t, 2 * i, generator=g).bfloat16()

        def silu_torch(gu=gu):
            gate, up = gu.split(i, dim=-1)
            return F.silu(gate) * up

        n0 = _us(lambda: norm._norm(x + r), args.reps)  # noqa: B023
        n1 = _us(lambda: cpu_paged.rms_norm(x, norm.weight, 1e-6, r), args.reps)  # noqa: B023
        r0 = _us(lambda: rot(pos, q, k), args.reps)  # noqa: B023
        r1 = _us(lambda: cpu_paged.rope(q, k, rot.cos, rot.sin, pos), args.reps)  # noqa: B023
        s0 = _us(silu_torch, args.reps)
        s1 = _us(lambda: cpu_paged.silu_mul(gu), args.reps)  # noqa: B023
        print(f"| {t} | {n0:.1f} / {n1:.1f} | {r0:.1f} / {r1:.1f} | {s0:.1f} / {s1:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
