"""The C++ CPU kernels that run for a while release the GIL (``kernels/csrc/*.cpp``,
``py::call_guard<py::gil_scoped_release>``), as torch's own operators do, so a worker's
event-loop thread streams tokens, answers health checks and drives KV transfers while its
engine thread is inside a decode step or an attention pass.

How it is told, without timing: the switch interval is set to 100 s, so CPython never takes
the GIL from a thread that runs bytecode; the main thread, woken by the kernel thread just
before the calls, can then only run while that thread is inside a call that released the GIL,
or once the thread has ended. What the main thread sees tells which."""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

from kernels import cpu_paged, quant, quant_cpu

if not cpu_paged.available():
    pytest.skip("CPU paged-attention extension could not be built", allow_module_level=True)


def _ran_beside(call: Callable[[], object], seconds: float = 0.3) -> bool:
    """Whether the main thread ran Python while another thread was inside ``call`` (repeated
    for about ``seconds``, at most 200 times, so a short kernel gives it many chances). Every
    result is kept until the end: freeing a tensor releases the GIL too (torch does so)."""
    t0 = time.perf_counter()
    call()  # built, warm, and no exception expected
    reps = max(1, min(200, math.ceil(seconds / max(time.perf_counter() - t0, 1e-6))))
    state = {"inside": False}
    results: list[object] = []
    go = threading.Event()

    def worker() -> None:
        go.set()  # wakes the main thread; it waits for the GIL from here on
        for _ in range(reps):
            state["inside"] = True
            results.append(call())
            state["inside"] = False

    old = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        t = threading.Thread(target=worker)
        t.start()
        go.wait()
        seen = state["inside"]  # the first bytecode the main thread runs after the wake-up
        t.join()
    finally:
        sys.setswitchinterval(old)
    results.clear()
    return seen


def test_the_check_tells_a_call_that_keeps_the_gil_from_one_that_releases_it():
    assert _ran_beside(lambda: time.sleep(0.002))  # releases
    x = torch.randn(64, 4096)

    def python_loop() -> None:  # keeps it: bytecode only
        s = 0
        for i in range(20_000):
            s += i

    assert not _ran_beside(python_loop)
    ext = cpu_paged._bf16_ext()
    if ext is not None:  # a fused element-wise kernel keeps it by design
        xb, w = x.bfloat16(), torch.ones(4096).bfloat16()
        assert not _ran_beside(lambda: ext.rms_norm_bf16(xb, None, w, 1e-6))


