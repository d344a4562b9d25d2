"""Step time of one worker laid out as TP 1, TP 2 and PP 2 (shared/engine/distributed.py), on the
same model and the same cores, in one run: decode steps at several batch sizes and one
prefill step, with the ratio to TP 1.

The layouts share the machine's cores: TP 1 runs one rank with ``--threads`` torch threads,
TP 2 / PP 2 run two ranks with ``--threads / 2`` each (vLLM's CPU backend binds its ranks to
disjoint cores the same way). On a 2-core CPU this measures the cost of the collectives and the
control broadcast, not a speed-up: TP pays off when each rank has its own memory bandwidth
(GPUs, sockets), which two cores of one socket do not give.

    python bench/parallel_step.py --model DIR [--layouts tp1,tp2,pp2] [--batches 1,16,64]
        [--threads 2] [--plot docs/img/parallel_step.png] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams

LAYOUTS = {
    "tp1": dict(tensor_parallel_size=1),
    "tp2": dict(tensor_parallel_size=2),
    "pp2": dict(pipeline_parallel_size=2),
    "tp2pp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2),
}


def _add(engine, n: int, prompt_len: int, max_tokens: int, tag: str) -> None:
    rng = random.Random(f"{tag}/{n}/{prompt_len}")  # distinct prompts per tag: no cache hits
    for i in range(n):
        engine.add_request(
            f"{tag}{i}",
            [rng.randrange(100, 1000) for _ in range(prompt_len)],
            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        )


def _tokens(outs) -> int:
    return sum(len(o.new_token_ids) for o in outs)


def decode_ms(engine, batch: int, prompt_len: int, steps: int) -> float:
    """ms per round of one new token for every sequence, once all decode (with pipeline
    parallelism an engine step dispatches or collects a micro-batch: rounds compare, calls
    do not)."""
    _add(engine, batch, prompt_len, steps + 16, f"d{batch}-")
    made = 0
    while made < 4 * batch:  # the prefill, then warm decode rounds
        made += _tokens(engine.step())
    t0 = time.perf_counter()
    made = 0
    while made < steps * batch:
        made += _tokens(engine.step())
    ms = (time.perf_counter() - t0) / (made / batch) * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    return ms


def prefill_ms(engine, tokens: int, repeats: int) -> float:
    """ms from admitting a ``tokens``-token prompt to its first token (best of ``repeats``)."""
    best = float("inf")
    for r in range(repeats):
        _add(engine, 1, tokens, 1, f"p{r}-")
        t0 = time.perf_counter()
        while not _tokens(engine.step()):
            pass
        best = min(best, (time.perf_counter() - t0) * 1e3)
        while engine.has_unfinished_requests():
            engine.step()
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--layouts", default="tp1,tp2,pp2")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of all ranks together")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    results: dict[str, dict[str, float]] = {}
    for name in a.layouts.split(","):
        layout = LAYOUTS[name]
        world = layout.get("tensor_parallel_size", 1) * layout.get("pipeline_parallel_size", 1)
        os.environ["PDSERVE_NUM_THREADS"] = str(max(1, a.threads // world))
        print(
            f"[{name}] {world} rank(s) x {os.environ['PDSERVE_NUM_THREADS']} thread(s)", flush=True
        )
        llm = LLM(
            a.model,
            kv_cache_memory="512MiB",
            max_num_batched_tokens=max(2048, a.prefill_tokens),
            **layout,
        )
        try:
            row: dict[str, float] = {}
            for b in batches:
                row[f"decode_b{b}"] = decode_ms(llm.engine, b, a.prompt_len, a.steps)
                print(f"  decode batch {b:3d}: {row[f'decode_b{b}']:8.2f} ms/round", flush=True)
            row["prefill"] = prefill_ms(llm.engine, a.prefill_tokens, 3)
            print(f"  prefill {a.prefill_tokens} tokens: {row['prefill']:8.1f} ms", flush=True)
            results[name] = row
        finally:
            llm.engine.shutdown()
    base = results.get("tp1")
    keys = [f"decode_b{b}" for b in batches] + ["prefill"]
    print("\n| step | " + " | ".join(results) + " |")
    print("|---|" + "---:|" * len(results))
    for k in keys:
        cells = []
        for name, row in results.items():
            ratio = f" ({row[k] / base[k]:.2f}x)" if base and name != "tp1" else ""
            cells.append(f"{row[k]:.2f} ms{ratio}")
        print(f"| {k} | " + " | ".join(cells) + " |")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / len(results)
        for i, (name, row) in enumerate(results.items()):
            ax.bar(
                [j + i * width for j in range(len(keys))], [row[k] for k in keys], width, label=name
            )
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))], keys)
        ax.set_ylabel("ms per token round (decode) / to the first token (prefill)")
        ax.set_yscale("log")
        ax.set_title(f"step time by layout, {a.threads} threads in all")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
