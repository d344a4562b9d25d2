"""Prepared GPU check and benchmark of the paged-KV kernels (finishes in about 5 minutes).

Run from the repository root on a CUDA machine::

    python kernels/bench_gpu.py                 # everything, deadline 240 s
    python kernels/bench_gpu.py --skip-e2e      # kernels only (torch + triton are enough)
    TRITON_INTERPRET=1 python kernels/bench_gpu.py --dry-run   # CPU interpreter, tiny sizes

Phases (each prints progress; later phases are skipped, and say so, when the deadline nears):

1. **Correctness**: every Triton kernel against the torch reference on the device: ``write_kv``
   (bit-exact, fp8 included), decode (heuristic and forced split-K), varlen prefill over mixed
   batches, across fp32/fp16/bf16/fp8 (per-tensor and per-head scales), head dims 32/64/128,
   block sizes 16/32, GQA ratios 1/4/8, contexts up to several thousand tokens, shuffled block
   tables, and a pool past 2**31 elements (int64 offsets).
2. **Decode bandwidth**: Llama-3-8B attention geometry (32 q heads, 8 kv heads, head dim 128,
   block 16), several batch sizes and context lengths, bf16 and fp8 KV. Bytes counted: K/V of
   every context token + queries + outputs + block tables; timed with CUDA graphs. Reported as
   GB/s and as a fraction of the device's peak DRAM bandwidth (spec sheet value by device name,
   else the driver's memory clock x bus width; ``--peak-gbps`` overrides).
3. **End to end**: decode tokens/s of the project's ``small`` test model through the engine
   with the Triton backend (and the torch backend for comparison), run by ``bench/gpu_e2e.py``
   in a child process (kernels import nothing from the project); skipped with a message when
   the engine cannot run. With two or more GPUs it also runs the engine with
   ``--tensor-parallel-size 2`` (NCCL): tok/s, and the greedy tokens of 8 prompts against TP 1.

Exit status 1 if any correctness check fails. Needs only torch and triton for phases 1-2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

# DRAM bandwidth from vendor spec sheets, GB/s (first substring match of the device name wins).
PEAK_GBPS = (
    ("GH200", 4000.0),
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("H800", 3350.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L40", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("A10", 600.0),
    ("RTX 4090", 1008.0),
    ("RTX 6000 Ada", 960.0),
)
TOLERANCES = {"float32": (1e-4, 1e-4), "float16": (2e-3, 2e-3), "bfloat16": (1.6e-2, 1.6e-2)}


@dataclass
class Row:
    """One line of the summary table; ``ok`` is None for measurements."""

    section: str
    name: str
    result: str
    ok: bool | None = None


@dataclass
class Ctx:
    torch: object
    ref: object
    tp: object
    device: str
    dry_run: bool
    deadline: float
    rows: list[Row] = field(default_factory=list)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def add(self, row: Row) -> None:
        self.rows.append(row)
        status = {True: "ok", False: "FAIL", None: ""}[row.ok]
        print(f"  [{row.section}] {row.name}: {row.result} {status}", flush=True)


def guarded(ctx: Ctx, section: str, name: str, fn, *args) -> None:
    """Run ``fn(*args)``; an exception becomes a failed row (with a short traceback)."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - report every failure, keep checking the rest
        traceback.print_exc(limit=4)
        ctx.add(Row(section, name, f"raised {type(e).__name__}: {str(e)[:200]}", False))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_problem(
    ctx: Ctx,
    seq_lens: list[int],
    q_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    dtype,
    kv_dtype,
    per_head: bool,
    seed: int,
) -> dict:
    """Context K/V written through the reference into shuffled blocks of a random pool."""
    torch, dev = ctx.torch, ctx.device
    from kernels import compute_kv_scales

    gen = torch.Generator().manual_seed(seed)
    nblk = [cdiv(s, bs) for s in seq_lens]
    num_blocks = sum(nblk) + 4
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.full((len(seq_lens), max(nblk) + 1), int(perm[-1]), dtype=torch.int32)
    pos = 0
    for s, n in enumerate(nblk):
        tables[s, :n] = perm[pos : pos + n]
        pos += n
    n_ctx = sum(seq_lens)
    key = torch.randn(n_ctx, hkv, d, generator=gen).to(dev)  # [Tctx, Hkv, D] fp32
    value = torch.randn(n_ctx, hkv, d, generator=gen).to(dev)
    slots = torch.cat(
        [
            tables[s, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
            for s, n in enumerate(seq_lens)
        ]
    ).to(dev)
    ks = vs = None
    pool = torch.randn(num_blocks, 2, 2, bs, hkv, d, generator=gen).to(dev)  # 2 layers of noise
    if kv_dtype == torch.float8_e4m3fn:
        ks, vs = compute_kv_scales(key, value, per_head=per_head)
        pool = pool.clamp(-400, 400).to(kv_dtype)
    else:
        pool = pool.to(kv_dtype)
        key, value = key.to(dtype), value.to(dtype)
    ctx.ref.write_kv(key, value, pool, 1, slots, ks, vs)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    return {
        "query": torch.randn(qsl[-1], hq, d, generator=gen).to(dtype).to(dev),  # [T, Hq, D]
        "kv_cache": pool,  # [NB, 2, 2, BS, Hkv, D], context in layer 1
        "block_tables": tables.to(dev),  # [S, max_blocks] int32
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=dev),  # [S]
        "query_start_loc": torch.tensor(qsl, dtype=torch.int32, device=dev),  # [S + 1]
        "scale": d**-0.5,
        "k_scale": ks,
        "v_scale": vs,
    }


