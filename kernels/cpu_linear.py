"""Linear layers on the CPU's matrix units: weights repacked once at load, chosen at run time.

torch's ``F.linear`` in bf16 reorders the plain ``[N, K]`` weight into oneDNN's blocked layout
on every call; for the few rows of a decode step that reorder is most of the call
(docs/benchmarks.md, "CPU kernels", has the decode-step figures). So, as vLLM's CPU backend
does with its oneDNN handlers, every bf16 projection's weight is reordered once at load (``torch.ops.mkldnn._reorder_linear_weight``) and each call goes
straight to the packed primitive (``torch.ops.mkldnn._linear_pointwise``); oneDNN itself picks
AMX tiles or AVX512-BF16 dot products for the machine. The packed weight replaces the plain one
(no second copy), except for an LM head tied to the embedding, whose table the lookup still
reads.

The plan is made at start-up from what the CPU has (``CpuFeatures.detect``): bf16 weights on a
CPU with AMX-BF16 take the ``amx`` plan: packed once into the AMX tiles' B layout
(``cpu_paged.amx_pack``; K not a multiple of 32 keeps oneDNN's) and walked once a call for all
rows on the tiles (``cpu_paged.amx_proj``, the LM head's walk: 0.73-0.89x oneDNN's time at
decode's 1-64 rows of a 1,024-wide model, 0.87-1.09x at 128-2,048); on one with
AVX512-BF16 but no AMX they take oneDNN's packed path; on a CPU whose oneDNN has no bf16 at
all (AVX2 only), where torch's bf16 matmul falls back to a generic loop, the ``avx2`` plan
sends every bf16 projection and the LM head, unpacked, to the C++ AVX2 + FMA kernel
(``cpu_paged.avx2_linear``, 4-6.5x faster than that loop from 4 rows up); anything else (fp32,
which must stay token-exact with ``transformers``, AVX-512 CPUs without bf16 dot products,
where oneDNN emulates them, CUDA) keeps ``F.linear``. ``PDSERVE_CPU_LINEAR=amx|onednn|avx2|torch``
overrides the choice (for benchmarks and for ruling a path out; one that cannot run here falls
back to ``F.linear``). Unpacked bf16 weights are first offered to the
C++ small-batch kernel (``cpu_paged.small_linear``); packed ones are not: it reads only the plain
layout, and keeping both copies would double the weights' memory for a few per cent at batch 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

PATH_ENV = "PDSERVE_CPU_LINEAR"
PATHS = ("auto", "amx", "onednn", "avx2", "torch")
HEAD_ENV = "PDSERVE_CPU_LM_HEAD"
HEAD_PATHS = ("auto", "amx", "avx512", "onednn")


@dataclass(frozen=True)
class CpuFeatures:
    """What the CPU offers a bf16 matmul, read once at start-up (torch's own cpuinfo checks)."""

    name: str
    amx_bf16: bool
    avx512_bf16: bool
    avx512: bool
    avx2: bool

    @classmethod
    def detect(cls) -> CpuFeatures:
        cpu = torch.cpu
        return cls(
            name=_cpu_name(),
            amx_bf16=bool(cpu._is_amx_tile_supported()),
            avx512_bf16=bool(cpu._is_avx512_bf16_supported()),
            avx512=bool(cpu._is_avx512_supported()),
            avx2=bool(cpu._is_avx2_supported()),
        )

    def describe(self) -> str:
        isa = [
            n
            for n, on in (
                ("AMX-BF16", self.amx_bf16),
                ("AVX512-BF16", self.avx512_bf16),
                ("AVX512", self.avx512),
                ("AVX2", self.avx2),
            )
            if on
        ]
        return f"{self.name} ({', '.join(isa) or 'no AVX2'})"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


@dataclass(frozen=True)
class LinearPlan:
    """How a model's projections run: ``path`` ``"onednn"`` (prepacked weights) or ``"torch"``
    (``F.linear`` on the plain weight), and why."""

    path: str
    reason: str

    @property
    def packed(self) -> bool:
        """Whether the weights are repacked at load (oneDNN's layout, or the AMX tiles')."""
        return self.path in ("onednn", "amx")


def plan_for(
    dtype: torch.dtype,
    device: torch.device,
    requested: str | None = None,
    features: CpuFeatures | None = None,
) -> LinearPlan:
    """The plan for weights of ``dtype`` on ``device``; ``requested`` (default: the
    ``PDSERVE_CPU_LINEAR`` environment variable, else ``auto``) forces a path where it can run."""
    requested = (requested or os.environ.get(PATH_ENV) or "auto").lower()
    if requested not in PATHS:
        raise ValueError(f"{PATH_ENV}={requested!r}: expected one of {', '.join(PATHS)}")
    if device.type != "cpu":
        return LinearPlan("torch", f"{device.type} device")
    if requested == "torch":
        return LinearPlan("torch", f"{PATH_ENV}=torch")
    if dtype not in (torch.bfloat16,):
        return LinearPlan("torch", f"{str(dtype).removeprefix('torch.')} weights (MKL sgemm)")
    f = features or CpuFeatures.detect()
    if requested == "avx2" or (requested == "auto" and not onednn_bf16()):
        return _avx2_plan(requested, f)
    if not onednn_bf16():
        return LinearPlan("torch", f"oneDNN has no bf16 on {f.describe()} with this torch build")
    if requested == "onednn":
        return LinearPlan("onednn", f"{PATH_ENV}=onednn on {f.describe()}")
    if requested in ("auto", "amx") and f.amx_bf16 and _amx_walk():
        how = f"{PATH_ENV}=amx" if requested == "amx" else "AMX-BF16"
        return LinearPlan(
            "amx",
            f"AMX tiles, each weight packed once and streamed once a call ({how}; {f.describe()})",
        )
    if requested == "amx":
        return LinearPlan(
            "onednn", f"{PATH_ENV}=amx, but no AMX tiles here: oneDNN ({f.describe()})"
        )
    if f.amx_bf16:
        return LinearPlan("onednn", f"oneDNN AMX-BF16 tiles, prepacked ({f.describe()})")
    if f.avx512_bf16:
        return LinearPlan("onednn", f"oneDNN AVX512-BF16, prepacked ({f.describe()})")
    return LinearPlan("torch", f"no bf16 dot products on {f.describe()}")


def _amx_walk() -> bool:
    """Whether the extension's AMX projection (``cpu_paged.amx_proj``) runs here."""
    from kernels import cpu_paged

    return cpu_paged.amx_linear_available()


BLOCKED_ROWS_ENV = "PDSERVE_AVX2_BLOCKED_ROWS"  # read by the C++ kernel (atoll), checked here
PREFETCH_ROWS_ENV = "PDSERVE_AVX2_PREFETCH_ROWS"  # likewise
WHOLE_K_BYTES_ENV = "PDSERVE_AVX2_WHOLE_K_BYTES"  # likewise

#: name -> (smallest value, what it sets): the AVX2 kernel's settings, which it parses with
#: ``atoll`` (``"abc"`` would read as 0 without a word: every call blocked, or no prefetch)
_AVX2_SETTINGS = {
    BLOCKED_ROWS_ENV: (
        1,
        "the row count from which the AVX2 linear kernel takes its outer-product blocks; "
        "default 16",
    ),
    PREFETCH_ROWS_ENV: (
        0,
        "how many weight rows ahead the AVX2 linear kernel's few-row path prefetches; "
        "default 8, 0: none",
    ),
    WHOLE_K_BYTES_ENV: (
        0,
        "up to how many bytes of widened x the AVX2 linear kernel's blocked path runs each "
        "weight row group over the whole K; default a quarter of the L3 within 1-8 MiB, "
        "0: never",
    ),
}


def _check_avx2_settings() -> None:
    """Each of the AVX2 kernel's settings, when set, is an integer at or above its smallest
    value; ``ValueError`` names the one that is not (the loader's ``ConfigError``)."""
    for name, (least, what) in _AVX2_SETTINGS.items():
        raw = os.environ.get(name, "").strip()
        if raw and not (raw.isascii() and raw.isdigit() and int(raw) >= least):
            raise ValueError(f"{name}={raw!r}: expected an integer >= {least} ({what})")


def _avx2_plan(requested: str, f: CpuFeatures) -> LinearPlan:
    """The plan where oneDNN has no bf16, or where ``avx2`` was asked for: the AVX2 + FMA
    kernel on the plain weights where it was built and the CPU has both, else ``F.linear``."""
    from kernels import cpu_paged

    if f.avx2 and cpu_paged.avx2_linear_available():
        _check_avx2_settings()
        how = f"{PATH_ENV}=avx2" if requested == "avx2" else "no bf16 dot products"
        return LinearPlan(
            "avx2", f"AVX2 + FMA kernel, bf16 widened to fp32 ({how}; {f.describe()})"
        )
    if requested == "avx2":
        return LinearPlan(
            "torch", f"{PATH_ENV}=avx2, but the kernel is not built on {f.describe()}"
        )
    return LinearPlan("torch", f"oneDNN has no bf16 on {f.describe()} with this torch build")


def head_request(requested: str | None = None) -> str:
    """The LM head's requested path: ``requested``, else ``PDSERVE_CPU_LM_HEAD``, else
    ``auto``; ``ValueError`` names a bad one."""
    requested = (requested or os.environ.get(HEAD_ENV) or "auto").lower()
    if requested not in HEAD_PATHS:
        raise ValueError(f"{HEAD_ENV}={requested!r}: expected one of {', '.join(HEAD_PATHS)}")
    return requested


def head_kernel(plan: LinearPlan, weight: torch.Tensor, requested: str | None = None) -> str | None:
    """The one-pass kernel a packed plan's LM head ``weight`` (bf16 ``[V, H]``) goes to instead
    of oneDNN (``cpu_paged.amx_linear`` / ``amx_argmax``: the weight streamed once for all rows,
    a greedy step's argmax fused in): ``"amx"`` (tiles), ``"avx512"`` (AVX512-BF16 dot
    products), or ``None`` (oneDNN). ``requested`` (default: ``PDSERVE_CPU_LM_HEAD``, else
    ``auto``): ``auto`` takes AMX where it runs, else AVX512-BF16 where it was built; ``amx`` and
    ``avx512`` insist; ``onednn`` declines."""
    requested = head_request(requested)
    if requested == "onednn" or not plan.packed:
        return None
    from kernels import cpu_paged

    shaped = weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % 32 == 0
    amx = shaped and cpu_paged.amx_linear_available()
    dp = shaped and cpu_paged.dp_linear_available()
    if requested == "amx" and not amx:
        raise ValueError(f"{HEAD_ENV}=amx: no AMX tiles here, or the head is not bf16 [V, 32k]")
    if requested == "avx512" and not dp:
        raise ValueError(
            f"{HEAD_ENV}=avx512: no AVX512-BF16 here, or the head is not bf16 [V, 32k]"
        )
    if requested == "avx512" or (requested == "auto" and not amx and dp):
        return "avx512"
    return "amx" if amx else None


def onednn_bf16() -> bool:
    """Whether this torch build and CPU run oneDNN's bf16 primitives at all (AVX512 at least;
    native bf16 dot products are what the ``auto`` plan asks for)."""
    return bool(
        torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` in oneDNN's blocked layout for any row count (an opaque
    ``torch._mkldnn`` tensor of the same shape and dtype)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T + bias`` for a weight from ``pack``; ``x`` is ``[M, K]``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
    small=None,
    tiles_n: int | None = None,
) -> torch.Tensor:
    """One projection: with ``tiles_n`` (the output width) the AMX projection on
    ``cpu_paged.amx_pack``'s layout, else the packed primitive when the weight is packed, else
    the small-batch kernel where it applies (``small`` returns ``None`` where it does not),
    else ``F.linear``."""
    if packed is not None and tiles_n is not None:
        from kernels import cpu_paged

        y = cpu_paged.amx_proj(x.reshape(-1, x.shape[-1]), packed, tiles_n)
        y = y.reshape(*x.shape[:-1], tiles_n)
        return y if bias is None else y + bias
    if packed is not None:
        return packed_linear(x, packed, bias)
    assert weight is not None
    if small is not None:
        y = small(x, weight)
        if y is not None:
            return y if bias is None else y + bias
    return F.linear(x, weight, bias)
