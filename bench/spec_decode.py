"""Speculative decoding against none, same cluster shape, same client, one run.

For each variant (no speculation, n-gram, draft model) starts ``pdserve up`` on the ``small``
test model (1 prefill + 1 decode, as bench/compare_vllm.py), then runs ``pdserve bench`` at
concurrency 1, 4 and 32 on two workloads: ``echo`` (greedy continuations that repeat text
already in the context: each prompt is a random prefix followed by the model's own greedy
continuation of it, twice, so the text to produce is in the prompt, as in code editing or RAG)
and ``random`` (the suite's random 256 -> 64). Prints TPOT p50, ITL p50 / p99, output tok/s and
the acceptance rate from the decode worker's ``pdserve:spec_decode_*`` counters.

    python bench/spec_decode.py [--model DIR] [--num-prompts 32] [--plot docs/img/spec_decode.png]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.compare_vllm import DEFAULT_MODEL_DIR, PdserveServer, wait_quiet

ROOT = Path(__file__).resolve().parent.parent


def make_echo_model(src: Path, dst: Path) -> Path:
    """``src`` with every attention and MLP output projection zeroed: the residual stream is
    the token's embedding, so the next token is a fixed function of the current one (a bigram
    model at the small model's full per-token cost). Its greedy continuation of text that is
    already in the context repeats that text: the case speculation is for (a random-weight
    model never repeats, so it would accept no n-gram draft)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, dst / f.name)
    w = load_file(str(src / "model.safetensors"))
    for k in w:
        if k.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            w[k] = torch.zeros_like(w[k])
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def echo_prompts(model: str, n: int, seed: int, prefix: int, cont: int) -> list[list[int]]:
    """Prompts whose greedy continuation repeats text in them (made with the engine offline)."""
    from shared.engine import LLM
    from shared.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    llm = LLM(model, kv_cache_memory="512MiB")
    heads = [[rng.randrange(100, 30000) for _ in range(prefix)] for _ in range(n)]
    sp = SamplingParams(temperature=0, max_tokens=cont, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": h} for h in heads], sp)
    prompts = []
    for h, o in zip(heads, outs):
        c = list(o.outputs[0].token_ids)
        prompts.append(h + c + h)  # after the second prefix, the continuation is in context
    del llm
    return prompts


def spec_counters(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("pdserve:spec_decode_") and "per_pos" not in s.name:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def run_bench(url: str, model: str, concurrency: int, n: int, seed: int, out: Path) -> dict:
    """The suite's random 256 -> 64 workload through ``pdserve bench``."""
    exe = ROOT / ".venv" / "bin" / "pdserve"
    cmd = [str(exe) if exe.exists() else "pdserve", "bench", "--base-url", url, "--model", model]
    cmd += ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "64"]
    cmd += [
        "--num-prompts", str(n), "--max-concurrency", str(concurrency), "--request-rate", "inf",
        "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--disable-tqdm",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    m = json.loads(out.read_text())["metrics"]
    return {
        "tpot_p50": m["tpot"]["p50"],
        "itl_p50": m["itl"]["p50"],
        "itl_p99": m["itl"]["p99"],
        "tok_s": m["output_throughput"],
        "failed": m["failed"],
    }


def run_token_prompts(
    url: str, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> dict:
    """Stream completions for token-id prompts at a fixed concurrency; TPOT and ITL as
    ``vllm bench serve`` defines them."""
    import asyncio
    import time

    import aiohttp
    import numpy as np

    async def one(session, prompt, itls, tpots, count):
        body = {
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True,
        }  # fmt: skip
        t0 = time.perf_counter()
        times = []
        async with session.post(f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.content:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                        times.append(time.perf_counter())
        if len(times) > 1:
            itls.extend(np.diff(times).tolist())
            tpots.append((times[-1] - times[0]) / (max_tokens - 1))
        count.append(max_tokens)
        del t0

    async def main():
        itls: list[float] = []
        tpots: list[float] = []
        count: list[int] = []
        sem = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession() as session:

            async def guarded(p):
                async with sem:
                    await one(session, p, itls, tpots, count)

            t0 = time.perf_counter()
            await asyncio.gather(*(guarded(p) for p in prompts))
            dur = time.perf_counter() - t0
        return itls, tpots, sum(count) / dur

    itls, tpots, tok_s = asyncio.run(main())
    return {
        "tpot_p50": 1e3 * float(np.median(tpots)),
        "itl_p50": 1e3 * float(np.median(itls)),
        "itl_p99": 1e3 * float(np.percentile(itls, 99)),
        "tok_s": tok_s,
        "failed": 0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency", default="1,4,32")
    ap.add_argument("--port", type=int, default=8400)
    ap.add_argument("--work", default="/tmp/pdserve-spec-bench")
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    from shared.cli.tiny_model import make_tiny_model, truncate_layers

    model = Path(args.model)
    if not (model / "model.safetensors").exists():
        make_tiny_model(model, preset="small")
    work = Path(args.work)
    echo_model = work / "small-echo"
    if not (echo_model / "model.safetensors").exists():
        make_echo_model(model, echo_model)
    drafts = {}
    for name, m in (("echo", echo_model), ("random", model)):
        drafts[name] = work / f"{name}-draft-1layer"
        if not (drafts[name] / "model.safetensors").exists():
            truncate_layers(m, drafts[name], 1)
    print("[spec] making the echo prompts", flush=True)
    echo = echo_prompts(str(echo_model), args.num_prompts, 7, 64, 96)
    conc = [int(c) for c in args.concurrency.split(",")]
    rows = []
    for workload, m in (("echo", echo_model), ("random", model)):
        variants = {
            "none": [],
            "ngram": ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4, "disable_by_batch_size": 16})],
            "draft": ["--speculative-config", json.dumps({"method": "draft_model", "model": str(drafts[workload]), "num_speculative_tokens": 3, "disable_by_batch_size": 16})],
        }  # fmt: skip
        for name, extra in variants.items():
            wait_quiet(1.5, 120, name)
            run = work / f"{workload}-{name}"
            run.mkdir(parents=True, exist_ok=True)
            server = PdserveServer(str(m), args.port, run / "server.log", run / "run", extra=extra)
            server.start(600)
            try:
                metrics_url = server.metrics_urls().get("decode-0")
                for c in conc:
                    before = spec_counters(metrics_url) if metrics_url else {}
                    if workload == "echo":
                        r = run_token_prompts(server.base_url, echo, c, 96)
                    else:
                        r = run_bench(
                            server.base_url, str(m), c, args.num_prompts, 100, run / f"{c}.json"
                        )
                    after = spec_counters(metrics_url) if metrics_url else {}
                    key_d = "pdserve:spec_decode_num_draft_tokens_total"
                    key_a = "pdserve:spec_decode_num_accepted_tokens_total"
                    drafted = after.get(key_d, 0) - before.get(key_d, 0)
                    acc = after.get(key_a, 0) - before.get(key_a, 0)
                    r.update(
                        variant=name,
                        workload=workload,
                        concurrency=c,
                        acceptance=(acc / drafted) if drafted else None,
                    )
                    rows.append(r)
                    print(
                        f"[spec] {name} {workload} c={c}: TPOT p50 {r['tpot_p50']:.1f} ms, ITL p50/p99 {r['itl_p50']:.1f}/{r['itl_p99']:.1f} ms, {r['tok_s']:.0f} tok/s, acceptance {r['acceptance']}",
                        flush=True,
                    )
            finally:
                server.stop()
    print(
        "\n| workload | concurrency | variant | TPOT p50 ms (x none) | ITL p50 / p99 ms | output tok/s (x none) | acceptance |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        base = next(
            b
            for b in rows
            if b["variant"] == "none"
            and b["workload"] == r["workload"]
            and b["concurrency"] == r["concurrency"]
        )
        acc = "–" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f} %"
        print(
            f"| {r['workload']} | {r['concurrency']} | {r['variant']} | {r['tpot_p50']:.1f} ({r['tpot_p50'] / base['tpot_p50']:.2f}x) | {r['itl_p50']:.1f} / {r['itl_p99']:.1f} | {r['tok_s']:.0f} ({r['tok_s'] / base['tok_s']:.2f}x) | {acc} |"
        )
    (work / "results.json").write_text(json.dumps(rows, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for ax, workload in zip(axes, ("echo", "random")):
            for name in ("none", "ngram", "draft"):
                pts = [r for r in rows if r["variant"] == name and r["workload"] == workload]
                ax.plot(
                    [r["concurrency"] for r in pts],
                    [r["tpot_p50"] for r in pts],
                    marker="o",
                    label=name,
                )
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_ylabel("TPOT p50 (ms)")
            ax.set_title(workload)
            ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
