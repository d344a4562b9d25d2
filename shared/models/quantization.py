"""Quantized linear layers of the model and the reading of quantized checkpoints.

``QuantizationConfig`` (``shared/config.py``) names the scheme. At load, every projection the
scheme covers (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) becomes a
:class:`QuantLinear`; the checkpoint's tensors of each Hugging Face linear (``q_proj.qweight``,
``q_proj.scales``...) are collected, read into the canonical form of ``kernels/quant.py``, fused
along N where the model fuses them, and repacked once for the device's kernel. The embedding and
the LM head stay in the model dtype (no supported format quantizes them). A linear the checkpoint
stores dense (a plain ``weight``, e.g. AWQ's ``modules_to_not_convert``) stays a dense ``Linear``.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from kernels import quant
from kernels.quant import PreparedWeight, QuantFormatError, QuantizedWeight
from shared.config import QuantizationConfig

logger = logging.getLogger(__name__)

QUANT_SUFFIXES = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": (
        "weight_packed",
        "weight_scale",
        "weight_shape",
        "weight_zero_point",
        "weight_g_idx",
    ),
    "int8": ("weight",),
    "fp8": ("weight", "weight_scale", "input_scale"),  # input_scale: unused (weight-only)
}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class QuantLinear(nn.Module):
    """A linear layer over a prepared quantized weight (``kernels.quant.quant_linear``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool | torch.Tensor) -> None:
        """``bias``: whether there is one, or the replaced layer's bias, whose dtype and device
        it takes (the model is cast and placed before the projections are replaced: an fp32
        CPU bias turned a bf16 model's q/k/v into fp32, which the next quantized matmul
        refused, on every quantized Qwen2)."""
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        like = bias if isinstance(bias, torch.Tensor) else None
        self.bias = (
            nn.Parameter(
                torch.empty(
                    out_features,
                    dtype=like.dtype if like is not None else None,
                    device=like.device if like is not None else None,
                )
            )
            if bias is not False and bias is not None
            else None
        )
        self.prepared: PreparedWeight | None = None

    def set_weight(self, pw: PreparedWeight) -> None:
        if (pw.out_features, pw.in_features) != (self.out_features, self.in_features):
            raise QuantFormatError(
                f"quantized weight is [{pw.out_features}, {pw.in_features}], the layer is "
                f"[{self.out_features}, {self.in_features}]"
            )
        self.prepared = pw
        for name, t in pw.tensors.items():  # buffers: .to() and state_dict see them
            self.register_buffer(f"q_{name}", t, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.prepared is not None, "QuantLinear used before its weight was loaded"
        return quant.quant_linear(x, self.prepared, self.bias)

    def extra_repr(self) -> str:
        path = self.prepared.path if self.prepared else "unloaded"
        return f"in={self.in_features}, out={self.out_features}, path={path}"


def hf_linear_name(hf_name: str) -> tuple[str, str] | None:
    """``model.layers.0.self_attn.q_proj.qweight`` -> (``layers.0.self_attn.q_proj``,
    ``qweight``) for a projection weight tensor; None for anything else."""
    name = hf_name[len("model.") :] if hf_name.startswith("model.") else hf_name
    if not name.startswith("layers."):
        return None
    base, _, suffix = name.rpartition(".")
    proj = base.rpartition(".")[2]
    if proj not in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        return None
    return base, suffix


def skipped(qc: QuantizationConfig, hf_base: str) -> bool:
    """Whether the scheme leaves this linear dense: AWQ's ``modules_to_not_convert`` match as
    substrings of the module name (as AutoAWQ and transformers do), compressed-tensors'
    ``ignore`` entries as full names or ``re:`` patterns (``re.match``, as the library does)."""
    full = hf_base if hf_base.startswith("model.") else f"model.{hf_base}"
    for s in qc.skip:
        if s.startswith("re:"):
            if re.match(s[3:], full):
                return True
        elif qc.method == "compressed-tensors":
            if s in (full, hf_base):
                return True
        elif s and s in full:
            return True
    return False


def read_linear(
    qc: QuantizationConfig, tensors: dict[str, torch.Tensor], name: str
) -> QuantizedWeight | quant.Fp8Weight:
    """The canonical weight of one Hugging Face linear from its checkpoint tensors."""
    try:
        if qc.method == "int8":
            return quant.quantize_int8_per_channel(tensors["weight"])
        if qc.method == "fp8":
            return quant.from_fp8_checkpoint(tensors["weight"], tensors.get("weight_scale"))
        if qc.method == "awq":
            return quant.from_awq(
                tensors["qweight"], tensors["qzeros"], tensors["scales"], qc.group_size
            )
        if qc.method == "gptq":
            return quant.from_gptq(
                tensors["qweight"],
                tensors["qzeros"],
                tensors["scales"],
                tensors.get("g_idx"),
                qc.bits,
                qc.group_size,
                v2=qc.checkpoint_format == "gptq_v2",
            )
        if qc.method == "compressed-tensors":
            return quant.from_compressed_tensors(
                tensors["weight_packed"],
                tensors["weight_scale"],
                tensors.get("weight_shape"),
                tensors.get("weight_zero_point"),
                tensors.get("weight_g_idx"),
                qc.bits,
                qc.group_size,
            )
    except KeyError as e:
        raise QuantFormatError(f"{name}: missing {qc.method} tensor {e.args[0]!r}") from e
    except QuantFormatError as e:
        raise QuantFormatError(f"{name}: {e}") from e
    raise QuantFormatError(f"unknown method {qc.method}")


def is_quant_tensor(qc: QuantizationConfig, suffix: str) -> bool:
    return suffix in QUANT_SUFFIXES[qc.method]


def install(model: nn.Module, qc: QuantizationConfig, dense_linears: set[str]) -> list[str]:
    """Replace the projections the checkpoint quantizes with ``QuantLinear`` (before loading);
    ``dense_linears``: our module names the checkpoint stores dense. Returns the replaced names."""
    replaced = []
    for name, module in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        if leaf not in PROJECTIONS or name in dense_linears:
            continue
        assert isinstance(module, nn.Linear)
        ql = QuantLinear(
            module.in_features,
            module.out_features,
            module.bias if module.bias is not None else False,
        )
        parent = model.get_submodule(name.rpartition(".")[0])
        setattr(parent, leaf, ql)
        replaced.append(name)
    return replaced


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter and packed buffer except an
    untied embedding table (a step gathers only its batch's rows of it)."""
    embed = getattr(model, "embed_tokens", None)
    skip = (
        {id(embed.weight)}
        if embed is not None and getattr(model, "lm_head", 1) is not None
        else set()
    )
    total = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.prepared is not None:
            total += m.prepared.nbytes
        packed = getattr(m, "packed", None)
        if packed is not None:  # a dense weight reordered for the CPU (kernels/cpu_linear.py)
            total += packed.numel() * packed.element_size()
    # the LM head in the one-pass projection's layout (kernels/cpu_paged.py), else oneDNN's copy
    # of a tied one: a step reads that, and a tied head's table only for its batch's rows
    head = getattr(model, "head_packed", None)
    if head is None:
        head = getattr(model, "tied_packed", None)
    if head is not None:
        total += head.numel() * head.element_size()
        if embed is not None and getattr(model, "lm_head", 1) is None:
            total -= embed.weight.numel() * embed.weight.element_size()
    return total
