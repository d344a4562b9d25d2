"""The KV pool's memory: page faults of the engine writing KV with the pool committed as first
written vs ahead by ``EngineCore.prefault_kv`` (``--what faults``), and the decode step over
long contexts with the pool on 4 KiB pages vs transparent huge pages (``--what decode``).

Each round runs each variant (in alternating order) in a fresh process.

``faults``: a warm-up wave, then (``prefault`` only) ``prefault_kv`` runs to the end of its
window as an idle engine loop would, then ``--waves`` waves of ``--prompts`` random prompts of
``--len`` tokens, ``--out-len`` output tokens each (greedy, ignore_eos) are timed, counting the
process's minor page faults (``getrusage``) and the KV pages the waves used for the first time.

``decode``: the whole pool committed first (``PDSERVE_KV_PREFAULT_MIB`` at the pool's size, so
no fault is timed), ``PDSERVE_KV_HUGEPAGES=0`` (4 KiB pages) or ``1``; ``--batch`` distinct
prompts of ``--len`` tokens decode ``--out-len`` tokens; the median of the last 40 steps'
times (every sequence decoding), and the pool's huge-page bytes from /proc/self/smaps.

    python bench/kv_prefault.py --model DIR [--what faults|decode] [--rounds 2] [--waves 8]
        [--prompts 16] [--len 256] [--out-len 64] [--batch 64] [--threads 2]
        [--kv-cache-memory 1GiB]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.config import parse_bytes
from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams

VARIANTS = {
    "faults": {"as written": {"PDSERVE_KV_PREFAULT_MIB": "0"}, "prefault": {}},
    "decode": {"4 KiB pages": {"PDSERVE_KV_HUGEPAGES": "0"}, "huge pages": {}},
}


def engine(a: argparse.Namespace) -> LLM:
    return LLM(
        a.model,
        kv_cache_memory=a.kv_cache_memory,
        max_num_batched_tokens=2048,
        max_num_seqs=128,
    )


def faults(a: argparse.Namespace) -> dict:
    """Minor faults, KV pages first used and seconds of the timed waves."""
    e = engine(a).engine
    rng = random.Random(0)
    sp = SamplingParams(temperature=0, max_tokens=a.out_len, ignore_eos=True)

    def wave(tag: str) -> None:
        for i in range(a.prompts):
            e.add_request(f"{tag}{i}", [rng.randrange(100, 30000) for _ in range(a.len)], sp)
        while e.has_unfinished_requests():
            e.step()

    wave("warm-")
    while e.prefault_kv():
        pass
    mark = e.kv.pool.high_water
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    for w in range(a.waves):
        wave(f"w{w}-")
    dt = time.perf_counter() - t0
    n = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    pages = (e.kv.pool.high_water - mark) * e.runner.block_bytes // mmap.PAGESIZE
    return {"minor faults": n, "KV pages first used": pages, "s": round(dt, 4)}


def huge_bytes(t: torch.Tensor) -> int:
    addr, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return 0


def decode(a: argparse.Namespace) -> dict:
    """The median decode step (ms) at ``--batch`` over ``--len``-token contexts."""
    e = engine(a).engine
    while e.prefault_kv():
        pass
    rng = random.Random(0)
    sp = SamplingParams(temperature=0, max_tokens=a.out_len, ignore_eos=True)
    for i in range(a.batch):
        e.add_request(f"r{i}", [rng.randrange(100, 30000) for _ in range(a.len)], sp)
    times = []
    while e.has_unfinished_requests():
        t0 = time.perf_counter()
        e.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return {
        "decode step ms": round(statistics.median(times[-40:]), 3),
        "huge page MiB": huge_bytes(e.runner.kv_cache) >> 20,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--what", choices=list(VARIANTS), default="faults")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--waves", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--len", type=int, default=None, help="256 (faults) / 1088 (decode)")
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.len is None:
        a.len = 256 if a.what == "faults" else 1088
    torch.set_num_threads(a.threads)
    if a.one:  # one measurement, in this process: a JSON line
        print(json.dumps(faults(a) if a.what == "faults" else decode(a)))
        return 0
    variants = VARIANTS[a.what]
    got: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(a.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            print(f"[kv_prefault] round {r + 1}/{a.rounds}: {name}", file=sys.stderr)
            env = dict(os.environ, **variants[name])
            if a.what == "decode":  # the whole pool committed before anything is timed
                env["PDSERVE_KV_PREFAULT_MIB"] = str(parse_bytes(a.kv_cache_memory) >> 20)
            out = subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--one", name],
                check=True,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            ).stdout
            got[name].append(json.loads(out.strip().splitlines()[-1]))
            print(f"  {name}: {got[name][-1]}", flush=True)
    key = "s" if a.what == "faults" else "decode step ms"
    medians = {name: statistics.median(row[key] for row in rows) for name, rows in got.items()}
    for name, rows in got.items():
        print(f"{name}: median {key} {medians[name]:.3f} over {len(rows)} rounds")
    base, new = list(medians.values())
    print(f"{list(variants)[1]} / {list(variants)[0]}: {new / base:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
