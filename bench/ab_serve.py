"""pdserve against pdserve: whole clusters that differ only in environment variables or
``pdserve up`` flags, started one after the other in alternating order, on vLLM's suite.

The served A/B figures in docs/benchmarks.md (``PDSERVE_CPU_DECODE=avx512`` against the
default, ``PDSERVE_SPILL_KV_TOKENS=0`` against the default, ...) come from this driver. This
host's speed drifts by 20-30 % from hour to hour, more than most single changes are worth,
so the variants are interleaved: round ``r`` starts every variant once (the order reversed on
odd rounds), each on a fresh cluster with the same limits as ``bench/compare_vllm.py``, warms
it up, and runs each workload with the same seeds for every variant. A variant is a name and
a JSON object ``{"env": {...}, "args": [...]}``; the first variant is the baseline.

    .venv/bin/python bench/ab_serve.py --topology 0x1 --rounds 3 --seeds 2 \\
        --workloads prefixrep1024 \\
        --variant base '{}' --variant avx512 '{"env": {"PDSERVE_CPU_DECODE": "avx512"}}'

Prints every run, then per workload each variant's mean (min-max) and its ratio to the
baseline: the ratio of means, and the spread of the per-round paired ratios (a variant and
the baseline of the same round, same seeds, minutes apart). Writes the runs as JSON under
``bench/results/``. It runs no vLLM; vLLM ratios come from ``bench/compare_vllm.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.compare_vllm import (
    DEFAULT_MODEL_DIR,
    RAW,
    RESULTS,
    WORKLOADS,
    PdserveServer,
    code_version,
    ensure_model,
    loadavg,
    sigterm_as_exit,
    vllm_bench,
    wait_quiet,
    warmup,
)
from shared.ports import free_port

#: (key in vllm bench's JSON, label, higher is better)
METRICS = [
    ("output_throughput", "out tok/s", True),
    ("p99_ttft_ms", "TTFT p99", False),
    ("median_tpot_ms", "TPOT p50", False),
    ("p99_itl_ms", "ITL p99", False),
]


def parse_variant(name: str, spec: str) -> dict:
    """``{"env": {NAME: value}, "args": [flag, ...]}``; anything else is a usage error."""
    try:
        v = json.loads(spec or "{}")
    except ValueError as e:
        raise SystemExit(f"--variant {name}: not JSON: {e}") from None
    if not isinstance(v, dict) or set(v) - {"env", "args"}:
        raise SystemExit(
            f'--variant {name}: expected {{"env": {{...}}, "args": [...]}}, got {spec}'
        )
    env, args = v.get("env", {}), v.get("args", [])
    if not isinstance(env, dict) or not all(isinstance(x, str) for x in env.values()):
        raise SystemExit(f"--variant {name}: env values must be strings")
    if not isinstance(args, list) or not all(isinstance(x, str) for x in args):
        raise SystemExit(f"--variant {name}: args must be a list of strings")
    return {"env": env, "args": args}


def round_order(names: list[str], r: int) -> list[str]:
    """Round ``r``'s start order: as given on even rounds, reversed on odd ones, so neither
    side always runs first after a quiet spell."""
    return list(names) if r % 2 == 0 else list(reversed(names))


def run_seed(base: int, workload_index: int, r: int, s: int, seeds: int) -> int:
    """The same seed for every variant of round ``r``; a new one per round, workload and
    repetition (so no prefix cache carries one run into the next)."""
    return base + 1000 * workload_index + r * seeds + s


def summarize(runs: list[dict], names: list[str]) -> dict:
    """Per workload and variant: each metric's mean, min, max, the ratio of means to the
    first variant, and the per-round paired ratios (same round, same seeds)."""
    out: dict = {}
    for w in dict.fromkeys(r["workload"] for r in runs):
        for key, _, _ in METRICS:
            by: dict[str, dict[int, list[float]]] = {n: {} for n in names}
            for r in runs:
                m = r.get("metrics") or {}
                if r["workload"] == w and m.get(key) is not None and m.get("completed", 0) > 0:
                    by[r["variant"]].setdefault(r["round"], []).append(m[key])
            base = by[names[0]]
            for n in names:
                vals = [x for xs in by[n].values() for x in xs]
                if not vals:
                    continue
                cell = {"mean": sum(vals) / len(vals), "min": min(vals), "max": max(vals)}
                bvals = [x for xs in base.values() for x in xs]
                if n != names[0] and bvals and sum(bvals) > 0:
                    cell["ratio"] = cell["mean"] / (sum(bvals) / len(bvals))
                    paired = [
                        (sum(by[n][r]) / len(by[n][r])) / (sum(base[r]) / len(base[r]))
                        for r in sorted(by[n])
                        if r in base and sum(base[r]) > 0
                    ]
                    cell["paired"] = paired
                out.setdefault(w, {}).setdefault(n, {})[key] = cell
    return out


def format_summary(summary: dict, names: list[str]) -> str:
    lines = []
    for w, per in summary.items():
        lines.append(f"{w}:")
        for n in names:
            if n not in per:
                continue
            cells = []
            for key, label, _ in METRICS:
                c = per[n].get(key)
                if not c:
                    continue
                nd = 0 if key == "output_throughput" else 1
                txt = f"{label} {c['mean']:.{nd}f} ({c['min']:.{nd}f}-{c['max']:.{nd}f})"
                if "ratio" in c:
                    pr = c["paired"]
                    txt += f" {c['ratio']:.3f}x"
                    if pr:
                        txt += f" [rounds {min(pr):.3f}-{max(pr):.3f}]"
                cells.append(txt)
            lines.append(f"  {n:<12} " + " | ".join(cells))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default="0x1", help="PxD: prefill and decode workers (0x1)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seeds", type=int, default=2, help="runs per workload per cluster")
    p.add_argument("--seed-base", type=int, default=900)
    p.add_argument(
        "--workloads",
        default="prefixrep1024",
        help="comma-separated names from bench/compare_vllm.py's suite: "
        + ", ".join(w.name for w in WORKLOADS),
    )
    p.add_argument(
        "--variant",
        nargs=2,
        action="append",
        metavar=("NAME", "JSON"),
        required=True,
        help='a name and {"env": {...}, "args": [...]}; at least two; the first is the baseline',
    )
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--tag", default="ab")
    p.add_argument("--max-load", type=float, default=1.0)
    p.add_argument("--load-wait", type=float, default=120.0, help="s to wait for a quiet host")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    a = p.parse_args(argv)
    try:
        a.topo = tuple(int(x) for x in a.topology.lower().split("x"))
    except ValueError:
        a.topo = ()
    if len(a.topo) != 2 or a.topo[0] < 0 or a.topo[1] < 1:
        p.error("--topology is PxD with D >= 1, e.g. 0x1 (colocated) or 1x1")
    names = [n for n, _ in a.variant]
    if len(names) < 2 or len(set(names)) != len(names):
        p.error("--variant: at least two, with distinct names")
    a.variants = {n: parse_variant(n, s) for n, s in a.variant}
    known = {w.name: w for w in WORKLOADS}
    a.wl = []
    for name in a.workloads.split(","):
        if name not in known:
            p.error(f"--workloads: unknown {name!r}; known: {', '.join(known)}")
        a.wl.append(known[name])
    return a


def main(argv: list[str] | None = None) -> int:
    with sigterm_as_exit():  # a killed A/B still stops the cluster it started
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    a = parse_args(argv)
    model = str(ensure_model(a.model_dir))
    names = list(a.variants)
    raw = RAW / f"ab_{a.tag}"
    runs: list[dict] = []
    rec = {"tag": a.tag, "topology": a.topology, "variants": a.variants, "code": code_version()}
    out = RESULTS / f"ab_{a.tag}.json"
    for r in range(a.rounds):
        for n in round_order(names, r):
            v = a.variants[n]
            label = f"{n}_r{r}"
            server = PdserveServer(
                model,
                free_port(),
                raw / f"{label}.log",
                raw / label,
                prefill=a.topo[0],
                decode=a.topo[1],
                extra=v["args"],
            )
            server.env_extra = dict(v["env"])
            wait_quiet(a.max_load, a.load_wait, f"round {r} {n}")
            server.start(a.startup_timeout)
            try:
                warmup(server, model, raw, label)
                for wi, w in enumerate(a.wl):
                    for s in range(a.seeds):
                        seed = run_seed(a.seed_base, wi, r, s, a.seeds)
                        res = vllm_bench(
                            server.base_url,
                            model,
                            list(w.args),
                            seed,
                            raw,
                            f"{label}_{w.name}_s{seed}",
                        )
                        res.update(variant=n, round=r, workload=w.name)
                        runs.append(res)
                        m = res.get("metrics") or {}
                        print(
                            f"[ab] round {r} {n:<10} {w.name:<14} seed {seed}: "
                            + "  ".join(
                                f"{lab} {m.get(k, float('nan')):.1f}" for k, lab, _ in METRICS
                            )
                            + f"  load {loadavg()[0]:.2f}"
                            + (f"  ERROR {res['error'][:200]}" if "error" in res else ""),
                            flush=True,
                        )
            finally:
                server.stop()
            rec["runs"] = runs
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(rec, indent=1))
    rec["summary"] = summarize(runs, names)
    rec["ended"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    out.write_text(json.dumps(rec, indent=1))
    print(format_summary(rec["summary"], names))
    print(f"[ab] wrote {out}")
    failed = [r for r in runs if "error" in r or (r.get("metrics") or {}).get("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
