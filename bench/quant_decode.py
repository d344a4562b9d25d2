"""Decode-step time and weight bytes per token: bf16 vs int8 vs 4-bit, interleaved in one run.

Makes (once, under ``--work``) the ``medium`` test model in bf16 and its GPTQ and AWQ 4-bit
(group 128) copies, then for each batch size times ``--steps`` engine steps of each variant:
``bf16`` (dense), ``int8`` (``--quantization int8``, quantized at load), ``gptq-w4`` and
``awq-w4``. Rounds alternate the variants so drift hits all alike. Also prints the weight bytes a
step reads, the bandwidth that implies at batch 1, and the machine's copy bandwidth for scale.

    python bench/quant_decode.py [--batches 1,16,64] [--rounds 2] [--plot docs/img/quant_decode.png]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.decode_step import time_decode_steps
from shared.engine import LLM
from shared.models.quantization import weight_bytes


def copy_bandwidth() -> float:
    """GB/s of a large tensor copy (bytes read + written), the machine's streaming rate."""
    src = torch.empty(256 << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best / 1e9


def step_ms(model: str, batch: int, steps: int, prompt_len: int, **kw) -> tuple[float, int]:
    llm = LLM(model, kv_cache_memory="1GiB", **kw)
    engine = llm.engine
    ms = time_decode_steps(engine, batch, prompt_len, steps, max_token=30000)
    nbytes = weight_bytes(engine.runner.model)
    del llm, engine
    gc.collect()
    return ms, nbytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/pdserve-quant-bench")
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    from shared.cli.quantize import quantize_checkpoint
    from shared.cli.tiny_model import make_tiny_model

    work = Path(args.work)
    dense = work / f"{args.preset}-bf16"
    if not (dense / "model.safetensors").exists():
        print(f"[quant_decode] writing the {args.preset} model to {dense}", flush=True)
        make_tiny_model(dense, preset=args.preset)
    variants: dict[str, tuple[Path, dict]] = {
        "bf16": (dense, {}),
        "int8": (dense, {"quantization": "int8"}),
    }
    for method in ("gptq", "awq"):
        path = work / f"{args.preset}-{method}-w4g128"
        if not (path / "model.safetensors").exists():
            print(f"[quant_decode] quantizing to {path}", flush=True)
            quantize_checkpoint(dense, path, method, 4, 128)
        variants[f"{method}-w4"] = (path, {})
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"CPU threads {torch.get_num_threads()}, copy bandwidth {copy_bandwidth():.1f} GB/s",
        flush=True,
    )
    times: dict[tuple[str, int], list[float]] = {}
    nbytes: dict[str, int] = {}
    total = args.rounds * len(batches) * len(variants)
    done = 0
    for r in range(args.rounds):
        for b in batches:
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                path, kw = variants[name]
                ms, nb = step_ms(str(path), b, args.steps, args.prompt_len, **kw)
                times.setdefault((name, b), []).append(ms)
                nbytes[name] = nb
                done += 1
                print(f"[{done}/{total}] round {r} batch {b} {name}: {ms:.2f} ms/step", flush=True)
    print()
    print("| batch | " + " | ".join(f"{n} ms/step (x bf16)" for n in variants) + " |")
    print("|---|" + "---|" * len(variants))
    for b in batches:
        base = statistics.median(times[("bf16", b)])
        cells = []
        for n in variants:
            t = statistics.median(times[(n, b)])
            cells.append(f"{t:.2f} ({t / base:.2f}x)")
        print(f"| {b} | " + " | ".join(cells) + " |")
    print()
    for n in variants:
        t1 = statistics.median(times[(n, batches[0])])
        print(
            f"{n}: weights read per step {nbytes[n] / 2**20:.1f} MiB; at batch {batches[0]} "
            f"{nbytes[n] / (t1 / 1e3) / 1e9:.1f} GB/s"
        )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        width = 0.8 / len(variants)
        for i, n in enumerate(variants):
            ax.bar(
                [j + i * width for j in range(len(batches))],
                [statistics.median(times[(n, b)]) for b in batches],
                width,
                label=n,
            )
        ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(batches))])
        ax.set_xticklabels([f"batch {b}" for b in batches])
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"{args.preset} model, {torch.get_num_threads()} threads")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
