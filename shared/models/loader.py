"""Load a Hugging Face safetensors checkpoint into the project's model implementation."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from types import ModuleType

import torch

from kernels import cpu_linear
from kernels.quant import QuantFormatError
from shared.config import ConfigError, ModelConfig, QuantizationConfig
from shared.models.llama import Linear, LlamaForCausalLM, fused_param_name
from shared.models.quantization import (
    FUSED,
    QuantLinear,
    hf_linear_name,
    install,
    is_quant_tensor,
    read_linear,
    skipped,
    weight_bytes,
)
from shared.models.sharding import WHOLE, Shard

logger = logging.getLogger(__name__)

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}


class ModelLoadError(RuntimeError):
    """The checkpoint cannot be loaded: missing, corrupt or mismatched weight files."""


INDEX_FILE = "model.safetensors.index.json"


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files that hold ``model_dir``'s Hugging Face weights: exactly those its
    ``model.safetensors.index.json`` names (as transformers and vLLM read it), else every
    ``*.safetensors`` but a Mistral-format ``consolidated*.safetensors`` beside other files.
    Mistral repos ship that file (other tensor names) next to the HF shards: globbing took it
    and the load failed on its names."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError) as e:
            raise ModelLoadError(f"cannot read {index}: {e}") from e
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no weight_map")
        files = [root / name for name in sorted(set(map(str, weight_map.values())))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f.name}, named by {index}, is missing")
        return files
    files = sorted(root.glob("*.safetensors"))
    hf = [f for f in files if not f.name.startswith("consolidated")]
    return hf or files


def load_model(
    cfg: ModelConfig, device: str, backend: ModuleType, shard: Shard = WHOLE
) -> LlamaForCausalLM:
    """Build the model for ``cfg`` on ``device`` in ``cfg.dtype`` and load its weights (this
    rank's ``shard`` of them: shared/models/sharding.py)."""
    from safetensors import SafetensorError, safe_open

    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise ModelLoadError(f"no implementation for {cfg.architecture}")
    dtype = getattr(torch, cfg.dtype)
    files = weight_files(cfg.path)
    if not files:
        raise ModelLoadError(f"no *.safetensors weight files in {cfg.path}")
    with torch.device("meta"):
        model = cls(cfg, backend, shard)
    # storage for every parameter, uninitialized, in the model's dtype (floating ones; the
    # weights overwrite it). Not ``to_empty``: its empty_like of a meta tensor goes through
    # torch's Python refs, which import sympy and torch's symbolic shapes (half a second of
    # every worker's start-up, for nothing).
    model = model._apply(
        lambda t: torch.empty(
            t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device
        )
    )
    # Buffers (rotary tables) were on meta: rebuild them on the device in fp32.
    from shared.models.llama import Rotary, rope_settings, rotary_positions

    fresh = Rotary(cfg.head_dim, rotary_positions(cfg), *rope_settings(cfg.hf_config)).to(device)
    model.rotary.cos, model.rotary.sin = fresh.cos, fresh.sin
    qc = cfg.quantization
    quantized: dict[str, set[str]] = {}  # quantized HF linear -> its tensors in the checkpoint
    if qc is not None:
        quantized = _install_quantized(model, qc, files)
    collected: dict[str, dict[str, torch.Tensor]] = {}
    paths: Counter[str] = Counter()
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    shard_sizes = _shard_sizes(cfg, shard)
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for hf_name in f.keys():  # noqa: SIM118 - safe_open has keys(), no __iter__
                    if "rotary_emb.inv_freq" in hf_name:
                        continue
                    lin = hf_linear_name(hf_name) if qc is not None else None
                    if lin is not None and lin[0] in quantized and lin[1] != "bias":
                        if not is_quant_tensor(qc, lin[1]):  # type: ignore[arg-type]
                            raise ModelLoadError(
                                f"unexpected weight {hf_name!r} in {path.name} for {qc.method}"  # type: ignore[union-attr]
                            )
                        collected.setdefault(lin[0], {})[lin[1]] = f.get_tensor(hf_name)
                        continue
                    full_name, part = fused_param_name(hf_name)
                    if full_name == "lm_head.weight" and model.tie_word_embeddings:
                        continue  # tied
                    if not _known(full_name, cfg):
                        raise ModelLoadError(f"unexpected weight {hf_name!r} in {path.name}")
                    name = model.local_name(full_name)
                    if name is None:
                        continue  # another pipeline stage's
                    param = params.get(name)
                    if param is None and hf_name.endswith(".bias"):
                        # GPTQ tools write an all-zero bias for every linear: nothing to add
                        if not f.get_tensor(hf_name).any():
                            continue
                        raise ModelLoadError(
                            f"non-zero bias {hf_name!r} in {path.name}: this "
                            f"{cfg.architecture} has no bias there"
                        )
                    if param is None:
                        raise ModelLoadError(f"unexpected weight {hf_name!r} in {path.name}")
                    tensor = model.shard_tensor(name, part, f.get_tensor(hf_name))
                    _copy_into(param, tensor, part, shard_sizes, hf_name)
                    loaded.add(name if part is None else f"{name}#{part}")
            if qc is not None:  # finish the linears whose tensors have all been read
                paths += _finish_quantized(model, qc, collected, quantized, device, dtype)
        except SafetensorError as e:
            raise ModelLoadError(f"corrupt safetensors file {path}: {e}") from e
        except QuantFormatError as e:
            raise ModelLoadError(f"{cfg.path}: {e}") from e
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {path}: {e}") from e
    if qc is not None:
        try:  # what is still incomplete: read_linear names the tensor it lacks
            paths += _finish_quantized(model, qc, collected, None, device, dtype)
        except QuantFormatError as e:
            raise ModelLoadError(f"{cfg.path}: {e}") from e
        unloaded = [
            n for n, m in model.named_modules() if isinstance(m, QuantLinear) and m.prepared is None
        ]
        if unloaded or collected:
            raise ModelLoadError(
                f"checkpoint {cfg.path} lacks {qc.method} weights of "
                f"{', '.join((unloaded or sorted(collected))[:3])}"
            )
        logger.info(
            "quantization %s: %d linears (%s); weights %.1f MiB",
            qc.describe(),
            sum(paths.values()),
            ", ".join(f"{n} x {p}" for p, n in sorted(paths.items())),
            weight_bytes(model) / (1 << 20),
        )
    missing = []
    for name in params:
        parts = (
            3
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias")
            else (2 if "gate_up_proj" in name else 1)
        )
        keys = [name] if parts == 1 else [f"{name}#{i}" for i in range(parts)]
        missing += [k for k in keys if k not in loaded]
    if missing:
        raise ModelLoadError(
            f"checkpoint {cfg.path} lacks weights: {', '.join(missing[:5])}"
            + (" ..." if len(missing) > 5 else "")
        )
    model.eval()
    del params  # the packed weights replace the plain ones: hold no reference to them
    _prepack(model, dtype, device)
    return model


def _prepack(model: LlamaForCausalLM, dtype: torch.dtype, device: str) -> None:
    """Reorder the dense projections' weights for the CPU's matrix units when the plan says so
    (``kernels/cpu_linear.py``), and log the path every kind of linear takes."""
    try:
        plan = cpu_linear.plan_for(dtype, torch.device(device))
        cpu_linear.head_request()  # checked on every load, not only where heads are packed
        packed = model.prepack_linears(plan)
    except ValueError as e:  # PDSERVE_CPU_LINEAR / PDSERVE_CPU_LM_HEAD names no path it can take
        raise ConfigError(str(e)) from e
    _plan_prefill(model, dtype, device)
    if model.plan_decode():
        logger.info("decode steps: the %d decoder layers in one C++ call", len(model.layers))
    kinds: Counter[str] = Counter()
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            kinds[f"{name.rpartition('.')[2]}: quantized"] += 1
        elif isinstance(m, Linear) and not (m is model.lm_head and model.head_packed is not None):
            # the amx plan leaves a projection whose K is not a multiple of 32 on oneDNN
            path = "onednn" if plan.path == "amx" and not m.tiles else plan.path
            kinds[f"{name.rpartition('.')[2]}: {path}"] += 1
    head = plan.path
    if model.head_packed is not None:
        kernel = "AMX tiles" if model.head_tiles else "AVX512-BF16 dot products"
        head = f"{kernel}, one pass, greedy argmax fused"
    if model.lm_head is None and model.shard.last_stage:
        kinds[f"lm_head (tied): {head}"] += 1
    elif model.head_packed is not None:
        kinds[f"lm_head: {head}"] += 1
    logger.info(
        "linear layers: %s; %s%s",
        plan.reason,
        ", ".join(f"{k} x {n}" if n > 1 else k for k, n in kinds.items()),
        f"; {packed / (1 << 20):.1f} MiB reordered once" if packed else "",
    )


def _plan_prefill(model: LlamaForCausalLM, dtype: torch.dtype, device: str) -> None:
    """Choose the bf16 prefill attention tile and the decode kernel's shared-group step now
    (``PDSERVE_CPU_PREFILL``, ``PDSERVE_CPU_DECODE``; logged), so a bad setting fails the start
    instead of the first step."""
    if dtype != torch.bfloat16 or device != "cpu" or not len(model.layers):
        return
    backend = model.layers[0].self_attn.backend
    for name in ("prefill_path", "decode_uses_amx"):
        choose = getattr(backend, name, None)
        if choose is None:
            continue
        try:
            choose()
        except (ValueError, RuntimeError) as e:
            raise ConfigError(str(e)) from e


def _known(name: str, cfg: ModelConfig) -> bool:
    """Whether ``name`` (ours, global layer numbering) is a weight of this architecture (a
    stage that does not hold it still refuses a name no stage would take)."""
    if name.startswith("layers."):
        i = name[len("layers.") :].split(".", 1)[0]
        return i.isdigit() and int(i) < cfg.num_layers
    return name.split(".", 1)[0] in ("embed_tokens", "lm_head", "norm")


def _shard_sizes(cfg: ModelConfig, shard: Shard) -> dict[str, list[int]]:
    """The parts of this rank's fused weights: q/k/v and gate/up rows."""
    q = shard.heads(cfg.num_heads)[1] * cfg.head_dim
    kv = shard.kv_heads(cfg.num_kv_heads)[1] * cfg.head_dim
    inter = shard.columns(int(cfg.hf_config["intermediate_size"]))[1]
    return {"qkv_proj": [q, kv, kv], "gate_up_proj": [inter, inter]}


def _copy_into(
    param: torch.nn.Parameter,
    tensor: torch.Tensor,
    shard: int | None,
    sizes: dict[str, list[int]],
    hf_name: str,
) -> None:
    with torch.no_grad():
        if shard is None:
            if tuple(param.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            param.copy_(tensor)
            return
        key = "qkv_proj" if "self_attn" in hf_name else "gate_up_proj"
        parts = sizes[key]
        start = sum(parts[:shard])
        target = param.narrow(0, start, parts[shard])
        if tuple(target.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(tensor)


def _our_linear(hf_base: str) -> str:
    """``layers.0.self_attn.q_proj`` -> ``layers.0.self_attn.qkv_proj``."""
    prefix, _, proj = hf_base.rpartition(".")
    for fused, parts in FUSED.items():
        if proj in parts:
            return f"{prefix}.{fused}"
    return hf_base


def _install_quantized(
    model: LlamaForCausalLM, qc: QuantizationConfig, files: list[Path]
) -> dict[str, set[str]]:
    """Swap in ``QuantLinear`` for every projection the checkpoint quantizes; return the HF
    linear names whose tensors are quantized, each with the quantized tensors (suffixes) the
    checkpoint holds for it in any of its files."""
    from safetensors import safe_open

    kinds: dict[str, set[str]] = {}  # HF linear -> its tensor suffixes
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for hf_name in f.keys():  # noqa: SIM118
                lin = hf_linear_name(hf_name)
                if lin is not None:
                    kinds.setdefault(lin[0], set()).add(lin[1])
    quantized = set()
    for base, suffixes in kinds.items():
        if skipped(qc, base):
            continue
        if qc.method in ("int8", "fp8") or any(
            s != "weight" and is_quant_tensor(qc, s) for s in suffixes
        ):
            quantized.add(base)
    dense: set[str] = set()
    by_module: dict[str, set[bool]] = {}
    for base in kinds:
        by_module.setdefault(_our_linear(base), set()).add(base in quantized)
    for module, states in by_module.items():
        if len(states) > 1:
            raise ModelLoadError(f"{module}: the fused shards are partly quantized, partly dense")
        if states == {False}:
            dense.add(module)
    install(model, qc, dense)
    return {base: kinds[base] - {"bias"} for base in quantized}


def _finish_quantized(
    model: LlamaForCausalLM,
    qc: QuantizationConfig,
    collected: dict[str, dict[str, torch.Tensor]],
    expected: dict[str, set[str]] | None,
    device: str,
    dtype: torch.dtype,
) -> Counter[str]:
    """Install the weights of every ``QuantLinear`` whose parts (q/k/v, gate/up) have each
    had all the tensors in ``expected`` read: a shard boundary may split one linear's tensors
    (qweight in one file, scales in the next). ``expected`` None: every file has been read,
    finish whatever has all its parts (``read_linear`` names a tensor still missing)."""
    from kernels import quant

    cpp = _quant_cpp(device, dtype)
    paths: Counter[str] = Counter()
    for name, module in model.named_modules():
        if not isinstance(module, QuantLinear) or module.prepared is not None:
            continue
        prefix, _, leaf = name.rpartition(".")
        parts = [f"{prefix}.{p}" for p in FUSED.get(leaf, (leaf,))]
        if not all(p in collected for p in parts):
            continue
        if expected is not None and any(expected.get(p, set()) - set(collected[p]) for p in parts):
            continue
        shards = [read_linear(qc, collected.pop(p), p) for p in parts]
        if len(shards) == 1:
            qw = shards[0]
        elif isinstance(shards[0], quant.Fp8Weight):
            qw = quant.Fp8Weight.concat(shards)  # type: ignore[arg-type]
        else:
            qw = quant.QuantizedWeight.concat(shards)  # type: ignore[arg-type]
        pw = quant.prepare(qw, torch.device(device), dtype, cpp)
        module.set_weight(pw)
        paths[pw.path] += 1
        logger.debug("%s: %s (%d bytes)", name, pw.path, pw.nbytes)
    return paths


def _quant_cpp(device: str, dtype: torch.dtype) -> object:
    """The C++ quantized-matmul extension when it applies (CPU, bf16, AVX512-BF16), else None."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return None
    try:
        from kernels import quant_cpu
    except ImportError:
        return None
    return quant_cpu.extension()