def _decode_case(dtype: torch.dtype, seqs: int = 64, ctx: int = 1024, bs: int = 16):
    g = torch.Generator().manual_seed(0)
    hq, hkv, d = 8, 4, 64
    per = -(-ctx // bs)
    kv = torch.randn(seqs * per + 1, 2, 2, bs, hkv, d, generator=g).to(dtype)
    tables = torch.randperm(seqs * per, generator=g).view(seqs, per).to(torch.int32)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    q = torch.randn(seqs, hq, d, generator=g).to(dtype)
    return q, kv, tables, lens, d**-0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_releases_the_gil(dtype):
    q, kv, tables, lens, scale = _decode_case(dtype)
    ext = cpu_paged._load()
    assert _ran_beside(lambda: ext.paged_decode(q, kv, 1, tables, lens, scale, None, None))


def test_argmax_rows_releases_the_gil():
    logits = torch.randn(64, 32000)
    ext = cpu_paged._load()
    assert _ran_beside(lambda: ext.argmax_rows(logits))


def test_race_rows_releases_the_gil():
    logits = torch.randn(64, 32000).bfloat16()
    temps, keys = torch.ones(64), torch.arange(64)
    ext = cpu_paged._load()
    assert _ran_beside(lambda: ext.race_rows(logits, temps, keys))


def test_cut_rows_releases_the_gil():
    logits = torch.randn(64, 32000).bfloat16()
    ones, k = torch.ones(64), torch.full((64,), 50)
    ext = cpu_paged._load()
    assert _ran_beside(lambda: ext.cut_rows(logits, ones, k, ones * 0.9, ones * 0))


def _needs_bf16():
    """The extension's bf16 kernels, or a skip where this CPU has no AVX512-BF16."""
    ext = cpu_paged._bf16_ext()
    if ext is None:
        pytest.skip("this CPU has no AVX512-BF16")
    return ext


def test_small_linear_releases_the_gil():
    ext = _needs_bf16()
    x, w = torch.randn(16, 256).bfloat16(), torch.randn(4096, 256).bfloat16()
    assert _ran_beside(lambda: ext.linear_bf16(x, w))


def _prefill_tile(name: str) -> int:
    """The code of prefill tile ``name`` where this build and CPU can run it, else a skip."""
    if not cpu_paged.prefill_paths_here()[name]:
        pytest.skip(f"no {name} prefill tile here")
    return cpu_paged._PREFILL_TILE[name]


@pytest.mark.parametrize("name", ["avx512", "amx", "avx2"])
def test_prefill_attention_releases_the_gil(name):
    tile, ext = _prefill_tile(name), cpu_paged._load()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(512, 8, 32, generator=g).bfloat16()
    k = torch.randn(512, 4, 32, generator=g).bfloat16()
    assert _ran_beside(lambda: ext.prefill_bf16(q, k, k, 0, 0.2, tile))


@pytest.mark.parametrize("name", ["avx512", "amx", "avx2"])
def test_paged_prefill_releases_the_gil(name):
    tile, ext = _prefill_tile(name), cpu_paged._load()
    _, kv, tables, lens, scale = _decode_case(torch.bfloat16, seqs=2, ctx=512)
    q = torch.randn(1024, 8, 64).bfloat16()  # both sequences' 512 tokens as prefill chunks
    qsl = torch.tensor([0, 512, 1024], dtype=torch.int32)
    assert _ran_beside(lambda: ext.paged_prefill_bf16(q, kv, 0, tables, lens, qsl, scale, tile))


@pytest.mark.parametrize("tiles", [True, False])
def test_one_pass_head_releases_the_gil(tiles):
    if tiles and not cpu_paged.amx_linear_available():
        pytest.skip("this CPU has no AMX tiles")
    if not tiles and not cpu_paged.dp_linear_available():
        pytest.skip("no AVX512-BF16 in this build")
    w = torch.randn(32000, 256).bfloat16()
    packed = cpu_paged.amx_pack(w)
    x = torch.randn(64, 256).bfloat16()
    ext = cpu_paged._bf16_ext()
    assert _ran_beside(lambda: ext.amx_linear_bf16(x, packed, 32000, tiles))
    assert _ran_beside(lambda: ext.amx_argmax_bf16(x, packed, 32000, tiles))


def test_quantized_gemm_releases_the_gil():
    ext = quant_cpu.extension()
    if ext is None:
        pytest.skip("the quantized C++ kernels need AVX512-BF16")
    qw = quant.quantize_int8_per_channel(torch.randn(2048, 1024) * 0.05)
    pw = quant.prepare(qw, torch.device("cpu"), torch.bfloat16, ext)
    assert pw.path == "cpp-w8"
    x = torch.randn(64, 1024).bfloat16()
    t = pw.tensors
    assert _ran_beside(
        lambda: ext.quant_gemm(x, t["packed"], t["scales"], t["zs"], pw.bits, pw.group_size, 2048)
    )


@pytest.mark.parametrize("path,kind", [("onednn", "packed"), ("avx2", "avx2"), ("amx", "amx")])
def test_the_one_call_decode_step_releases_the_gil(make_model, monkeypatch, path, kind):
    """The engine's own call of ``decode_layers_bf16`` (a bf16 engine on the tiny model),
    recorded and replayed: with oneDNN's packed projections (its 16-argument form), the amx
    plan's and the avx2 plan's."""
    if not cpu_paged.decode_layers_available(kind):
        pytest.skip(f"the CPU extension has no {kind} projections on this machine")
    from kernels import cpu_linear
    from shared.engine.llm import LLM
    from shared.engine.sampling_params import SamplingParams

    monkeypatch.setenv(cpu_linear.PATH_ENV, path)
    ext = cpu_paged._avx2_ext() if kind == "avx2" else cpu_paged._bf16_ext()
    real = ext.decode_layers_bf16
    calls: list[tuple[object, ...]] = []

    def record(*args: object) -> torch.Tensor:
        calls.append(tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
        return real(*args)

    monkeypatch.setattr(ext, "decode_layers_bf16", record)
    llm = LLM(str(make_model("tiny")), dtype="bfloat16", max_num_seqs=8, kv_cache_memory="32MiB")
    llm.generate([[5, 6, 7, 8] * 8] * 4, SamplingParams(max_tokens=4, temperature=0.0))
    monkeypatch.setattr(ext, "decode_layers_bf16", real)
    assert calls, "the engine never took the one-call decode step"
    args = calls[-1]
    assert _ran_beside(lambda: real(*args))
