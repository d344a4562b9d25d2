"""Decode-step time of the engine at given batch sizes for each linear-layer path, interleaved in
one run, with the weight bandwidth each achieves against the machine's measured memory
bandwidth.

Paths: ``plain`` (``F.linear`` on the plain weight), ``small`` (the C++ AVX512-BF16 small-batch
kernel for steps of at most 16 rows, ``F.linear`` above: the default before prepacking),
``onednn`` (weights reordered once at load, ``kernels/cpu_linear.py``), each with torch's
element-wise ops; ``fused`` (``onednn`` with the C++ RMSNorm / residual, RoPE and SiLU x mul:
the default on a CPU with AVX512-BF16 before ``onecall``); ``onecall`` (``fused`` with a decode
step's decoder layers in one C++ call, ``kernels/cpu_paged.py::decode_layers``, the
projections on oneDNN: ``PDSERVE_CPU_LINEAR=onednn``; every other path runs with
``--enforce-eager``); ``amx_onecall`` (the one call with the projections on the AMX walk, the
``amx`` plan: the default on a CPU with AMX tiles); ``avx2`` (the AVX2 + FMA kernel on the plain
weights for every row count, with the C++ element-wise ops, layer by layer); ``avx2_onecall``
(``avx2`` with the decoder layers in one C++ call: the default on a CPU whose oneDNN has no
bf16). Each measurement builds a fresh engine, admits ``B``
prompts of ``--prompt-len`` random tokens, runs until all are decoding, then times ``--steps``
engine steps (one token per sequence each). With ``--shared-prefix N --prefix-groups P``
prompt ``i`` is the ``N``-token prefix of group ``i % P`` and its own random tokens after it
(vLLM's ``prefix_repetition`` workload): prefix caching hands each group's sequences the same
blocks.

    python bench/decode_step.py --model DIR [--batches 1,16,64] [--threads 1] [--rounds 2]
        [--paths plain,small,onednn,fused,onecall] [--baseline-source FILE] [--profile STEPS]
        [--prompt-len 1088 --shared-prefix 1024 --prefix-groups 4]

``--baseline-source FILE`` adds the path ``base``: ``onecall`` (the default step; ``fused``
before 2026-12-03) with the C++ extension built from
FILE instead of ``kernels/csrc/cpu_paged.cpp`` (``avx2_base``: ``avx2_onecall`` with it, for a CPU
whose oneDNN has no bf16) (e.g. ``git show REV:kernels/csrc/cpu_paged.cpp
> FILE``), interleaved with the others in the same process, for a kernel's before / after.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import cpp_build, cpu_linear, cpu_paged, reference
from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams
from shared.models.quantization import weight_bytes


def time_decode_steps(
    engine,
    batch: int,
    prompt_len: int,
    steps: int,
    max_token: int = 1000,
    profile: int = 0,
    shared_prefix: int = 0,
    groups: int = 1,
) -> float:
    """ms per engine step once ``batch`` random prompts (ids in [100, max_token)) all decode.

    ``profile`` > 0: then that many more steps under torch's profiler, whose table (torch ops
    by input shape) is printed with the steps' wall time; what the ops do not cover is the
    C++ kernels called through pybind (decode attention, ``write_kv``, the fused ops) and
    Python."""
    rng = random.Random(batch)
    prefixes = [
        [rng.randrange(100, max_token) for _ in range(shared_prefix)] for _ in range(groups)
    ]
    for i in range(batch):
        own = [rng.randrange(100, max_token) for _ in range(prompt_len - shared_prefix)]
        engine.add_request(
            f"r{i}",
            prefixes[i % groups] + own,
            # room for the steps a chunked prefill of the batch takes, during which the first
            # prompts already decode: no sequence finishes inside the timed (or profiled) steps
            SamplingParams(
                temperature=0,
                max_tokens=steps + profile + 8 + batch * prompt_len // 128,
                ignore_eos=True,
            ),
        )
    for _ in range(4):  # prefill, then a few warm decode steps
        engine.step()
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    ms = (time.perf_counter() - t0) / steps * 1e3
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            t0 = time.perf_counter()
            for _ in range(profile):
                engine.step()
            wall = (time.perf_counter() - t0) / profile * 1e3
        ops = prof.key_averages(group_by_input_shape=True)
        in_ops = sum(e.self_cpu_time_total for e in ops) / profile / 1e3
        print(
            f"profile, batch {batch}: {profile} steps, {wall:.2f} ms/step wall, {in_ops:.2f} in torch ops"
        )
        print(ops.table(sort_by="self_cpu_time_total", row_limit=12))
    return ms


PATHS = (
    "plain",
    "small",
    "onednn",
    "fused",
    "onecall",
    "base",
    "head_onednn",
    "avx2",
    "avx2_onecall",
    "avx2_base",
    "amx_onecall",
)
BASE_PATHS = ("base", "avx2_base")  # the paths that run the --baseline-source build
_baseline_ext = None  # the extension built from --baseline-source (BASE_PATHS)
FUSED = ("rms_norm", "rope", "silu_mul")  # the backend ops the model takes when present
OLDER = {"write_kv": reference.write_kv}  # C++ ops added later, and what the model did before


def step_ms(
    model: str,
    batch: int,
    prompt_len: int,
    steps: int,
    path: str,
    profile: int = 0,
    shared_prefix: int = 0,
    groups: int = 1,
) -> tuple[float, int]:
    """(ms per decode step, weight bytes a step reads) for linear path ``path``."""
    cpu_paged._load()
    saved = {name: getattr(cpu_paged, name) for name in ("_SMALL_M", "_ext", *FUSED, *OLDER)}
    if path == "plain":
        cpu_paged._SMALL_M = 0
    if path in BASE_PATHS:
        cpu_paged._ext = _baseline_ext
        for name, fallback in OLDER.items():  # an op the baseline's build lacks: what it did
            if not hasattr(_baseline_ext, name):
                setattr(cpu_paged, name, fallback)
    # the default step, and its before-variants
    one_call = ("onecall", "base", "head_onednn", "avx2_onecall", "avx2_base", "amx_onecall")
    if path not in ("fused", "avx2", *one_call):
        for name in FUSED:
            setattr(cpu_paged, name, None)
    os.environ[cpu_linear.PATH_ENV] = (
        "amx"
        if path == "amx_onecall"
        else "onednn"
        if path in ("onednn", "fused", "onecall", "base", "head_onednn")
        else "avx2"
        if path in ("avx2", "avx2_onecall", "avx2_base")
        else "torch"
    )
    # head_onednn: onecall with the LM head on oneDNN's logits + argmax_rows (before the AMX
    # head); base: the baseline build has no AMX head either
    os.environ[cpu_linear.HEAD_ENV] = "onednn" if path in ("head_onednn", "base") else "auto"
    try:
        # every path but the one-call ones runs the layers one by one in Python (--enforce-eager)
        eager = path not in one_call
        engine = LLM(model, kv_cache_memory="512MiB", enforce_eager=eager).engine
        ms = time_decode_steps(
            engine,
            batch,
            prompt_len,
            steps,
            profile=profile,
            shared_prefix=shared_prefix,
            groups=groups,
        )
        return ms, weight_bytes(engine.runner.model)
    finally:
        for name, value in saved.items():
            setattr(cpu_paged, name, value)
        os.environ.pop(cpu_linear.PATH_ENV, None)
        os.environ.pop(cpu_linear.HEAD_ENV, None)


def memory_bandwidth_gbs(mib: int = 512, rounds: int = 5) -> float:
    """GB/s of a large tensor copy (bytes read + written) on the current thread count."""
    src = torch.ones(mib << 18)  # fp32: mib MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--paths", default=",".join(PATHS[:5]), help=f"comma-separated of {PATHS}")
    ap.add_argument("--baseline-source", default=None, help="cpu_paged.cpp of the path 'base'")
    ap.add_argument(
        "--profile", type=int, default=0, help="in the last round, profile this many more steps"
    )
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens of a group's prefix")
    ap.add_argument("--prefix-groups", type=int, default=1, help="distinct shared prefixes")
    args = ap.parse_args()
    if not 0 <= args.shared_prefix < args.prompt_len or args.prefix_groups < 1:
        ap.error("need 0 <= --shared-prefix < --prompt-len and --prefix-groups >= 1")
    paths = args.paths.split(",")
    if unknown := set(paths) - set(PATHS):
        ap.error(f"unknown paths {sorted(unknown)}")
    if any(p in BASE_PATHS for p in paths) != (args.baseline_source is not None):
        ap.error("the paths 'base' / 'avx2_base' and --baseline-source go together")
    if args.baseline_source:
        global _baseline_ext
        src = Path(args.baseline_source).resolve()
        _baseline_ext = cpp_build.build("pdserve_cpu_paged_base", src, cpu_paged._FLAGS)
    torch.set_num_threads(args.threads)
    os.environ["PDSERVE_NUM_THREADS"] = str(args.threads)
    bw = memory_bandwidth_gbs()
    feats = cpu_linear.CpuFeatures.detect()
    print(f"CPU: {feats.describe()}; {args.threads} thread(s); memory bandwidth {bw:.1f} GB/s")
    if args.shared_prefix:
        print(
            f"prompts of {args.prompt_len} tokens, the first {args.shared_prefix} shared in "
            f"{args.prefix_groups} group(s)"
        )
    print(f"auto plan for bf16: {cpu_linear.plan_for(torch.bfloat16, torch.device('cpu')).reason}")
    head = " | ".join(f"{p} ms/step (weights GB/s, % of memory)" for p in paths)
    ratio = " | ".join(f"{p} / {paths[0]}" for p in paths[1:])
    print(f"| batch | {head} | {ratio} |")
    print("|---:|" + "---:|" * (2 * len(paths) - 1))
    for b in (int(x) for x in args.batches.split(",")):
        times: dict[str, list[float]] = {p: [] for p in paths}
        nbytes: dict[str, int] = {}
        for r in range(args.rounds):
            for p in paths:
                print(f"[decode_step] batch {b} round {r + 1}/{args.rounds} {p}", file=sys.stderr)
                prof = args.profile if r == args.rounds - 1 else 0
                ms, nbytes[p] = step_ms(
                    args.model,
                    b,
                    args.prompt_len,
                    args.steps,
                    p,
                    prof,
                    args.shared_prefix,
                    args.prefix_groups,
                )
                times[p].append(ms)
        med = {p: statistics.median(t) for p, t in times.items()}
        cells = []
        for p in paths:
            gbs = nbytes[p] / (med[p] / 1e3) / 1e9
            cells.append(f"{med[p]:.2f} ({gbs:.1f}, {100 * gbs / bw:.0f} %)")
        ratios = [f"{med[p] / med[paths[0]]:.2f}" for p in paths[1:]]
        print(f"| {b} | " + " | ".join(cells + ratios) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
