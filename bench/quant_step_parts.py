"""Where a batch-1 decode step's time goes, bf16 vs int8 vs GPTQ 4-bit: the projections' and
the LM head's share, the rest (attention, norms, element-wise work, Python) by difference.

Wraps ``kernels.quant.quant_linear`` and ``kernels.cpu_paged.small_linear`` with timers and
runs ``--steps`` engine steps of one decoding request per variant, on the models
``bench/quant_decode.py`` writes (run it first).

    python bench/quant_step_parts.py [--work /tmp/pdserve-quant-bench] [--steps 40]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import cpu_paged, quant
from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams
from shared.models import llama


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/pdserve-quant-bench")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    work = Path(args.work)
    spent: Counter[str] = Counter()
    plain_quant, plain_small = quant.quant_linear, cpu_paged.small_linear

    def timed_quant(x, pw, bias):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        y = plain_quant(x, pw, bias)
        spent[f"projections ({pw.path})"] += time.perf_counter() - t
        return y

    def timed_small(x, w):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        y = plain_small(x, w)
        name = "LM head" if w.shape[0] > 16384 else "projections (bf16 small_linear)"
        spent[name] += time.perf_counter() - t
        return y

    quant.quant_linear = timed_quant  # type: ignore[assignment]
    variants = {
        "bf16": (work / "medium-bf16", {}),
        "int8": (work / "medium-bf16", {"quantization": "int8"}),
        "gptq-w4": (work / "medium-gptq-w4g128", {}),
    }
    for name, (path, kw) in variants.items():
        engine = LLM(str(path), kv_cache_memory="1GiB", **kw).engine
        for m in engine.runner.model.modules():  # the model keeps the backend's function
            if isinstance(m, llama.Linear):
                m.small = timed_small
        engine.runner.model.small_linear = timed_small
        rng = random.Random(0)
        engine.add_request(
            "r",
            [rng.randrange(100, 30000) for _ in range(64)],
            SamplingParams(temperature=0, max_tokens=args.steps + 16, ignore_eos=True),
        )
        for _ in range(6):
            engine.step()
        spent.clear()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        step = (time.perf_counter() - t0) / args.steps * 1e3
        parts = {k: v / args.steps * 1e3 for k, v in spent.items()}
        rest = step - sum(parts.values())
        shown = ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(parts.items()))
        print(f"{name}: {step:.2f} ms/step = {shown}, rest {rest:.2f} ms", flush=True)
        del engine
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
