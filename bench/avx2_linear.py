"""bf16 projections on a CPU with AVX2 only: torch's bf16 ``F.linear`` (oneDNN has no bf16
there, so torch falls back to a generic loop), the C++ AVX2 + FMA kernel
(``kernels/cpu_paged.py::avx2_linear``, the ``avx2`` linear plan), and fp32 after widening both
operands (MKL's sgemm: what a bf16-in-fp32 path would cost, the widening included), in one
process, per row count and thread count.

Each figure is the time of one pass over the small model's five projection shapes (qkv 768 x
256, gate_up 1376 x 256, down 256 x 688, o 256 x 256, LM head 32000 x 256), summed, each shape
averaged over ``max(3, 3000 / rows)`` calls after one warm-up. It first checks the kernel
against the exact product (one bf16 rounding of an fp32 sum) on a few odd shapes.

    python bench/avx2_linear.py [--rows 1,4,16,64,256,1024] [--threads 1,2]

``--baseline-source FILE`` (e.g. ``git show REV:kernels/csrc/cpu_paged.cpp > FILE``) times
this tree's kernel against the one built from FILE instead, per shape and row count, the two
alternating in ``--rounds`` rounds (the best round of each kept, GFLOP/s), and checks that both
give the same bits::

    python bench/avx2_linear.py --baseline-source /tmp/base.cpp --rows 4,8,12,16,64 --threads 1

``--model DIR`` takes the five shapes from a Hugging Face config instead (e.g. the ``medium``
preset's: qkv 2048 x 1024, gate_up 5632 x 1024, down 1024 x 2816, o 1024 x 1024, LM head
32000 x 1024).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import cpp_build, cpu_paged

SHAPES = [(768, 256), (1376, 256), (256, 688), (256, 256), (32000, 256)]


def model_shapes(model_dir: Path) -> list[tuple[int, int]]:
    """(N, K) of a Llama-style model's projections: qkv, gate_up, down, o, LM head."""
    cfg = json.loads((model_dir / "config.json").read_text())
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    kv = cfg.get("num_key_value_heads") or heads
    i = cfg["intermediate_size"]
    return [((heads + 2 * kv) * d, h), (2 * i, h), (h, i), (h, heads * d), (cfg["vocab_size"], h)]


def check() -> None:
    for m, n, k in [(1, 768, 256), (3, 13, 8), (17, 256, 688), (64, 32000, 256)]:
        x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
        got = cpu_paged.avx2_linear(x, w)
        assert got is not None
        exact = x.float() @ w.float().T
        same = float((got == exact.bfloat16()).float().mean())
        print(
            f"[avx2_linear] {m} x {n} x {k}: {same:.4%} of outputs the exact product rounded once"
        )


def against_baseline(source: Path, rows: list[int], threads: list[int], rounds: int) -> None:
    """This tree's kernel against ``source``'s, shape by shape (see the module docstring)."""
    base = cpp_build.build("pdserve_cpu_paged_base", source.resolve(), cpu_paged._FLAGS)
    new = cpu_paged._avx2_ext()
    print("| threads | shape (N x K) | rows | base GFLOP/s | this GFLOP/s | time, this / base |")
    print("|---:|---|---:|---:|---:|---:|")
    differ = 0
    for th in threads:
        torch.set_num_threads(th)
        for n, k in SHAPES:
            # enough distinct weights to pass through memory, as in a step (96 MB: three times a
            # 32 MB L3, so no shape stays in cache from one call to the next)
            ws = [torch.randn(n, k).bfloat16() for _ in range(max(1, 96_000_000 // (n * k * 2)))]
            for m in rows:
                x = torch.randn(m, k).bfloat16()
                a, b = base.linear_bf16_avx2(x, ws[0]), new.linear_bf16_avx2(x, ws[0])
                differ += int(not torch.equal(a.view(torch.int16), b.view(torch.int16)))
                calls = max(20, int(2e8 / (2 * m * n * k)))
                best = {"base": float("inf"), "this": float("inf")}
                for _ in range(rounds):
                    for name, ext in (("base", base), ("this", new)):
                        ext.linear_bf16_avx2(x, ws[-1])
                        t0 = time.perf_counter()
                        for i in range(calls):
                            ext.linear_bf16_avx2(x, ws[i % len(ws)])
                        best[name] = min(best[name], (time.perf_counter() - t0) / calls)
                gf = {name: 2 * m * n * k / t / 1e9 for name, t in best.items()}
                print(
                    f"| {th} | {n} x {k} | {m} | {gf['base']:.1f} | {gf['this']:.1f} | "
                    f"{best['this'] / best['base']:.2f} |",
                    flush=True,
                )
    print(f"[avx2_linear] outputs that differ from the baseline's bits: {differ} shapes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,16,64,256,1024")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--baseline-source", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=3, help="with --baseline-source")
    ap.add_argument("--model", type=Path, default=None, help="shapes of this model's config")
    a = ap.parse_args()
    if a.model is not None:
        SHAPES[:] = model_shapes(a.model.expanduser())
    if not cpu_paged.avx2_linear_available():
        sys.exit("the AVX2 + FMA kernel is not built on this CPU")
    torch.manual_seed(0)
    check()
    if a.baseline_source is not None:
        against_baseline(
            a.baseline_source,
            [int(r) for r in a.rows.split(",")],
            [int(t) for t in a.threads.split(",")],
            a.rounds,
        )
        return
    print("| threads | rows | torch bf16 ms | avx2 kernel ms | fp32 widened ms | kernel / torch |")
    print("|---:|---:|---:|---:|---:|---:|")
    for th in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(th)
        for m in (int(r) for r in a.rows.split(",")):
            tot = {"bf16": 0.0, "avx2": 0.0, "f32": 0.0}
            for n, k in SHAPES:
                w, x = torch.randn(n, k).bfloat16(), torch.randn(m, k).bfloat16()
                fns = {
                    "bf16": lambda x=x, w=w: F.linear(x, w),
                    "avx2": lambda x=x, w=w: cpu_paged.avx2_linear(x, w),
                    "f32": lambda x=x, w=w: F.linear(x.float(), w.float()).bfloat16(),
                }
                for name, f in fns.items():
                    f()
                    calls = max(3, 3000 // m)
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        f()
                    tot[name] += (time.perf_counter() - t0) / calls * 1e3
            print(
                f"| {th} | {m} | {tot['bf16']:.3f} | {tot['avx2']:.3f} | {tot['f32']:.3f} | "
                f"{tot['avx2'] / tot['bf16']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
