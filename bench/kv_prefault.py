"""Page faults and wall time of the engine writing KV into its pool, with the pool's pages
committed as they are first written and committed ahead by ``EngineCore.prefault_kv``.

Each round runs each variant (in alternating order) in a fresh process: a warm-up wave,
then (``prefault`` only) lets ``prefault_kv`` run to the end of its window as an idle engine
loop would, then times ``--waves`` waves of ``--prompts`` random prompts of ``--len`` tokens,
``--out-len`` output tokens each (greedy, ignore_eos), counting the process's minor page
faults (``getrusage``) and the KV pages the waves used for the first time.

    python bench/kv_prefault.py --model DIR [--rounds 2] [--waves 8] [--prompts 16]
        [--len 256] [--out-len 64] [--threads 2] [--kv-cache-memory 1GiB]
"""

from __future__ import annotations

import argparse
import json
import mmap
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams


def run(a: argparse.Namespace, prefault: bool) -> tuple[int, int, float]:
    """(minor faults, KV pages first used, seconds) of the timed waves."""
    llm = LLM(
        a.model,
        kv_cache_memory=a.kv_cache_memory,
        max_num_batched_tokens=2048,
        max_num_seqs=128,
    )
    e = llm.engine
    rng = random.Random(0)
    sp = SamplingParams(temperature=0, max_tokens=a.out_len, ignore_eos=True)

    def wave(tag: str) -> None:
        for i in range(a.prompts):
            e.add_request(f"{tag}{i}", [rng.randrange(100, 30000) for _ in range(a.len)], sp)
        while e.has_unfinished_requests():
            e.step()

    wave("warm-")
    if prefault:
        while e.prefault_kv():
            pass
    mark = e.kv.pool.high_water
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    for w in range(a.waves):
        wave(f"w{w}-")
    dt = time.perf_counter() - t0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    pages = (e.kv.pool.high_water - mark) * e.runner.block_bytes // mmap.PAGESIZE
    return faults, pages, dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--waves", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--len", type=int, default=256)
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--one", choices=["as written", "prefault"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.one:  # one measurement, in this process: a JSON line
        print(json.dumps(run(a, a.one == "prefault")))
        return 0
    args = sys.argv[1:]
    got: dict[str, list[tuple[int, int, float]]] = {"as written": [], "prefault": []}
    for r in range(a.rounds):
        order = list(got) if r % 2 == 0 else list(reversed(got))
        for name in order:
            print(f"[kv_prefault] round {r + 1}/{a.rounds}: {name}", file=sys.stderr)
            out = subprocess.run(
                [sys.executable, __file__, *args, "--one", name],
                check=True,
                stdout=subprocess.PIPE,
                text=True,
            ).stdout
            got[name].append(tuple(json.loads(out.strip().splitlines()[-1])))
            f, p, s = got[name][-1]
            print(f"  {name}: {f} minor faults, {p} KV pages first used, {s:.3f} s")
    for name, rows in got.items():
        med = statistics.median(s for _, _, s in rows)
        faults = " / ".join(str(f) for f, _, _ in rows)
        print(f"{name}: minor faults {faults}; median {med:.3f} s")
    base = statistics.median(s for _, _, s in got["as written"])
    print(
        f"prefault / as written: {statistics.median(s for _, _, s in got['prefault']) / base:.3f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