def compare(ctx: Ctx, actual, expected, dtype) -> tuple[bool, str]:
    atol, rtol = TOLERANCES[str(dtype).replace("torch.", "")]
    a, e = actual.float(), expected.float()
    err = (a - e).abs()
    ok = bool(ctx.torch.isfinite(a).all()) and bool((err <= atol + rtol * e.abs()).all())
    return ok, f"max err {err.max().item():.2e} (atol {atol}, rtol {rtol})"


def check_kernels(ctx: Ctx) -> None:
    torch = ctx.torch
    fp8 = torch.float8_e4m3fn
    dtypes = [
        (torch.float32, torch.float32, False),
        (torch.float16, torch.float16, False),
        (torch.bfloat16, torch.bfloat16, False),
        (torch.bfloat16, fp8, False),
        (torch.float16, fp8, True),
    ]
    # (head_dim, block_size, q heads, kv heads): GQA 4, 8, 1
    geoms = [(32, 16, 8, 2)] if ctx.dry_run else [(128, 16, 32, 8), (64, 32, 8, 1), (32, 16, 4, 4)]
    long_ctx = 100 if ctx.dry_run else 5000
    decode_lens = [1, 17, 130, long_ctx]
    mixed = (
        [(24, 24), (70, 13), (33, 1), (20, 0)]
        if ctx.dry_run
        else [(2000, 2000), (3100, 100), (513, 1), (77, 77), (20, 0), (1, 1)]
    )
    for dtype, kv_dtype, per_head in dtypes:
        for d, bs, hq, hkv in geoms:
            if ctx.left() < 60:
                ctx.add(Row("check", "remaining kernel checks", "skipped: deadline", False))
                return
            tag = (
                f"{str(dtype)[6:]}/kv={str(kv_dtype)[6:]}{'/head' if per_head else ''} "
                f"D={d} BS={bs} GQA={hq // hkv}"
            )
            common = (ctx, tag, dtype, kv_dtype, per_head, d, bs, hq, hkv)
            guarded(ctx, "check", f"write_kv {tag}", _check_write, *common)
            guarded(ctx, "check", f"decode {tag}", _check_decode, *common, decode_lens)
            guarded(ctx, "check", f"prefill/mixed {tag}", _check_prefill, *common, mixed)


def _check_write(ctx: Ctx, tag: str, dtype, kv_dtype, per_head, d, bs, hq, hkv) -> None:
    torch = ctx.torch
    p = make_problem(ctx, [70], [70], hq, hkv, d, bs, dtype, kv_dtype, per_head, seed=d)
    k = torch.randn(70, hkv, d, device=ctx.device).to(dtype)  # [T, Hkv, D]
    slots = torch.randperm(p["kv_cache"].shape[0] * bs, device=ctx.device)[:70]
    a, e = p["kv_cache"].clone(), p["kv_cache"].clone()
    ctx.tp.write_kv(k, k * 0.5, a, 1, slots, p["k_scale"], p["v_scale"])
    ctx.ref.write_kv(k, k * 0.5, e, 1, slots, p["k_scale"], p["v_scale"])
    same = torch.equal(a.view(torch.uint8), e.view(torch.uint8))
    ctx.add(Row("check", f"write_kv {tag}", "bit-exact" if same else "differs", same))


