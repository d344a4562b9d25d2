"""Prefill time of one prompt through the engine (bf16, the CPU's linear plan), per prompt
length: the figure to compare the AVX2 linear kernel's two paths with, run once per setting
of ``PDSERVE_AVX2_BLOCKED_ROWS`` (read once per process, so one process per setting):

    for r in 16 1000000000 16 1000000000; do
      PDSERVE_AVX2_BLOCKED_ROWS=$r .venv/bin/python bench/avx2_prefill.py
    done

(16, the default: outer-product blocks from 16 rows; 1000000000: the dot-product kernel for
every row count, the kernel before). Each prompt is new (prefix caching off), one token is
drawn; the median of ``--reps`` after one warm-up is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_MODEL = Path.home() / ".cache/pdserve/compare/small-llama"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--lengths", default="256,1024,2048")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    from shared.engine import LLM
    from shared.engine.sampling_params import SamplingParams

    llm = LLM(a.model, device="cpu", kv_cache_memory="256MiB", enable_prefix_caching=False)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    setting = os.environ.get("PDSERVE_AVX2_BLOCKED_ROWS", "16 (default)")
    out = []
    for n in (int(x) for x in a.lengths.split(",")):
        times = []
        for r in range(a.reps + 1):
            prompt = [(i * 7 + r) % 31000 + 3 for i in range(n)]
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], sp)
            times.append(time.perf_counter() - t0)
        out.append(f"{n}: {statistics.median(times[1:]) * 1000:.1f} ms")
    print(f"PDSERVE_AVX2_BLOCKED_ROWS={setting}: prefill " + ", ".join(out), flush=True)


if __name__ == "__main__":
    main()
