"""End-to-end phase of ``kernels/bench_gpu.py``: decode tokens/s of the ``small`` test model
through the engine, per attention backend and KV dtype. Prints one ``ROW {json}`` line per
measurement (the kernel script reads them).

    python -m bench.gpu_e2e --device cuda --batch 64 --prompt 128 --tokens 128
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from shared.cli.tiny_model import make_tiny_model
from shared.engine import LLM, SamplingParams


def emit(name: str, result: str) -> None:
    print("ROW " + json.dumps({"name": name, "result": result}), flush=True)


def run(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.deadline
    preset = "tiny" if args.dry_run else "small"
    batch, prompt_len, max_tokens = args.batch, args.prompt, args.tokens
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / preset, preset=preset)
        rng = random.Random(0)
        prompts = [[rng.randrange(10, 2000) for _ in range(prompt_len)] for _ in range(batch)]
        backends = [("triton", "auto"), ("triton", "fp8"), ("torch", "auto")]
        reference: list[list[int]] = []  # TP 1's greedy tokens (triton, auto) for the TP 2 row
        for backend, kv_dtype in backends:
            if deadline - time.monotonic() < 25:
                emit(f"{backend} kv={kv_dtype}", "skipped: deadline")
                continue
            t0 = time.monotonic()
            llm = LLM(
                str(model_dir),
                device=args.device,
                attention_backend=backend,
                kv_cache_dtype=kv_dtype,
                kv_cache_memory="1GiB" if args.dry_run else "8GiB",
                max_num_seqs=batch,
                enable_prefix_caching=False,
                seed=0,
            )

            def generate(n: int, llm=llm) -> float:
                sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                start = time.monotonic()
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
                assert all(len(o.outputs[0].token_ids) == n for o in outs)
                return time.monotonic() - start

            generate(2)  # warm-up: compiles kernels
            t_prefill = generate(1)  # prefill + first token
            t_full = generate(max_tokens)
            decode_tps = batch * (max_tokens - 1) / max(t_full - t_prefill, 1e-9)
            emit(
                f"{preset} model, {backend} kv={kv_dtype}",
                f"{decode_tps:,.0f} decode tok/s (batch {batch}, prompt {prompt_len}, "
                f"{max_tokens} tokens; {batch * max_tokens / t_full:,.0f} tok/s overall; "
                f"load+warm-up {time.monotonic() - t0 - t_full - t_prefill:.0f} s)",
            )
            if backend == "triton" and kv_dtype == "auto":
                reference = [
                    list(o.outputs[0].token_ids)
                    for o in llm.generate(
                        [{"prompt_token_ids": p} for p in prompts[:8]],
                        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                    )
                ]
            llm.engine.shutdown()
            del llm
        tp2(args, model_dir, prompts, reference, deadline)
    return 0


def tp2(args, model_dir, prompts, reference, deadline) -> None:
    """TP 2 when there are two GPUs (on a CPU dry run: two gloo ranks): decode tok/s and the
    first 8 prompts' greedy tokens against TP 1's."""
    import torch

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus < 2:
        emit("tp2", f"skipped: {gpus} GPU(s), TP 2 needs 2")
        return
    if deadline - time.monotonic() < 40:
        emit("tp2", "skipped: deadline")
        return
    t0 = time.monotonic()
    llm = LLM(
        str(model_dir),
        device=args.device,
        attention_backend="triton",
        kv_cache_memory="1GiB" if args.dry_run else "8GiB",
        max_num_seqs=len(prompts),
        enable_prefix_caching=False,
        seed=0,
        tensor_parallel_size=2,
    )
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        got = [
            list(o.outputs[0].token_ids)
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], sp)
        ]
        same = sum(a == b for a, b in zip(got, reference))
        n = args.tokens
        start = time.monotonic()
        llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
        )
        took = time.monotonic() - start
        emit(
            "tp2 (2 ranks), triton kv=auto",
            f"{len(prompts) * n / took:,.0f} tok/s overall (batch {len(prompts)}, {n} tokens); "
            f"greedy equal to TP 1 on {same}/{len(reference)} prompts; "
            f"load {start - t0:.0f} s",
        )
    finally:
        llm.engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--deadline", type=float, default=120.0)
    p.add_argument("--dry-run", action="store_true", help="the tiny model, interpreter sizes")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