def _check_decode(
    ctx: Ctx, tag: str, dtype, kv_dtype, per_head, d, bs, hq, hkv, lens: list[int]
) -> None:
    """Heuristic config through the public API, then a forced 8-way split-K."""
    from kernels.checks import check_pool
    from kernels.triton_decode import DecodeConfig, launch_decode

    p = make_problem(
        ctx, lens, [1] * len(lens), hq, hkv, d, bs, dtype, kv_dtype, per_head, seed=d + 1
    )
    args = (
        p["query"],
        p["kv_cache"],
        1,
        p["block_tables"],
        p["seq_lens"],
        p["scale"],
        p["k_scale"],
        p["v_scale"],
    )
    expected = ctx.ref.paged_decode_attention(*args)
    ok, msg = compare(ctx, ctx.tp.paged_decode_attention(*args), expected, dtype)
    ctx.add(Row("check", f"decode {tag}", msg, ok))
    split = launch_decode(
        *args,
        check_pool(p["kv_cache"], 1),
        per_head and hkv > 1,
        DecodeConfig(tile_n=64, num_splits=8),
        ctx.tp._emulate_bf16(dtype),
    )
    ok, msg = compare(ctx, split, expected, dtype)
    ctx.add(Row("check", f"decode split-K=8 {tag}", msg, ok))


def _check_prefill(
    ctx: Ctx, tag: str, dtype, kv_dtype, per_head, d, bs, hq, hkv, mixed: list[tuple[int, int]]
) -> None:
    """Full prompts, chunks after cached context, decode rows and idle sequences in one batch."""
    p = make_problem(
        ctx,
        [s for s, _ in mixed],
        [q for _, q in mixed],
        hq,
        hkv,
        d,
        bs,
        dtype,
        kv_dtype,
        per_head,
        seed=d + 2,
    )
    args = (
        p["query"],
        p["kv_cache"],
        1,
        p["block_tables"],
        p["seq_lens"],
        p["query_start_loc"],
        p["scale"],
        p["k_scale"],
        p["v_scale"],
    )
    ok, msg = compare(ctx, ctx.tp.paged_attention(*args), ctx.ref.paged_attention(*args), dtype)
    ctx.add(Row("check", f"prefill/mixed {tag}", msg, ok))


