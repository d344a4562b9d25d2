"""Time the quantized linear kernels against bf16 ``F.linear`` at decode batch sizes.

Each measured call cycles through ``--layers`` distinct weights (more bytes than the CPU's last
level cache, so the weights stream from memory as in a model's decode step), for every path that
applies: dense bf16 (oneDNN), torch's packed kernels (``_weight_int8pack_mm``,
``_weight_int4pack_mm_for_cpu``) and the C++ kernels (``kernels/csrc/quant_cpu.cpp``).

    python bench/quant_linear.py --n 5632 --k 1024 --layers 24
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from kernels import quant, quant_cpu


def timed(fn, xs, ws, reps: int) -> float:
    for x, w in zip(xs, ws):
        fn(x, w)
    t0 = time.perf_counter()
    for _ in range(reps):
        for x, w in zip(xs, ws):
            fn(x, w)
    return (time.perf_counter() - t0) / (reps * len(ws)) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5632)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    n, k = args.n, args.k
    dense = [torch.randn(n, k).mul_(0.02) for _ in range(args.layers)]
    ext = quant_cpu.extension()
    print(
        f"N={n} K={k}, {args.layers} weights, threads={torch.get_num_threads()}, cpp={ext is not None}"
    )
    schemes = {
        "int8": [quant.quantize_int8_per_channel(w) for w in dense],
        "w4g128": [quant.quantize_rtn(w, 4, 128, True) for w in dense],
    }
    bf16 = [w.bfloat16() for w in dense]
    rows = []
    for m in args.batch:
        xs = [torch.randn(m, k).bfloat16() for _ in dense]
        t_dense = timed(F.linear, xs, bf16, args.reps)
        line = {"M": m, "dense bf16": t_dense}
        for name, qws in schemes.items():
            for label, cpp in (("torch", None), ("cpp", ext)):
                if label == "cpp" and cpp is None:
                    continue
                pws = [quant.prepare(q, torch.device("cpu"), torch.bfloat16, cpp) for q in qws]
                pws = [p for p in pws]
                if label == "torch" and pws[0].path == "dequant":
                    continue
                t = timed(lambda x, p: quant.quant_linear(x, p, None), xs, pws, args.reps)
                line[f"{name} {pws[0].path}"] = t
        rows.append(line)
        print(
            f"M={m:3d}  "
            + "  ".join(
                f"{key}: {v:7.0f} us ({v / t_dense:4.2f}x)" for key, v in line.items() if key != "M"
            )
        )
    gb = n * k * 2 / 1e9
    print(f"dense bf16 weight: {gb * 1e3:.1f} MB per layer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
