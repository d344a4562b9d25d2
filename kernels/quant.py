"""Weight-only quantized linears: the on-disk packings and the matmuls over packed weights.

Every format is brought to one canonical form, :class:`QuantizedWeight`: unsigned integer codes
``qweight [N, K]`` (N output channels, K input features, values ``0 .. 2**bits - 1``), and per
group of ``group_size`` consecutive input features a scale and a zero point, ``scales`` and
``zeros`` ``[G, N]``, so that ``w[n, k] = (qweight[n, k] - zeros[k // g, n]) * scales[k // g, n]``.
Act-order checkpoints (GPTQ ``desc_act``, compressed-tensors ``actorder``) quantize the input
features in a permuted order; ``perm`` holds it: canonical column ``j`` is input feature
``perm[j]``, and the matmul gathers ``x[:, perm]`` first, so the groups stay contiguous.

Packings (what AutoAWQ, AutoGPTQ / GPTQModel and llm-compressor write; tensors per linear):

* ``awq`` (GEMM version): ``qweight`` int32 ``[K, N / 8]`` and ``qzeros`` int32 ``[K / g, N / 8]``,
  eight 4-bit codes per word along N in the order ``AWQ_ORDER``; ``scales`` ``[K / g, N]``.
* ``gptq`` (``checkpoint_format`` ``gptq``, the v1 layout): ``qweight`` int32 ``[K / 8, N]``, codes
  packed along K from the low bits up; ``qzeros`` int32 ``[K / g, N / 8]`` packed along N and
  stored minus one (``z - 1``, AutoGPTQ's convention that v1 loaders undo); ``scales``
  ``[K / g, N]``; ``g_idx`` int32 ``[K]``: the group of each input feature. ``gptq_v2`` stores
  the zero points as they are.
* ``compressed-tensors`` ``pack-quantized``: ``weight_packed`` int32 ``[N, K * bits / 32]`` packed
  along K from the low bits up, the signed codes offset by ``2**(bits - 1)``; ``weight_scale``
  ``[N, K / g]`` (``[N, 1]`` per channel); ``weight_zero_point`` (asymmetric only) signed, packed
  along N, ``[N * bits / 32, K / g]``; ``weight_shape`` ``[2]``; ``weight_g_idx`` with actorder.

The matmuls: :func:`prepare` turns a canonical weight into the kernel's layout once, at load
(:class:`PreparedWeight` says which path it took), and :func:`quant_linear` runs it. On the CPU
torch's own packed kernels serve bf16 / fp16 activations (``_weight_int8pack_mm`` for 8-bit
per-channel, ``_weight_int4pack_mm_for_cpu`` for 4-bit groups), or the C++ kernels of
``kernels/csrc/quant_cpu.cpp`` (AVX512-BF16) where they are faster; everything else (fp32,
CUDA, shapes the kernels refuse) dequantizes tile-free into the activation dtype and calls
``F.linear``. Kernels import nothing from the project.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i]
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's CPU int4 kernel accepts


class QuantFormatError(ValueError):
    """Packed tensors that do not fit their format (shape, dtype, group layout)."""


@dataclass
class QuantizedWeight:
    """One linear's weight in canonical form (see the module docstring)."""

    bits: int
    group_size: int  # == K for per-channel scales
    qweight: torch.Tensor  # [N, K] uint8 codes (int16 for 8-bit asymmetric is not needed)
    scales: torch.Tensor  # [G, N] float
    zeros: torch.Tensor  # [G, N] float (integer-valued): the code of 0.0
    perm: torch.Tensor | None = None  # [K] int64, act order

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def symmetric(self) -> bool:
        return bool((self.zeros == float(1 << (self.bits - 1))).all())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense ``[N, K]`` weight in input-feature order, computed in fp32."""
        n, k = self.qweight.shape
        g = self.group_size
        q = self.qweight.float().view(n, k // g, g)
        w = (q - self.zeros.t().float().unsqueeze(-1)) * self.scales.t().float().unsqueeze(-1)
        w = w.reshape(n, k)
        if self.perm is not None:
            out = torch.empty_like(w)
            out[:, self.perm] = w
            w = out
        return w.to(dtype)

    @staticmethod
    def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Fuse shards along N (q/k/v into qkv, gate/up into gate_up)."""
        first = parts[0]
        for p in parts[1:]:
            if (p.bits, p.group_size, p.in_features) != (
                first.bits,
                first.group_size,
                first.in_features,
            ):
                raise QuantFormatError("fused shards differ in bits, group size or K")
            if (p.perm is None) != (first.perm is None) or (
                p.perm is not None
                and first.perm is not None
                and not torch.equal(p.perm, first.perm)
            ):
                raise QuantFormatError(
                    "fused shards (q/k/v or gate/up) have different act-order g_idx"
                )
        return QuantizedWeight(
            bits=first.bits,
            group_size=first.group_size,
            qweight=torch.cat([p.qweight for p in parts], 0),
            scales=torch.cat([p.scales for p in parts], 1),
            zeros=torch.cat([p.zeros for p in parts], 1),
            perm=first.perm,
        )


