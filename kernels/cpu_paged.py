"""Paged attention for the CPU: a C++ decode kernel that reads K/V blocks in place.

The torch reference (``kernels/reference.py``) gathers every sequence's blocks into a
contiguous tensor each layer and step; on a CPU that copy dominates a decode step. This module
compiles ``kernels/csrc/cpu_paged.cpp`` (once per source, torch version and CPU model, with
``torch.utils.cpp_extension``, cached under ``~/.cache/torch_extensions``) into a decode
kernel that walks the block table and runs an online softmax over each block where it lies,
parallel over sequences (every KV head of one in a pass, each 16-token group's rows fetched
ahead in address order; over (sequence, KV head) when sequences are fewer than twice the
threads) with ``at::parallel_for``, on ``vdpbf16ps`` for bf16 (fp32 on 16-lane AVX-512 or, on a
CPU with AVX2 only, 8-lane vectors for the other dtypes and CPUs); sequences whose tables begin
with the same blocks (a shared prompt prefix) share an item that reads those blocks once for
all of them.
A step's multi-token prefill chunks over a bf16 pool go to the bf16 prefill kernel (AMX tiles
where the CPU has AMX-BF16, else AVX512-BF16 dot products, else fp32 FMAs on AVX2:
``prefill_path``) in one call
that reads the blocks in place (``paged_prefill_bf16``: each 16-key unit of a block
packed once for every chunk whose table holds it, so chunks after a shared cached prefix pack
it once); the rest (fp8 pools, fp32) go through the reference's loop over gathered K/V to
``attend_prefill`` (that kernel on one chunk for bf16 queries, SDPA otherwise). ``write_kv`` stores a layer's
new K/V rows in one C++ call (the reference's for fp8 pools). Also here, for bf16 on an
AVX512-BF16 CPU: ``small_linear`` (a matmul for a decode step's few rows, which unpacked
projections offer their input to); on a CPU with AVX2 and FMA, ``avx2_linear`` (the ``avx2``
linear plan's matmul, any row count); on any CPU the fused element-wise ops a layer offers its
bf16 tensors to (``rms_norm``, ``rope``, ``silu_mul``: vector forms with AVX512-BF16, one element
at a time elsewhere); and a row argmax for greedy sampling.

Same signatures and contracts as ``kernels/reference.py``. ``available()`` says whether the
extension built; ``get_backend("cpp")`` falls back to the reference with a warning if not.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from kernels import cpp_build, reference
from kernels.reference import gather_kv, is_fp8  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)


_lock = threading.Lock()
_ext = None
_failed: str | None = None


SOURCE = Path(__file__).with_name("csrc") / "cpu_paged.cpp"
_FLAGS = ["-O3", "-fopenmp", "-march=native", "-ffast-math"]


def extension_name() -> str:
    """``pdserve_cpu_paged_<hash>`` (``kernels/cpp_build.py``)."""
    return cpp_build.extension_name("pdserve_cpu_paged", SOURCE, _FLAGS)


def _build():
    """The extension, built (or loaded from the cache) once; ``None`` where it cannot build."""
    global _ext, _failed
    if _ext is not None or _failed is not None:
        return _ext
    with _lock:
        if _ext is None and _failed is None:
            try:
                _ext = cpp_build.build("pdserve_cpu_paged", SOURCE, _FLAGS)
            except Exception as e:  # noqa: BLE001 - no compiler, no headers: the reference works
                _failed = f"{type(e).__name__}: {e}"
                logger.warning(
                    "CPU paged-attention extension unavailable (%s); using the torch reference",
                    _failed.splitlines()[0],
                )
    return _ext


def _load():
    """The extension with its decode path chosen (``decode_uses_amx``), or ``None``."""
    ext = _build()
    if ext is not None and _decode_amx is None:
        try:
            decode_uses_amx(announce=False)  # a bf16 model's load logs the choice
        except (ValueError, RuntimeError):
            pass  # a bad PDSERVE_CPU_DECODE: the model's load reports it (off until then)
    return ext


def available() -> bool:
    return _load() is not None


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [NB, L, 2, BS, Hkv, D]
    layer: int,
    slot_mapping: torch.Tensor,  # [T] int64 / int32, < 0 = padding
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """The reference's ``write_kv``, as one C++ call of row copies where the pool is not fp8
    and key / value are CPU tensors in its dtype with each token's heads contiguous."""
    ext = _load()
    if (
        ext is None
        or key.device.type != "cpu"
        or is_fp8(kv_cache)
        or key.dtype != kv_cache.dtype
        or value.dtype != kv_cache.dtype
        or not (_rows_contiguous(key) and _rows_contiguous(value))
    ):
        reference.write_kv(key, value, kv_cache, layer, slot_mapping, k_scale, v_scale)
        return
    ext.write_kv(key, value, kv_cache, layer, slot_mapping.contiguous())


