"""A model's layer projections on an AMX CPU: oneDNN's prepacked primitive (the ``onednn``
linear plan) against the AMX walk of ``kernels/cpu_paged.py::amx_proj`` (the ``amx`` plan, the
default there: the LM head's kernel, the weight packed once in the tiles' B layout and streamed
once for all rows; past 64 rows K in slices of 256), in one process, per row count.

One "step" calls each of the model's four layer projections (qkv, o, gate_up, down) for every
layer, each layer with its own distinct weights, as a decode step or a prefill chunk does, so
the weights come from memory, not from a cache that one repeated weight would sit in. The two
kernels alternate for ``--rounds`` rounds after one warm-up each; the table gives the median
step time, the weight rate, and whether the first layer's outputs have the same bits (they do
up to 32 rows; past that oneDNN's kernel adds in another order, see docs/kernels.md).

    python bench/amx_layers.py --model DIR [--rows 1,16,32,64,128,256,512,2048] [--threads 1]

Needs AMX tiles (``amx_linear_available``); elsewhere it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.avx2_linear import model_shapes
from kernels import cpu_linear, cpu_paged


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path, help="a Hugging Face Llama directory")
    ap.add_argument("--rows", default="1,16,32,64,128,256,512,2048")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=None, help="default: the model's own count")
    args = ap.parse_args()
    if not (cpu_linear.onednn_bf16() and cpu_paged.amx_linear_available()):
        print("needs AMX tiles and oneDNN's bf16 primitives on this CPU", file=sys.stderr)
        return 2

    cfg = json.loads((args.model / "config.json").read_text())
    layers = args.layers or int(cfg["num_hidden_layers"])
    shapes = model_shapes(args.model)[:4]  # qkv, gate_up, down, o (the LM head has its own)
    if kept := [s for s in shapes if s[1] % 32]:  # the amx plan leaves these on oneDNN
        print(f"left out (K not a multiple of 32, on oneDNN in the amx plan too): {kept}")
        shapes = [s for s in shapes if s[1] % 32 == 0]
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = [
        [(torch.randn(n, k, generator=g) * 0.05).bfloat16() for n, k in shapes]
        for _ in range(layers)
    ]
    onednn = [[cpu_linear.pack(w) for w in lw] for lw in weights]
    tiles = [[cpu_paged.amx_pack(w) for w in lw] for lw in weights]
    total = sum(w.numel() * 2 for lw in weights for w in lw)
    feats = cpu_linear.CpuFeatures.detect()
    print(f"CPU: {feats.describe()}; {args.threads} thread(s)")
    print(
        f"{layers} layers x {len(shapes)} projections {shapes}, {total / 1e6:.0f} MB of distinct "
        f"bf16 weights; median of {args.rounds} rounds, ms per step"
    )
    print(
        "| rows | oneDNN (prepacked) | amx_proj | amx / oneDNN | GB/s oneDNN | GB/s amx | same bits |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for _, k in shapes}

        def step_onednn(xs: dict[int, torch.Tensor] = xs) -> None:
            for lw in onednn:
                for (_, k), w in zip(shapes, lw, strict=True):
                    cpu_linear.packed_linear(xs[k], w, None)

        def step_amx(xs: dict[int, torch.Tensor] = xs) -> None:
            for lw in tiles:
                for (n, k), w in zip(shapes, lw, strict=True):
                    cpu_paged.amx_proj(xs[k], w, n)

        times: dict[str, list[float]] = {"onednn": [], "amx": []}
        step_onednn()
        step_amx()
        for r in range(args.rounds):
            print(f"[amx_layers] rows {m} round {r + 1}/{args.rounds}", end="\r", file=sys.stderr)
            for name, fn in (("onednn", step_onednn), ("amx", step_amx)):
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
        same = all(
            torch.equal(
                cpu_linear.packed_linear(xs[k], onednn[0][i], None),
                cpu_paged.amx_proj(xs[k], tiles[0][i], n),
            )
            for i, (n, k) in enumerate(shapes)
        )
        a, b = statistics.median(times["onednn"]), statistics.median(times["amx"])
        print(
            f"| {m} | {a:.2f} | {b:.2f} | {b / a:.3f} | {total / a / 1e6:.1f} | "
            f"{total / b / 1e6:.1f} | {'yes' if same else 'no'} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
