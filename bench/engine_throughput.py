"""Engine throughput versus ``transformers`` static batching, in one run on one model.

Workload: a ShareGPT-like mixed-length set (prompt lengths log-normal, clipped to 16..1024;
output lengths log-normal, clipped to 8..256; fixed seed), every request greedy with EOS
ignored so both systems generate exactly the same number of tokens.

* pdserve: all requests submitted at once to ``LLM.generate`` (continuous batching, paged KV).
* transformers: ``model.generate`` on static batches of ``--hf-batch`` requests in arrival
  order, left-padded, each batch running until its longest request is done (the classic
  static-batching baseline; only each request's own tokens count as output).

Also reports KV utilization (tokens held / token slots allocated, mean over engine steps) and
decode step time at batch 1/16/64 for both systems. Prints a table and writes JSON (+ a PNG).

    python bench/engine_throughput.py --model DIR [--num-prompts 128] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams


def sharegpt_like(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs. Log-normal lengths: prompt median ~180 (sigma 1.0),
    output median ~90 (sigma 0.8), clipped to [16, 1024] and [8, 256]."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = int(min(1024, max(16, rng.lognormvariate(math.log(180), 1.0))))
        o = int(min(256, max(8, rng.lognormvariate(math.log(90), 0.8))))
        out.append(([rng.randrange(3, vocab) for _ in range(p)], o))
    return out


def run_pdserve(llm: LLM, work) -> dict:
    engine = llm.engine
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
    utils = []
    original_step = engine.step

    def step():
        outs = original_step()
        s = engine.stats()
        if s.kv_utilization > 0:
            utils.append(s.kv_utilization)
        return outs

    engine.step = step
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    engine.step = original_step
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "seconds": dt,
        "output_tokens": n_out,
        "output_tok_s": n_out / dt,
        "kv_utilization_mean": statistics.fmean(utils) if utils else 0.0,
        "kv_utilization_min": min(utils) if utils else 0.0,
        "steps": len(utils),
    }


def run_hf(model, work, batch: int) -> dict:
    t0 = time.perf_counter()
    n_out = 0
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for j, (p, _) in enumerate(chunk):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        longest = max(o for _, o in chunk)
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
            )
        n_out += sum(o for _, o in chunk)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt}


def decode_step_ms(
    llm: LLM, model, batch: int, ctx: int = 128, steps: int = 32
) -> tuple[float, float]:
    rng = random.Random(batch)
    prompts = [[rng.randrange(3, 1000) for _ in range(ctx)] for _ in range(batch)]
    # pdserve: time per engine step once every sequence is decoding.
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(
            f"step{batch}-{i}",
            p,
            SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True),
        )
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    ours = (time.perf_counter() - t0) / steps * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    # transformers: one forward of `batch` new tokens against a `ctx`-long KV cache.
    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        hf = (time.perf_counter() - t0) / steps * 1e3
    return ours, hf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="bench/results/engine_throughput.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["PDSERVE_NUM_THREADS"] = str(args.threads)
    from transformers import AutoModelForCausalLM

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=256,
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
    )
    dtype = getattr(torch, llm.engine.model_config.dtype)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    work = sharegpt_like(args.num_prompts, args.seed, llm.engine.model_config.vocab_size)
    print(
        f"[bench] {len(work)} requests, prompt tokens {sum(len(p) for p, _ in work)}, "
        f"output tokens {sum(o for _, o in work)}, dtype {llm.engine.model_config.dtype}, "
        f"torch threads {torch.get_num_threads()}",
        flush=True,
    )
    run_pdserve(llm, work[:8])  # warm-up
    print("[bench] pdserve ...", flush=True)
    ours = run_pdserve(llm, work)
    print(
        f"[bench]   {ours['output_tok_s']:.0f} output tok/s in {ours['seconds']:.1f}s", flush=True
    )
    print(f"[bench] transformers static batches of {args.hf_batch} ...", flush=True)
    theirs = run_hf(hf, work, args.hf_batch)
    print(
        f"[bench]   {theirs['output_tok_s']:.0f} output tok/s in {theirs['seconds']:.1f}s",
        flush=True,
    )
    steps = {}
    for b in (1, 16, 64):
        o, h = decode_step_ms(llm, hf, b)
        steps[b] = {"pdserve_ms": o, "transformers_ms": h}
        print(
            f"[bench] decode step batch {b:>2}: pdserve {o:.2f} ms, transformers {h:.2f} ms",
            flush=True,
        )
    ratio = ours["output_tok_s"] / theirs["output_tok_s"]
    print("\n| system | output tok/s | seconds | KV utilization |")
    print("|---|---|---|---|")
    print(
        f"| pdserve (continuous batching) | {ours['output_tok_s']:.0f} | {ours['seconds']:.1f} | "
        f"{ours['kv_utilization_mean']:.1%} (min {ours['kv_utilization_min']:.1%}) |"
    )
    print(
        f"| transformers (static batch {args.hf_batch}) | {theirs['output_tok_s']:.0f} | "
        f"{theirs['seconds']:.1f} | - |"
    )
    print(f"\nthroughput ratio pdserve / transformers: {ratio:.2f}x")
    print("\n| decode batch | pdserve ms/step | transformers ms/step | ratio |")
    print("|---|---|---|---|")
    for b, v in steps.items():
        print(
            f"| {b} | {v['pdserve_ms']:.2f} | {v['transformers_ms']:.2f} | "
            f"{v['transformers_ms'] / v['pdserve_ms']:.2f}x |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "pdserve": ours,
                "transformers": theirs,
                "ratio": ratio,
                "decode_steps": steps,
            },
            indent=2,
        )
    )
    _plot(out.with_suffix(".png"), ours, theirs, steps)
    print(f"\nwrote {out} and {out.with_suffix('.png')}")
    return 0


def _plot(path: Path, ours: dict, theirs: dict, steps: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(
        ["pdserve", "transformers\nstatic"],
        [ours["output_tok_s"], theirs["output_tok_s"]],
        color=["tab:blue", "tab:gray"],
    )
    a.set_ylabel("output tokens / s")
    a.set_title("mixed-length workload")
    xs = list(steps)
    b.plot(xs, [steps[x]["pdserve_ms"] for x in xs], "o-", label="pdserve")
    b.plot(xs, [steps[x]["transformers_ms"] for x in xs], "s-", label="transformers")
    b.set_xlabel("decode batch size")
    b.set_ylabel("ms / step")
    b.set_xscale("log", base=2)
    b.legend()
    b.set_title("decode step time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