def _rows_contiguous(x: torch.Tensor) -> bool:
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def paged_decode_attention(
    query: torch.Tensor,  # [S, Hq, D]
    kv_cache: torch.Tensor,  # [NB, L, 2, BS, Hkv, D]
    layer: int,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [S, Hq, D]
    ext = _load()
    if ext is None or query.device.type != "cpu":
        return reference.paged_decode_attention(
            query, kv_cache, layer, block_tables, seq_lens, scale, k_scale, v_scale
        )
    return ext.paged_decode(
        query.contiguous(),
        kv_cache,
        layer,
        block_tables.contiguous(),
        seq_lens.contiguous(),
        float(scale),
        k_scale,
        v_scale,
    )


_SMALL_M = 16  # rows up to which linear_bf16 beats torch's bf16 matmul on this kind of CPU
_bf16_gemm: bool | None = None


def small_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x @ weight.T`` through the AVX512-BF16 kernel when it applies (CPU, bf16, at most
    ``_SMALL_M`` rows, K % 32 == 0, N % 16 == 0), else ``None`` (the caller uses F.linear).
    torch's bf16 matmul reads a 32000 x 256 LM head at ~10 GB/s for one row; this streams it
    at several times that."""
    ext = _bf16_kernels(x, 32)  # K % 32
    if (
        ext is None
        or weight.dtype != torch.bfloat16
        or x.dim() != 2
        or x.shape[0] > _SMALL_M
        or weight.shape[0] % 16
    ):
        return None
    return ext.linear_bf16(x.contiguous(), weight.contiguous())


def avx2_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x @ weight.T`` through the AVX2 + FMA kernel (``linear_bf16_avx2``: bf16 widened to
    fp32 on load, fp32 FMAs) for a bf16 CPU ``x [M, K]`` and ``weight [N, K]``, K % 8 == 0, any
    M and N; else ``None``. The bf16 path of a CPU without bf16 dot products (the ``avx2``
    linear plan), where torch's bf16 matmul has no native kernel: 2-4x faster than it at one
    row, 4-6.5x from 4 rows to a 1,024-token prefill on a Zen 3 EPYC (docs/benchmarks.md, "bf16
    on a CPU with AVX2 only")."""
    ext = _avx2_ext()
    if (
        ext is None
        or x.dtype != torch.bfloat16
        or weight.dtype != torch.bfloat16
        or x.device.type != "cpu"
        or x.dim() != 2
        or weight.dim() != 2
        or x.shape[1] % 8
    ):
        return None
    return ext.linear_bf16_avx2(x.contiguous(), weight.contiguous())


_avx2_gemm: bool | None = None


def _avx2_ext():
    """The extension when it was built with AVX2 and FMA (``linear_bf16_avx2``), else ``None``."""
    global _avx2_gemm
    ext = _load()
    if ext is None:
        return None
    if _avx2_gemm is None:
        _avx2_gemm = bool(ext.avx2_gemm_supported())
    return ext if _avx2_gemm else None


def avx2_linear_available() -> bool:
    """Whether :func:`avx2_linear` can run here (the extension, built with AVX2 and FMA)."""
    return _avx2_ext() is not None


def _bf16_ext():
    """The extension when it was built with AVX512-BF16 (its bf16 kernels), else ``None``."""
    global _bf16_gemm
    ext = _load()
    if ext is None:
        return None
    if _bf16_gemm is None:
        _bf16_gemm = bool(ext.bf16_gemm_supported())
    return ext if _bf16_gemm else None


def _bf16_kernels(x: torch.Tensor, multiple: int) -> object:
    """The extension's bf16 kernels for a bf16 CPU tensor whose last dimension is a multiple of
    ``multiple``, else ``None``: the gate of every bf16 kernel here."""
    return _bf16_ext() if _bf16_rows(x, multiple) else None


def _bf16_rows(x: torch.Tensor, multiple: int) -> bool:
    """Whether ``x`` is a bf16 CPU tensor whose last dimension is a multiple of ``multiple``."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.shape[-1] % multiple == 0


# ---- the element-wise parts of a bf16 layer, fused (each returns None where it does not apply)


def _fused_kernels(x: torch.Tensor, multiple: int) -> object:
    """The extension for the fused element-wise ops on a bf16 CPU tensor whose last dimension
    is a multiple of ``multiple``, else ``None``: vector forms where it was built with
    AVX512-BF16, one element at a time elsewhere (still one pass instead of torch's 3-10 ops,
    which are most of a small decode step on a CPU without AVX512-BF16)."""
    return _load() if _bf16_rows(x, multiple) else None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(RMSNorm(x + residual), x + residual)`` for a bf16 ``[T, H]`` ``x`` in one pass (the
    sum rounded to bf16 first, as ``x + residual`` would be), else ``None``."""
    ext = _fused_kernels(x, 16)
    if ext is None or x.dim() != 2 or weight.dtype != torch.bfloat16:
        return None
    r = None if residual is None else residual.contiguous()
    out, total = ext.rms_norm_bf16(x.contiguous(), r, weight, float(eps))
    return out, total


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rotate-half RoPE of bf16 ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` from fp32 tables, else
    ``None``."""
    ext = _fused_kernels(q, 32)
    if ext is None or k.dtype != torch.bfloat16 or cos.dtype != torch.float32:
        return None
    qo, ko = ext.rope_bf16(q, k, cos, sin, positions.long().contiguous())
    return qo, ko


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` for a bf16 ``[T, 2I]`` (gate columns first), else ``None``."""
    ext = _fused_kernels(gate_up, 32)
    if ext is None or gate_up.dim() != 2:
        return None
    return ext.silu_mul_bf16(gate_up.contiguous())


def decode_layers(
    x: torch.Tensor,
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: tuple[int, int, int],
    eps: float,
    weights: list[torch.Tensor],
    layers: list[int],
    qkv_bias: bool,
    linear: str = "packed",
) -> torch.Tensor:
    """A decode step's decoder layers in one C++ call (``decode_layers_bf16``); the caller
    (``LlamaForCausalLM.plan_decode``) has checked that every op it makes applies. ``linear``:
    ``"packed"`` (``weights`` hold oneDNN's packed projections), ``"avx2"`` (the plain bf16
    weights, through ``linear_bf16_avx2``) or ``"amx"`` (:func:`amx_pack`'s tiles, every
    projection's N a multiple of 32, through :func:`amx_proj`)."""
    ext = _decode_ext(linear)
    assert ext is not None
    hq, hkv, d = heads
    # packed: the 16-argument form every build has (a bench's baseline may predate ``linear``)
    kind = () if linear == "packed" else (_DECODE_LINEARS[linear],)
    return ext.decode_layers_bf16(
        x.contiguous(),
        positions.long().contiguous(),
        kv_cache,
        slot_mapping.contiguous(),
        block_tables.contiguous(),
        seq_lens.contiguous(),
        float(scale),
        cos,
        sin,
        hq,
        hkv,
        d,
        float(eps),
        weights,
        layers,
        qkv_bias,
        *kind,
    )


_DECODE_LINEARS = {"packed": 0, "avx2": 1, "amx": 2}  # decode_layers_bf16's ``linear``


def decode_layers_available(linear: str = "packed") -> bool:
    """Whether :func:`decode_layers` can run here with ``linear``'s projections: ``"packed"``
    where the extension was built with AVX512-BF16 (oneDNN's packed bf16 primitive), ``"avx2"``
    where it was built with AVX2 and FMA, ``"amx"`` where :func:`amx_linear_available`."""
    return _decode_ext(linear) is not None


def _decode_ext(linear: str):
    """The extension when it can run :func:`decode_layers` with ``linear``'s projections."""
    if linear == "amx":
        return _bf16_ext() if amx_linear_available() else None
    return _bf16_ext() if linear == "packed" else _avx2_ext()


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for a CPU ``[N, V]`` tensor without an fp32 copy (bf16 argmax in
    torch is ~4x slower than upcast + argmax; this reads the bf16 values in place)."""
    ext = _load()
    if ext is None or logits.device.type != "cpu" or logits.dim() != 2:
        return logits.float().argmax(dim=-1)
    return ext.argmax_rows(logits.contiguous())


def race_rows(x: torch.Tensor, temps: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
    """One sampled token per row of a CPU ``[N, V]`` tensor (fp32 or bf16), ``[N]`` int64: the
    exponential race ``argmax_i w_i / E_i`` in one pass per row, the noise ``E_i = -ln u_i``
    drawn in the kernel from SplitMix64 keyed by ``keys[r]`` (int64), so a row's draw depends on
    its key and weights alone. ``temps`` (fp32 ``[N]``): ``x`` holds logits and
    ``w_i = exp((x_i - max x) / T)`` (-inf: weight 0), temperature 0 the row's argmax; ``None``:
    ``x`` holds the weights (``>= 0``, unnormalised). ``x`` is read in place (no fp32 copy)."""
    ext = _load()
    if ext is None:
        raise RuntimeError(f"the CPU extension is unavailable: {_failed}")
    if temps is not None:
        temps = temps.to(torch.float32).contiguous()
    return ext.race_rows(x.contiguous(), temps, keys.to(torch.long).contiguous())


def cut_rows(
    x: torch.Tensor,
    temps: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """The weights each row of a CPU ``[N, V]`` tensor (logits, fp32 or bf16) samples from,
    fp32 ``[N, V]``, unnormalised: ``exp((x - max x) / T)`` (0 for -inf), then min-p (``0``:
    off; weights below ``min_p`` x the largest dropped), top-k (``<= 0``: off; ties with the
    k-th kept) and top-p (``1``: off; the smallest set of the largest weights left whose mass
    reaches ``p`` of what min-p and top-k left, ties with its last kept), in that order, as
    vLLM V1 applies them.
    For :func:`race_rows` with ``temps=None``."""
    ext = _load()
    if ext is None:
        raise RuntimeError(f"the CPU extension is unavailable: {_failed}")
    f32 = dict(dtype=torch.float32)
    return ext.cut_rows(
        x.contiguous(),
        temps.to(**f32).contiguous(),
        top_k.to(torch.long).contiguous(),
        top_p.to(**f32).contiguous(),
        min_p.to(**f32).contiguous(),
    )


_amx_linear: bool | None = None


def amx_linear_available() -> bool:
    """Whether :func:`amx_linear` and :func:`amx_argmax` can run on AMX tiles here: the
    extension was built with AMX-BF16 (this CPU has the tiles) and Linux lets the process use
    them."""
    global _amx_linear
    if _amx_linear is None:
        ext = _bf16_ext()
        probe = getattr(ext, "amx_linear_available", None)  # None: an older build (benches)
        _amx_linear = probe is not None and bool(probe())
    return _amx_linear


def dp_linear_available() -> bool:
    """Whether :func:`amx_linear` and :func:`amx_argmax` can run with ``tiles=False``: on
    AVX512-BF16 dot products (AMD Zen 4, Xeons before Sapphire Rapids), the same walk over the
    same packed weight."""
    ext = _bf16_ext()
    probe = getattr(ext, "dp_linear_available", None)
    return probe is not None and bool(probe())


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 ``[N, K]`` weight (K % 32 == 0) in the tile layout of :func:`amx_linear`
    (``[ceil(N / 32) * 2, K / 32, 512]``, the columns past N zero)."""
    ext = _bf16_ext()
    assert ext is not None
    return ext.amx_pack_linear(weight.detach())


def amx_linear(x: torch.Tensor, packed: torch.Tensor, n: int, tiles: bool = True) -> torch.Tensor:
    """``x @ weight.T`` (bf16 ``[M, n]``) from ``packed = amx_pack(weight)``: each thread
    streams its share of the weight once for all M rows (oneDNN re-reads it per 64 rows), on
    AMX tiles or, ``tiles=False``, on AVX512-BF16 dot products."""
    ext = _bf16_ext()
    assert ext is not None
    return ext.amx_linear_bf16(x.contiguous(), packed, int(n), bool(tiles))


def amx_proj(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """A layer's projection on AMX tiles (the ``amx`` linear plan): ``x @ weight.T`` (bf16
    ``[M, n]``) from ``packed = amx_pack(weight)``, the same sums as :func:`amx_linear` with
    the output stored plainly (the next op reads it at once). Needs :func:`amx_linear_available`."""
    ext = _bf16_ext()
    assert ext is not None
    return ext.amx_proj_bf16(x, packed, int(n))


def amx_argmax(x: torch.Tensor, packed: torch.Tensor, n: int, tiles: bool = True) -> torch.Tensor:
    """``argmax_rows(amx_linear(x, packed, n, tiles))`` (``[M]`` int64, the first index of each
    row's largest bf16 value) without writing the logits: a greedy step's LM head and draw in
    one pass over the weight."""
    ext = _bf16_ext()
    assert ext is not None
    return ext.amx_argmax_bf16(x.contiguous(), packed, int(n), bool(tiles))


def fp32_vectors() -> str | None:
    """The vectors the extension's fp32 kernels use where it has no bf16 dot products
    (``-march=native``: this CPU's): ``"AVX-512"``, ``"AVX2"`` (with FMA) or ``None``."""
    flags = set(cpp_build.cpu_flags().split())
    if "avx512f" in flags:
        return "AVX-512"
    if {"avx2", "fma"} <= flags:
        return "AVX2"
    return None


PREFILL_ENV = "PDSERVE_CPU_PREFILL"
PREFILL_PATHS = ("auto", "amx", "avx512", "avx2", "sdpa")
# the C++ entry points' tile codes (``PfIsa`` in csrc/cpu_paged.cpp)
_PREFILL_TILE = {"avx512": 0, "amx": 1, "avx2": 2}
_PREFILL_SAYS = {
    "amx": "AMX tiles",
    "avx512": "AVX512-BF16 dot products",
    "avx2": "fp32 FMAs on AVX2 (bf16 widened in registers)",
    "sdpa": "torch's SDPA",
}
_prefill_path: str | None = None


def prefill_paths_here() -> dict[str, bool]:
    """Which of :data:`PREFILL_PATHS`' kernels (less ``auto``) this CPU and build can run."""
    ext, bf16 = _load(), _bf16_ext()
    return {
        "amx": bf16 is not None and bool(bf16.prefill_amx_available()),
        "avx512": bf16 is not None,
        # (getattr: an extension built from an older source, as the benches load)
        "avx2": ext is not None and bool(getattr(ext, "prefill_avx2_available", bool)()),
        "sdpa": True,
    }


def prefill_path() -> str:
    """Which kernel runs bf16 prefill attention: ``auto`` (``PDSERVE_CPU_PREFILL``, default)
    takes AMX tiles where the CPU has AMX-BF16 and the extension built the AMX tile (on this
    kind of CPU torch's own SDPA, on AMX, also beats the AVX512-BF16 dot products), else the
    AVX512-BF16 tile, else, on a CPU with AVX2 and FMA (but no AVX512-BF16), the AVX2 tile
    (fp32 FMAs on bf16 widened in registers), else torch's SDPA; ``amx`` / ``avx512`` /
    ``avx2`` / ``sdpa`` force one (one that cannot run here is an error). Read once; logged at
    first use."""
    global _prefill_path
    if _prefill_path is None:
        want = (os.environ.get(PREFILL_ENV) or "auto").lower()
        if want not in PREFILL_PATHS:
            raise ValueError(f"{PREFILL_ENV}={want!r}: expected one of {', '.join(PREFILL_PATHS)}")
        here = prefill_paths_here()
        if want == "auto":
            path = next(p for p in ("amx", "avx512", "avx2", "sdpa") if here[p])
        elif not here[want]:
            raise RuntimeError(
                f"{PREFILL_ENV}={want}: this CPU or build has no {_PREFILL_SAYS[want]}"
            )
        else:
            path = want
        _prefill_path = path
        logger.info("bf16 prefill attention on %s (%s=%s)", _PREFILL_SAYS[path], PREFILL_ENV, want)
    return _prefill_path


def _prefill_kernels(q: torch.Tensor, kv_dtype: torch.dtype) -> tuple[object, int] | None:
    """The extension and the tile code for a bf16 prefill over bf16 K/V with a head size that
    is a multiple of 32, at most 256, where :func:`prefill_path` names a C++ tile; else
    ``None`` (torch's SDPA)."""
    if not _bf16_rows(q, 32) or kv_dtype != torch.bfloat16 or q.shape[-1] > 256:
        return None
    path = prefill_path()
    if path == "sdpa":
        return None
    return _load(), _PREFILL_TILE[path]


DECODE_ENV = "PDSERVE_CPU_DECODE"
DECODE_PATHS = ("auto", "amx", "avx512")
_decode_amx: bool | None = None
_decode_said: str | None = None  # the choice's log line, until logged


def decode_uses_amx(announce: bool = True) -> bool:
    """Whether bf16 decode attention runs the groups of a shared prefix on AMX tiles: ``auto``
    (``PDSERVE_CPU_DECODE``, default) where the CPU has AMX-BF16 and the extension built the
    tile step, else on ``vdpbf16ps``; ``amx`` / ``avx512`` force one (``amx`` where it cannot
    run is an error). On tiles, a member of a shared prefix gets its output within bf16
    rounding of its walk alone instead of the same bits. Read once (when the extension loads);
    logged once, at the first call that ``announce``s it: a bf16 model's load (the extension's
    own load does not, so an fp32 model's start says nothing of bf16 attention)."""
    global _decode_amx, _decode_said
    if _decode_amx is None:
        want = (os.environ.get(DECODE_ENV) or "auto").lower()
        if want not in DECODE_PATHS:
            raise ValueError(f"{DECODE_ENV}={want!r}: expected one of {', '.join(DECODE_PATHS)}")
        ext = _build()
        probe = getattr(ext, "decode_amx_available", None)  # None: an older build (benches)
        can = probe is not None and bool(probe())
        if want == "amx" and not can:
            raise RuntimeError(f"{DECODE_ENV}=amx: this CPU or build has no AMX tiles")
        on = can and want != "avx512"
        if probe is not None:
            on = bool(ext.set_decode_amx(on))
        _decode_amx = on
        if _bf16_ext() is None:
            vec = fp32_vectors()
            # (the vector walk covers head sizes 32 / 64 / 128 and the usual query groups
            # over fp32, bf16 and fp16 pools; other shapes and fp8 pools take the loop)
            where = (
                f"fp32 FMAs on {vec}, else a portable C++ loop" if vec else "a portable C++ loop"
            )
            what = f"{where} (no AVX512-BF16 in this CPU or build)"
        else:
            what = "AMX tiles" if on else "AVX512-BF16 dot products"
        _decode_said = f"bf16 decode attention over shared prefixes on {what} ({DECODE_ENV}={want})"
    if announce and _decode_said is not None:
        logger.info("%s", _decode_said)
        _decode_said = None
    return _decode_amx


def attend_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, offset: int
) -> torch.Tensor:
    """One sequence's causal prefill chunk (``reference._attend``'s contract: q ``[Tq, Hq, D]``,
    k / v ``[Tk, Hkv, D]``, row i sees keys ``<= offset + i``): the C++ prefill tile
    (:func:`prefill_path`) for bf16 with a head size that is a multiple of 32 (at most 256),
    else torch's SDPA."""
    kernels = _prefill_kernels(q, k.dtype)
    if kernels is None:
        return reference._attend(q, k, v, scale, offset)
    ext, tile = kernels
    return ext.prefill_bf16(  # type: ignore[attr-defined]
        q.contiguous(), k.contiguous(), v.contiguous(), int(offset), scale, tile
    )


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [NB, L, 2, BS, Hkv, D]
    layer: int,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Single-token rows through the C++ decode kernel; prefill chunks of a bf16 pool through
    the paged bf16 prefill kernel, all in one call reading the blocks in place (each block's
    K/V packed once for every sequence that holds it: ``paged_prefill_bf16``), others through
    ``attend_prefill`` from the reference's loop over the sequences."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    single = q_lens == 1
    if bool(single.all()):
        return paged_decode_attention(
            query, kv_cache, layer, block_tables, seq_lens, scale, k_scale, v_scale
        )
    kernels = _prefill_kernels(query, kv_cache.dtype)
    if kernels is not None:
        ext, tile = kernels
        out = ext.paged_prefill_bf16(  # type: ignore[attr-defined]
            query.contiguous(),
            kv_cache,
            layer,
            block_tables.contiguous(),
            seq_lens.contiguous(),
            query_start_loc.contiguous(),
            float(scale),
            tile,
        )
        if bool(single.any()):
            rows = single.nonzero().squeeze(1)
            idx = query_start_loc[rows].long()
            out[idx] = paged_decode_attention(
                query[idx],
                kv_cache,
                layer,
                block_tables[rows],
                seq_lens[rows],
                scale,
            )
        return out
    return gathered_attention(
        query, kv_cache, layer, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale
    )


def gathered_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference's per-sequence loop over gathered K/V with this backend's kernels
    (``attend_prefill`` per chunk, the decode kernel for single rows): the path of fp8 pools
    and fp32, and what ``paged_prefill_bf16`` is checked and timed against."""
    return reference.paged_attention_with(
        attend_prefill,
        paged_decode_attention,
        query,
        kv_cache,
        layer,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        k_scale,
        v_scale,
    )
