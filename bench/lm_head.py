"""The LM head alone: oneDNN's packed primitive (then ``argmax_rows`` for a greedy draw) against
the one-pass projection (``kernels/cpu_paged.py::amx_linear``, and ``amx_argmax``: the draw fused
in, no logits written) on AMX tiles where the CPU has them, else on AVX512-BF16 dot products
(AMD EPYC Zen 4, older Xeons), interleaved in one process, per row count.

Each round times every variant once per row count in turn; the table gives the median and the
minimum over the rounds (this host's neighbours move single calls by ±15 %), the rate of the
fused path (GFLOP/s: 2 x rows x vocab x hidden per call), and whether its logits have the same
bits as oneDNN's for that shape. Without either kernel only oneDNN runs. The weight is read
from cache where it fits (32000 x 256 bf16 is 15.6 MiB); `bench/decode_step.py` times it in a
whole step.

    python bench/lm_head.py [--vocab 32000] [--hidden 256] [--rows 1,16,64,128,256]
        [--threads 1] [--rounds 25]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import cpu_linear, cpu_paged


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rows", default="1,16,64,128,256")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=25)
    args = ap.parse_args()
    if not cpu_linear.onednn_bf16():
        print("needs oneDNN's bf16 primitives on this CPU (AVX-512 at least)", file=sys.stderr)
        return 2
    tiles = cpu_paged.amx_linear_available()
    one_pass = tiles or cpu_paged.dp_linear_available()
    kernel = "AMX" if tiles else "AVX512-BF16"
    torch.set_num_threads(args.threads)
    feats = cpu_linear.CpuFeatures.detect()
    print(f"CPU: {feats.describe()}; {args.threads} thread(s)")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(args.vocab, args.hidden, generator=g) * 0.05).bfloat16()
    onednn = cpu_linear.pack(w)
    packed = cpu_paged.amx_pack(w) if one_pass else None
    v = args.vocab
    print(
        f"LM head {v} x {args.hidden} bf16 ({w.numel() * 2 / 2**20:.1f} MiB); ms per call, "
        f"median (min) of {args.rounds} rounds"
        + (f"; one pass on {kernel}" if one_pass else "; no one-pass kernel here: oneDNN only")
    )
    if one_pass:
        print(
            f"| rows | oneDNN logits | oneDNN + argmax_rows | {kernel} logits "
            f"| {kernel} argmax (fused) | fused / oneDNN + argmax | GFLOP/s (fused) | same bits |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---|")
    else:
        print("| rows | oneDNN logits | oneDNN + argmax_rows | GFLOP/s (logits, median) |")
        print("|---:|---:|---:|---:|")
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, args.hidden, generator=g).bfloat16()
        variants: dict[str, Callable[[], torch.Tensor]] = {
            "onednn": lambda x=x: cpu_linear.packed_linear(x, onednn, None),
            "onednn_argmax": lambda x=x: cpu_paged.argmax_rows(
                cpu_linear.packed_linear(x, onednn, None)
            ),
        }
        if packed is not None:
            variants["one"] = lambda x=x: cpu_paged.amx_linear(x, packed, v, tiles)
            variants["one_argmax"] = lambda x=x: cpu_paged.amx_argmax(x, packed, v, tiles)
        times: dict[str, list[float]] = {k: [] for k in variants}
        for fn in variants.values():
            fn()
        for r in range(args.rounds):
            print(f"[lm_head] rows {m} round {r + 1}/{args.rounds}", end="\r", file=sys.stderr)
            for k, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                times[k].append((time.perf_counter() - t0) * 1e3)
        med = {k: statistics.median(t) for k, t in times.items()}
        cells = " | ".join(f"{med[k]:.2f} ({min(times[k]):.2f})" for k in variants)
        if packed is None:
            gflops = 2 * m * v * args.hidden / (med["onednn"] * 1e-3) / 1e9
            print(f"| {m} | {cells} | {gflops:.0f} |")
            continue
        same = torch.equal(variants["one"](), variants["onednn"]())
        ratio = med["one_argmax"] / med["onednn_argmax"]
        gflops = 2 * m * v * args.hidden / (med["one_argmax"] * 1e-3) / 1e9
        print(f"| {m} | {cells} | {ratio:.2f} | {gflops:.0f} | {'yes' if same else 'no'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