@dataclass
class Fp8Weight:
    """fp8 (e4m3) weights ``[N, K]`` with one fp32 scale per output channel ``[N]``:
    ``w = weight.float() * scale[:, None]``."""

    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [N]
    perm: torch.Tensor | None = None  # never set (no act order for fp8); kept for the API
    bits: int = 8

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.scale.float().unsqueeze(1)).to(dtype)

    @staticmethod
    def concat(parts: list[Fp8Weight]) -> Fp8Weight:
        return Fp8Weight(
            torch.cat([p.weight for p in parts], 0), torch.cat([p.scale for p in parts], 0)
        )


FP8_MAX = 448.0  # largest finite e4m3fn


def quantize_fp8_per_channel(w: torch.Tensor) -> Fp8Weight:
    """e4m3 weights with a per-output-channel scale (``--quantization fp8`` at load)."""
    scale = w.float().abs().amax(1).clamp_min(1e-12) / FP8_MAX
    q = (w.float() / scale.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(q, scale)


def from_fp8_checkpoint(weight: torch.Tensor, weight_scale: torch.Tensor | None) -> Fp8Weight:
    """An fp8 checkpoint's linear (AutoFP8 / llm-compressor ``weight`` in e4m3 and its
    ``weight_scale``: a scalar per tensor or one per output channel); a dense ``weight``
    (a checkpoint that left the layer unquantized) is quantized here."""
    if weight.dtype != torch.float8_e4m3fn:
        return quantize_fp8_per_channel(weight)
    n = int(weight.shape[0])
    if weight_scale is None:
        raise QuantFormatError("fp8 weight without weight_scale")
    s = weight_scale.float().flatten()
    if s.numel() == 1:
        s = s.expand(n).clone()
    if s.numel() != n:
        raise QuantFormatError(f"weight_scale has {s.numel()} values for {n} output channels")
    return Fp8Weight(weight, s)


# ---- bit packing ------------------------------------------------------------------------


def pack_along_last(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``codes [R, C]`` into int32 ``[R, C * bits / 32]``, low bits first."""
    per = 32 // bits
    r, c = codes.shape
    if c % per:
        raise QuantFormatError(f"{c} columns do not pack into int32 words of {per} codes")
    v = codes.to(torch.int64).view(r, c // per, per)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    word = (v << shifts).sum(-1)
    return _to_int32(word)


def unpack_along_last(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_along_last`: int32 ``[R, W]`` -> uint8 codes ``[R, W * 32 / bits]``."""
    if packed.dtype != torch.int32:
        raise QuantFormatError(f"packed weights must be int32, got {packed.dtype}")
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(-1) >> shifts) & mask
    return codes.reshape(packed.shape[0], -1).to(torch.uint8)


def _to_int32(word: torch.Tensor) -> torch.Tensor:
    word = torch.where(word >= (1 << 31), word - (1 << 32), word)
    return word.to(torch.int32)


def awq_pack(codes: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing: codes ``[R, C]`` -> int32 ``[R, C / 8]`` in ``AWQ_ORDER``."""
    r, c = codes.shape
    if c % 8:
        raise QuantFormatError(f"AWQ packs 8 columns per word; got {c}")
    order = torch.tensor(AWQ_ORDER)
    v = codes.view(r, c // 8, 8)[:, :, order]  # nibble i <- column AWQ_ORDER[i]
    return pack_along_last(v.reshape(r, c), 4)


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, W]`` -> codes ``[R, 8 W]`` in natural column order."""
    nib = unpack_along_last(packed, 4).view(packed.shape[0], -1, 8)
    inverse = torch.argsort(torch.tensor(AWQ_ORDER))
    return nib[:, :, inverse].reshape(packed.shape[0], -1)


# ---- format readers: checkpoint tensors of one linear -> canonical ----------------------


def _group_count(k: int, group_size: int) -> int:
    g = k if group_size in (-1, 0) else group_size
    if k % g:
        raise QuantFormatError(f"K={k} is not a multiple of the group size {g}")
    return g


def from_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> QuantizedWeight:
    k = int(qweight.shape[0])
    g = _group_count(k, group_size)
    codes = awq_unpack(qweight)  # [K, N]
    n = int(codes.shape[1])
    z = awq_unpack(qzeros)  # [K / g, N]
    if tuple(z.shape) != (k // g, n) or tuple(scales.shape) != (k // g, n):
        raise QuantFormatError(
            f"AWQ qzeros {tuple(qzeros.shape)} / scales {tuple(scales.shape)} do not match "
            f"qweight {tuple(qweight.shape)} with group size {g}"
        )
    return QuantizedWeight(4, g, codes.t().contiguous(), scales.float(), z.float())


def from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    v2: bool = False,
) -> QuantizedWeight:
    if bits not in (4, 8):
        raise QuantFormatError(f"GPTQ with {bits} bits is not supported (4 or 8)")
    codes = unpack_along_last(qweight.t().contiguous(), bits).t()  # [K, N]
    k, n = int(codes.shape[0]), int(codes.shape[1])
    g = _group_count(k, group_size)
    z = unpack_along_last(qzeros, bits).float()  # [G, N]
    if not v2:
        z = (z + 1) % (1 << bits)  # v1 stores z - 1 (wrapping)
    ng = k // g
    if tuple(z.shape) != (ng, n) or tuple(scales.shape) != (ng, n):
        raise QuantFormatError(
            f"GPTQ qzeros {tuple(qzeros.shape)} / scales {tuple(scales.shape)} do not match "
            f"qweight {tuple(qweight.shape)} with group size {g}"
        )
    perm = _act_order(g_idx, k, g)
    qw = codes.t().contiguous()
    if perm is not None:
        qw = qw[:, perm].contiguous()
    return QuantizedWeight(bits, g, qw, scales.float(), z, perm)


def _act_order(g_idx: torch.Tensor | None, k: int, g: int) -> torch.Tensor | None:
    """The permutation that makes groups contiguous, or None when ``g_idx`` is the identity
    grouping ``k // g``."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64).flatten()
    if g_idx.numel() != k:
        raise QuantFormatError(f"g_idx has {g_idx.numel()} entries, expected {k}")
    if torch.equal(g_idx, torch.arange(k) // g):
        return None
    counts = torch.bincount(g_idx, minlength=k // g)
    if counts.numel() != k // g or not bool((counts == g).all()):
        raise QuantFormatError("g_idx does not assign exactly group_size features to each group")
    return torch.argsort(g_idx, stable=True)


def from_compressed_tensors(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: torch.Tensor | None,
    weight_zero_point: torch.Tensor | None,
    weight_g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> QuantizedWeight:
    if bits not in (4, 8):
        raise QuantFormatError(f"pack-quantized with {bits} bits is not supported (4 or 8)")
    n = int(weight_packed.shape[0])
    codes = unpack_along_last(weight_packed, bits)  # offset codes, [N, >= K]
    k = int(weight_shape[1]) if weight_shape is not None else int(codes.shape[1])
    if weight_shape is not None and int(weight_shape[0]) != n:
        raise QuantFormatError(f"weight_shape {weight_shape.tolist()} does not match N={n}")
    codes = codes[:, :k]
    g = _group_count(k, group_size)
    ng = k // g
    if tuple(weight_scale.shape) != (n, ng):
        raise QuantFormatError(
            f"weight_scale {tuple(weight_scale.shape)} does not match [{n}, {ng}] (group size {g})"
        )
    offset = float(1 << (bits - 1))
    if weight_zero_point is None:
        zeros = torch.full((ng, n), offset)
    else:  # signed zero points packed along N (dim 0)
        # packed like the codes (offset by 2**(bits - 1)), so they are already in code units
        zp = unpack_along_last(weight_zero_point.t().contiguous(), bits).t()[:n]  # [N, G]
        zeros = zp.float().t().contiguous()
    perm = _act_order(weight_g_idx, k, g)
    qw = codes if perm is None else codes[:, perm]
    return QuantizedWeight(bits, g, qw.contiguous(), weight_scale.t().float(), zeros, perm)


# ---- writers (the tiny-model quantizer) and round-to-nearest quantization ----------------


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int, symmetric: bool) -> QuantizedWeight:
    """Round-to-nearest quantization of a dense ``[N, K]`` weight (per group of K)."""
    n, k = w.shape
    g = _group_count(k, group_size)
    wg = w.float().view(n, k // g, g)
    qmax = (1 << bits) - 1
    if symmetric:
        half = 1 << (bits - 1)
        scale = wg.abs().amax(-1).clamp_min(1e-8) / (half - 0.5 if bits == 4 else half - 1)
        zero = torch.full_like(scale, float(half))
    else:
        lo = wg.amin(-1).clamp_max(0)
        hi = wg.amax(-1).clamp_min(0)
        scale = ((hi - lo) / qmax).clamp_min(1e-8)
        zero = torch.round(-lo / scale).clamp(0, qmax)
    scale = scale.to(torch.float16).float()  # the formats store fp16/bf16 scales
    q = torch.round(wg / scale.unsqueeze(-1)) + zero.unsqueeze(-1)
    q = q.clamp(0, qmax).to(torch.uint8).view(n, k)
    return QuantizedWeight(bits, g, q, scale.t().contiguous(), zero.t().contiguous())


def quantize_int8_per_channel(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-channel int8 (on-the-fly ``--quantization int8``)."""
    n, k = w.shape
    scale = (w.float().abs().amax(1).clamp_min(1e-12) / 127.0).unsqueeze(0)  # [1, N]
    q = torch.round(w.float() / scale.t()).clamp(-127, 127) + 128
    return QuantizedWeight(8, k, q.to(torch.uint8), scale, torch.full_like(scale, 128.0))


def to_awq(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    if qw.bits != 4 or qw.perm is not None:
        raise QuantFormatError("AWQ is 4-bit without act order")
    return {
        "qweight": awq_pack(qw.qweight.t().contiguous()),
        "qzeros": awq_pack(qw.zeros.to(torch.uint8)),
        "scales": qw.scales.to(torch.float16),
    }


def to_gptq(qw: QuantizedWeight, g_idx: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """v1 layout. ``g_idx`` (act order): the group of each input feature; ``qw`` is then in
    input-feature order with the groups given by ``g_idx`` (see :func:`quantize_rtn_act_order`)."""
    k = qw.in_features
    zeros_v1 = (qw.zeros.to(torch.int64) - 1) % (1 << qw.bits)
    return {
        "qweight": pack_along_last(qw.qweight, qw.bits).t().contiguous(),
        "qzeros": pack_along_last(zeros_v1, qw.bits),
        "scales": qw.scales.to(torch.float16),
        "g_idx": (g_idx if g_idx is not None else torch.arange(k) // qw.group_size).to(torch.int32),
    }


def to_compressed_tensors(qw: QuantizedWeight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """pack-quantized; symmetric only (what W4A16 / W8A16 presets write)."""
    if not qw.symmetric or qw.perm is not None:
        raise QuantFormatError("the writer emits symmetric schemes without act order")
    return {
        "weight_packed": pack_along_last(qw.qweight, qw.bits),
        "weight_scale": qw.scales.t().contiguous().to(dtype),
        "weight_shape": torch.tensor([qw.out_features, qw.in_features], dtype=torch.int64),
    }


def quantize_rtn_act_order(
    w: torch.Tensor, bits: int, group_size: int, seed: int
) -> tuple[QuantizedWeight, torch.Tensor]:
    """Quantize with a (seeded) act order the way GPTQ ``desc_act`` lays it out: input
    features are visited in a permuted order, consecutive ``group_size`` of them form a group;
    returns codes in input-feature order (``perm`` None) with the ``g_idx`` to store."""
    n, k = w.shape
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group_size
    permuted = quantize_rtn(w[:, order], bits, group_size, symmetric=True)
    codes = torch.empty_like(permuted.qweight)
    codes[:, order] = permuted.qweight
    qw = QuantizedWeight(bits, group_size, codes, permuted.scales, permuted.zeros)
    return qw, g_idx


# ---- the matmul ---------------------------------------------------------------------------


@dataclass
class PreparedWeight:
    """A quantized weight in its kernel's layout. ``path`` names the kernel for the log."""

    path: str
    out_features: int
    in_features: int
    dtype: torch.dtype
    tensors: dict[str, torch.Tensor]
    perm: torch.Tensor | None
    small_m: int  # rows up to which the packed kernel runs; dequantize + F.linear above
    source: QuantizedWeight | None = None  # kept only for the dequantize fallback
    bits: int = 0
    group_size: int = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _cpu_int4_ok(qw: QuantizedWeight) -> bool:
    return qw.bits == 4 and qw.group_size in INT4_GROUP_SIZES and qw.in_features % 32 == 0


def prepare(
    qw: QuantizedWeight | Fp8Weight,
    device: torch.device,
    dtype: torch.dtype,
    cpp: object = None,
    kernels: bool = True,
) -> PreparedWeight:
    """Repack ``qw`` once for ``device`` and activation ``dtype``.

    ``cpp`` is the C++ extension of ``kernels/quant_cpu.py`` when it built (AVX512-BF16), else
    None. Paths: ``cpp-w8`` / ``cpp-w4`` (C++), ``torch-int8pack`` / ``torch-int4pack`` (torch's
    CPU kernels), ``dequant`` (dense fallback: codes + scales kept, dequantized per call; the
    path of every device but the CPU, and of every call when ``kernels`` is False).
    """
    n, k = qw.out_features, qw.in_features
    if isinstance(qw, Fp8Weight):
        t = {"w": qw.weight.to(device), "scale": qw.scale.float().to(device)}
        cuda = kernels and device.type == "cuda" and _triton_quant() is not None
        path = "triton-fp8" if cuda else "fp8"
        return PreparedWeight(path, n, k, dtype, t, None, 1 << 62, None, 8, k)
    perm = None if qw.perm is None else qw.perm.to(device)
    low_precision = dtype in (torch.bfloat16, torch.float16)
    meta = {"bits": qw.bits, "group_size": qw.group_size}
    tq = _triton_quant() if kernels and device.type == "cuda" else None
    if tq is not None and tq.supports(qw):
        tensors = tq.prepare(qw, device)
        return PreparedWeight(f"triton-w{qw.bits}", n, k, dtype, tensors, perm, 1 << 62, **meta)
    if kernels and device.type == "cpu" and low_precision:
        if cpp is not None and dtype == torch.bfloat16:
            from kernels import quant_cpu

            prepared = quant_cpu.prepare(qw, cpp)
            if prepared is not None:
                return PreparedWeight(
                    prepared[0], n, k, dtype, prepared[1], perm, quant_cpu.MAX_M, None, **meta
                )
        if qw.bits == 8 and qw.group_size == k and qw.symmetric:
            q = (qw.qweight.to(torch.int16) - 128).to(torch.int8).contiguous()
            scale = qw.scales.reshape(n).to(dtype).contiguous()
            # no source kept: the dequantize fallback reads q and scale themselves
            return PreparedWeight(
                "torch-int8pack", n, k, dtype, {"q": q, "scale": scale}, perm, 8, None, **meta
            )
        if _cpu_int4_ok(qw):
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                qw.qweight.to(torch.int32).contiguous(), 1
            )
            s = qw.scales.float()
            sz = torch.stack([s, (8.0 - qw.zeros.float()) * s], -1).to(dtype).contiguous()
            return PreparedWeight(
                "torch-int4pack", n, k, dtype, {"packed": packed, "sz": sz}, perm, 16, qw, **meta
            )
    moved = QuantizedWeight(
        qw.bits,
        qw.group_size,
        qw.qweight.to(device),
        qw.scales.to(device, dtype),
        qw.zeros.to(device, dtype),
        None,
    )
    return PreparedWeight(
        "dequant",
        n,
        k,
        dtype,
        {"qweight": moved.qweight, "scales": moved.scales, "zeros": moved.zeros},
        perm,
        0,
        moved,
        **meta,
    )


def _triton_quant():  # type: ignore[no-untyped-def]
    """``kernels.triton_quant`` where Triton imports, else None."""
    try:
        from kernels import triton_quant
    except ImportError:
        return None
    return triton_quant


def _dequant(pw: PreparedWeight) -> torch.Tensor:
    if pw.path == "torch-int8pack":  # (code - 128) * scale, the same values as below
        t = pw.tensors
        return t["q"].to(pw.dtype) * t["scale"].unsqueeze(1)
    src = pw.source
    assert src is not None
    n, k = pw.out_features, pw.in_features
    g = src.group_size
    dt = pw.dtype
    q = src.qweight.to(dt).view(n, k // g, g)
    z = src.zeros.to(dt).t().unsqueeze(-1)
    s = src.scales.to(dt).t().unsqueeze(-1)
    return ((q - z) * s).view(n, k)


def quant_linear(x: torch.Tensor, pw: PreparedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x [M, K]`` with ``W`` the prepared quantized weight."""
    if pw.perm is not None:
        x = x.index_select(-1, pw.perm)
    m = x.shape[0]
    t = pw.tensors
    if pw.path == "fp8":  # dequantize per call (CPU and any device without Triton)
        w = (t["w"].float() * t["scale"].unsqueeze(1)).to(x.dtype)
        return F.linear(x, w, bias)
    if pw.path == "triton-fp8":
        from kernels import triton_quant

        y = triton_quant.fp8_matmul(x, t["w"], t["scale"])
        return y if bias is None else y + bias
    if m <= pw.small_m:
        if pw.path == "torch-int8pack":
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), t["q"], t["scale"])
        elif pw.path == "torch-int4pack":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.contiguous(), t["packed"], pw.group_size, t["sz"]
            )
        elif pw.path.startswith("triton"):
            from kernels import triton_quant

            y = triton_quant.quant_matmul(x, t, pw.bits, pw.group_size, pw.out_features)
        else:
            from kernels import quant_cpu

            y = quant_cpu.run(pw, x)
        return y if bias is None else y + bias
    return F.linear(x, _dequant(pw), bias)