def check_large_pool(ctx: Ctx) -> None:
    """Blocks past 2**31 elements: offsets must be computed in int64."""
    torch, ref, tp = ctx.torch, ctx.ref, ctx.tp
    bs, hkv, d = 16, 1, 32
    nb = (1 << 31) // (2 * bs * hkv * d) + 64
    if ctx.device == "cuda" and torch.cuda.mem_get_info()[0] < nb * 2 * bs * hkv * d * 2 * 1.2:
        ctx.add(Row("check", "int64 offsets", "skipped: not enough free memory", None))
        return
    pool = torch.empty(nb, 1, 2, bs, hkv, d, dtype=torch.float16, device=ctx.device)
    tables = (nb - 1 - torch.randperm(16)).to(torch.int32).view(2, 8).to(ctx.device)
    lens = [120, 97]
    slots = torch.cat(
        [
            tables[s, torch.arange(n, device=ctx.device) // bs].long() * bs
            + torch.arange(n, device=ctx.device) % bs
            for s, n in enumerate(lens)
        ]
    )
    kv = torch.randn(sum(lens), hkv, d, device=ctx.device, dtype=torch.float16)
    tp.write_kv(kv, -kv, pool, 0, slots)
    written = torch.equal(pool[slots // bs, 0, 1, slots % bs], -kv)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=ctx.device)
    q = torch.randn(2, 4, d, device=ctx.device, dtype=torch.float16)
    args = (q, pool, 0, tables, seq_lens, d**-0.5)
    ok, msg = compare(
        ctx, tp.paged_decode_attention(*args), ref.paged_decode_attention(*args), torch.float16
    )
    ctx.add(
        Row(
            "check",
            f"int64 offsets ({pool.numel() / 2**31:.2f} x 2^31 elements)",
            f"write {'exact' if written else 'WRONG'}, decode {msg}",
            ok and written,
        )
    )
    del pool
    if ctx.device == "cuda":
        torch.cuda.empty_cache()


def peak_bandwidth(ctx: Ctx, override: float | None) -> tuple[float, str]:
    if override:
        return override, "--peak-gbps"
    if ctx.device != "cuda":
        return float("nan"), "n/a on CPU"
    name = ctx.torch.cuda.get_device_name()
    for key, gbps in PEAK_GBPS:
        if key in name:
            return gbps, f"spec sheet ({key})"
    import triton.testing

    return triton.testing.get_dram_gbps(), "driver memory clock x bus width"


def time_ms(ctx: Ctx, fn, graph: bool = True) -> tuple[float, str]:
    """Mean milliseconds per call of ``fn``: CUDA-graph replays (no host overhead) when
    ``graph``, else CUDA events around each call after an L2 flush (triton's do_bench)."""
    if ctx.device != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3, "wall clock (interpreter)"
    import triton.testing

    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=50), "CUDA graph"
        except Exception as e:  # noqa: BLE001 - capture can fail on some setups: use events
            print(f"    (CUDA graph timing failed: {type(e).__name__}: {e}; using events)")
    return triton.testing.do_bench(fn, warmup=10, rep=50), "CUDA events"


def _decode_problem(
    ctx: Ctx, batch: int, ctx_len: int, hq: int, hkv: int, d: int, bs: int, kv_dtype
) -> tuple:
    torch, dev = ctx.torch, ctx.device
    nb_seq = cdiv(ctx_len, bs)
    num_blocks = batch * nb_seq
    pool = torch.randn(num_blocks, 1, 2, bs, hkv, d, device=dev, dtype=torch.bfloat16).to(
        kv_dtype
    )  # [NB, 1, 2, BS, Hkv, D]
    tables = torch.randperm(num_blocks, device=dev).to(torch.int32).view(batch, nb_seq)
    seq_lens = torch.full((batch,), ctx_len, dtype=torch.int32, device=dev)
    q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)  # [S, Hq, D]
    scales = (None, None)
    if kv_dtype == torch.float8_e4m3fn:
        scales = (torch.ones(1, device=dev), torch.ones(1, device=dev))
    return (q, pool, 0, tables, seq_lens, d**-0.5, *scales)


def bench_decode(ctx: Ctx, peak: float) -> None:
    """Achieved DRAM bandwidth of the decode kernel. Small problems are replicated over
    independent pools (>= 512 MiB in all) and run round-robin so that L2 (50 MiB on H100/H200)
    cannot serve repeated reads."""
    torch, tp, ref = ctx.torch, ctx.tp, ctx.ref
    hq, hkv, d, bs = (32, 8, 128, 16) if not ctx.dry_run else (4, 2, 32, 16)
    configs = (
        [(1, 4096), (1, 32768), (16, 4096), (64, 2048), (64, 8192), (256, 1024), (256, 4096)]
        if not ctx.dry_run
        else [(2, 64)]
    )
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        elem = 1 if kv_dtype == torch.float8_e4m3fn else 2
        for batch, ctx_len in configs:
            if ctx.left() < 45:
                ctx.add(Row("decode-bw", "remaining configs", "skipped: deadline", None))
                return
            kv_bytes = batch * ctx_len * hkv * d * 2 * elem
            copies = 1 if ctx.dry_run else max(1, cdiv(512 << 20, kv_bytes))
            problems = [
                _decode_problem(ctx, batch, ctx_len, hq, hkv, d, bs, kv_dtype)
                for _ in range(copies)
            ]

            def run_all(problems=problems, fn=tp.paged_decode_attention):
                for args in problems:
                    fn(*args)

            ms, how = time_ms(ctx, run_all)
            ms /= copies
            q, tables = problems[0][0], problems[0][3]
            nbytes = kv_bytes + 2 * q.numel() * q.element_size() + tables.numel() * 4
            gbps = nbytes / ms / 1e6
            cfg = tp.decode_config(
                batch, hkv, tables.shape[1] * bs, d, tp._num_sms(torch.device(ctx.device))
            )
            extra = ""
            if kv_bytes <= (1 << 30) and ctx.device == "cuda":
                first = problems[0]
                ref_ms, _ = time_ms(
                    ctx, lambda first=first: ref.paged_decode_attention(*first), graph=False
                )  # the reference syncs: no graph capture
                extra = f"; torch reference {ref_ms * 1e3:.0f} us = {ref_ms / ms:.1f}x slower"
            ctx.add(
                Row(
                    "decode-bw",
                    f"{str(kv_dtype)[6:]} batch={batch} ctx={ctx_len}",
                    f"{ms * 1e3:.1f} us, {gbps:.0f} GB/s = {100 * gbps / peak:.0f}% of peak "
                    f"(splits={cfg.num_splits}, {how}, {copies} pool(s){extra})",
                )
            )
            del problems
    if ctx.device == "cuda":
        torch.cuda.empty_cache()


def bench_quant(ctx: Ctx, peak: float) -> None:
    """The quantized linears' Triton kernel (``kernels/triton_quant.py``): error against the
    fp32 dequantized weight, then time per call and weight bandwidth against bf16 ``F.linear``
    (cuBLAS) at decode batch sizes, weights replicated past L2."""
    torch = ctx.torch
    from kernels import quant

    dev = torch.device(ctx.device)
    shapes = [(4096, 4096), (11008, 4096)] if not ctx.dry_run else [(64, 128)]
    batches = [1, 16, 64] if not ctx.dry_run else [1, 17]
    for n, k in shapes:
        w = torch.randn(n, k) * 0.02
        schemes = {
            "int8": quant.quantize_int8_per_channel(w),
            "w4g128": quant.quantize_rtn(w, 4, 128 if k >= 128 else 32, True),
            "fp8": quant.quantize_fp8_per_channel(w),
        }
        dense = w.to(dev, torch.bfloat16)
        copies = 1 if ctx.dry_run else max(1, cdiv(512 << 20, n * k * 2))
        denses = [dense.clone() for _ in range(copies)]
        for m in batches:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            if ctx.left() < 30:
                ctx.add(Row("quant", "remaining shapes", "skipped: deadline", None))
                return
            d_ms, _ = time_ms(
                ctx, lambda x=x, ds=denses: [torch.nn.functional.linear(x, d) for d in ds]
            )
            d_ms /= copies
            for name, qw in schemes.items():
                pw = quant.prepare(qw, dev, torch.bfloat16)
                ok = pw.path.startswith("triton") or ctx.device != "cuda"
                if isinstance(qw, quant.Fp8Weight) and not pw.path.startswith("triton"):
                    pw = quant.PreparedWeight(
                        "triton-fp8", n, k, torch.bfloat16, dict(pw.tensors), None, 1 << 62,
                        None, 8, k,
                    )  # fmt: skip
                elif not pw.path.startswith("triton"):  # dry run on the CPU: call the kernel
                    from kernels import triton_quant

                    pw = quant.PreparedWeight(
                        f"triton-w{qw.bits}", n, k, torch.bfloat16,
                        triton_quant.prepare(qw, dev), None, 1 << 62, None, qw.bits,
                        qw.group_size,
                    )  # fmt: skip
                y = quant.quant_linear(x, pw, None).float()
                ref = x.float() @ qw.dequantize().to(dev).t()
                err = float((y - ref).abs().max() / ref.abs().max())
                ok = ok and err < 2e-2
                pws = [pw] + [
                    quant.PreparedWeight(
                        pw.path,
                        n,
                        k,
                        pw.dtype,
                        {kk: v.clone() for kk, v in pw.tensors.items()},
                        None,
                        pw.small_m,
                        None,
                        pw.bits,
                        pw.group_size,
                    )  # fmt: skip
                    for _ in range(copies - 1)
                ]
                q_ms, how = time_ms(
                    ctx, lambda x=x, pws=pws: [quant.quant_linear(x, p, None) for p in pws]
                )
                q_ms /= copies
                gbps = pw.nbytes / q_ms / 1e6
                ctx.add(
                    Row(
                        "quant",
                        f"{name} {n}x{k} M={m}",
                        f"rel err {err:.1e}; {q_ms * 1e3:.1f} us vs bf16 {d_ms * 1e3:.1f} us "
                        f"({q_ms / d_ms:.2f}x), weights {gbps:.0f} GB/s = "
                        f"{100 * gbps / peak:.0f}% of peak ({how})",
                        ok,
                    )
                )
        del denses
    if ctx.device == "cuda":
        torch.cuda.empty_cache()


def bench_e2e(ctx: Ctx, batch: int, prompt_len: int, max_tokens: int) -> None:
    """Phase 3 runs ``bench/gpu_e2e.py`` in a child process: kernels import nothing from the
    project (the engine lives in ``shared``), so the end-to-end part is the bench's."""
    import json
    import subprocess

    root = Path(__file__).resolve().parent.parent
    cmd = [
        sys.executable,
        "-m",
        "bench.gpu_e2e",
        "--device",
        ctx.device,
        "--batch",
        str(batch),
        "--prompt",
        str(prompt_len),
        "--tokens",
        str(max_tokens),
        "--deadline",
        str(max(1.0, ctx.left() - 5)),
    ]
    if ctx.dry_run:
        cmd.append("--dry-run")
    try:
        proc = subprocess.run(
            cmd,
            cwd=root,
            capture_output=True,
            text=True,
            check=False,
            timeout=max(10.0, ctx.left()),
        )
    except subprocess.TimeoutExpired:
        ctx.add(Row("e2e", "small model decode", "skipped: deadline", None))
        return
    rows = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    for r in rows:
        ctx.add(Row("e2e", r["name"], r["result"], None))
    if proc.returncode != 0 or not rows:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        ctx.add(Row("e2e", "small model decode", f"skipped: {tail[0]}", None))


def print_summary(rows: list[Row]) -> None:
    width = max(len(r.name) for r in rows) if rows else 10
    print("\n" + "=" * 100 + "\nSUMMARY")
    for r in rows:
        status = {True: "PASS", False: "FAIL", None: "    "}[r.ok]
        print(f"{status}  {r.section:<9} {r.name:<{width}}  {r.result}")
    checks = [r for r in rows if r.ok is not None]
    print(f"\n{sum(r.ok for r in checks)}/{len(checks)} checks passed")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run every phase on the CPU through TRITON_INTERPRET=1 with tiny sizes",
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=240.0,
        help="seconds for the whole run (later phases are skipped past it)",
    )
    p.add_argument("--peak-gbps", type=float, default=None, help="override the peak bandwidth")
    p.add_argument("--skip-e2e", action="store_true", help="skip the end-to-end model phase")
    p.add_argument("--e2e-batch", type=int, default=64)
    p.add_argument("--e2e-prompt", type=int, default=128)
    p.add_argument("--e2e-tokens", type=int, default=128)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit runs
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: kernels
    import torch
    import triton

    from kernels import reference as ref

    if args.dry_run:
        device = "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run to exercise the code path on the CPU")
        return 2
    else:
        device = "cuda"
    from kernels import triton_paged as tp

    ctx = Ctx(
        torch=torch,
        ref=ref,
        tp=tp,
        device=device,
        dry_run=args.dry_run,
        deadline=start + args.deadline,
    )
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    peak, source = peak_bandwidth(ctx, args.peak_gbps)
    print(
        f"device: {name}; torch {torch.__version__}; triton {triton.__version__}; "
        f"peak DRAM bandwidth {peak:.0f} GB/s ({source})",
        flush=True,
    )
    phases = [
        (
            "1/3 correctness",
            lambda: (
                check_kernels(ctx),
                guarded(ctx, "check", "int64 offsets", lambda: check_large_pool(ctx)),
            ),
        ),
        ("2/3 decode bandwidth", lambda: bench_decode(ctx, peak)),
        ("2b/3 quantized linears", lambda: bench_quant(ctx, peak)),
    ]
    if not args.skip_e2e:
        batch, prompt, tokens = (
            (2, 16, 4) if args.dry_run else (args.e2e_batch, args.e2e_prompt, args.e2e_tokens)
        )
        phases.append(("3/3 end-to-end", lambda: bench_e2e(ctx, batch, prompt, tokens)))
    for title, phase in phases:
        print(f"== {title} ({ctx.left():.0f} s left)", flush=True)
        t0 = time.monotonic()
        try:
            phase()
        except Exception as e:  # noqa: BLE001 - report and go on: the summary must still print
            ctx.add(Row(title.split()[1], "phase aborted", f"{type(e).__name__}: {e}", False))
        print(f"   {title} took {time.monotonic() - t0:.0f} s", flush=True)
    print_summary(ctx.rows)
    print(f"total {time.monotonic() - start:.0f} s")
    return 1 if any(r.ok is False for r in ctx.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
