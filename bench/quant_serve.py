"""End-to-end serving throughput of quantized weights against bf16, same client, one run.

Starts ``pdserve up`` (1 prefill + 1 decode, the compare suite's limits) on the ``medium``
model of ``bench/quant_decode.py`` for each variant in turn (bf16, ``--quantization int8``, the
GPTQ 4-bit copy), runs ``pdserve bench`` on the vLLM suite's workload (random 256 -> 64 tokens,
64 prompts, rate inf; ``--workload`` for others) with the same seeds, and prints output tok/s,
TTFT and TPOT per variant with the ratio to bf16. Variants alternate per seed.

    python bench/quant_serve.py [--seeds 3] [--num-prompts 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.compare_vllm import PdserveServer, wait_quiet

ROOT = Path(__file__).resolve().parent.parent


def run_bench(url: str, model: str, seed: int, n: int, out: Path, args) -> dict:  # type: ignore[no-untyped-def]
    exe = ROOT / ".venv" / "bin" / "pdserve"
    cmd = [
        str(exe) if exe.exists() else "pdserve",
        "bench",
        "--base-url",
        url,
        "--model",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(n),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--seed",
        str(seed),
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    m = json.loads(out.read_text())["metrics"]
    if m["failed"]:
        raise RuntimeError(f"{m['failed']} requests failed: {m['errors']}")
    return {
        "output_throughput": m["output_throughput"],
        "median_ttft_ms": m["ttft"]["p50"],
        "median_tpot_ms": m["tpot"]["p50"],
        "p99_itl_ms": m["itl"]["p99"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/pdserve-quant-bench")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--port", type=int, default=8300)
    args = ap.parse_args()
    work = Path(args.work)
    dense = work / "medium-bf16"
    gptq = work / "medium-gptq-w4g128"
    if not (dense / "model.safetensors").exists() or not (gptq / "model.safetensors").exists():
        print("run bench/quant_decode.py first (it writes the models)")
        return 2
    variants = {
        "bf16": (dense, []),
        "int8": (dense, ["--quantization", "int8"]),
        "gptq-w4": (gptq, []),
    }
    results: dict[str, list[dict]] = {k: [] for k in variants}
    total = args.seeds * len(variants)
    done = 0
    for s in range(args.seeds):
        order = list(variants) if s % 2 == 0 else list(reversed(variants))
        for name in order:
            path, extra = variants[name]
            wait_quiet(1.5, 120, name)
            run = work / "serve" / f"{name}-{s}"
            run.mkdir(parents=True, exist_ok=True)
            server = PdserveServer(
                str(path), args.port, run / "server.log", run / "run", extra=extra
            )
            server.start(600)
            try:
                r = run_bench(
                    server.base_url, str(path), 100 + s, args.num_prompts, run / "bench.json", args
                )
            finally:
                server.stop()
            results[name].append(r)
            done += 1
            print(
                f"[{done}/{total}] seed {100 + s} {name}: {r['output_throughput']:.1f} output tok/s, "
                f"TTFT p50 {r['median_ttft_ms']:.0f} ms, TPOT p50 {r['median_tpot_ms']:.1f} ms",
                flush=True,
            )
    base = statistics.mean(r["output_throughput"] for r in results["bf16"])
    print("\n| variant | output tok/s (x bf16) | TTFT p50 ms | TPOT p50 ms | ITL p99 ms |")
    print("|---|---|---|---|---|")
    for name, rs in results.items():
        tput = statistics.mean(r["output_throughput"] for r in rs)
        lo, hi = min(r["output_throughput"] for r in rs), max(r["output_throughput"] for r in rs)
        print(
            f"| {name} | {tput:.1f} [{lo:.1f}-{hi:.1f}] ({tput / base:.2f}x) | "
            f"{statistics.mean(r['median_ttft_ms'] for r in rs):.0f} | "
            f"{statistics.mean(r['median_tpot_ms'] for r in rs):.1f} | "
            f"{statistics.mean(r['p99_itl_ms'] for r in rs):.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
