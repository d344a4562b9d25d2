"""Load a Hugging Face safetensors checkpoint into the project's model implementation."""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

import torch

from shared.config import ModelConfig
from shared.models.llama import LlamaForCausalLM, fused_param_name

logger = logging.getLogger(__name__)

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}


class ModelLoadError(RuntimeError):
    """The checkpoint cannot be loaded: missing, corrupt or mismatched weight files."""


def load_model(cfg: ModelConfig, device: str, backend: ModuleType) -> LlamaForCausalLM:
    """Build the model for ``cfg`` on ``device`` in ``cfg.dtype`` and load its weights."""
    from safetensors import SafetensorError, safe_open

    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise ModelLoadError(f"no implementation for {cfg.architecture}")
    dtype = getattr(torch, cfg.dtype)
    files = sorted(Path(cfg.path).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weight files in {cfg.path}")
    with torch.device("meta"):
        model = cls(cfg, backend)
    model = model.to_empty(device=device).to(dtype)
    # Buffers (rotary tables) were on meta: rebuild them on the device in fp32.
    from shared.models.llama import Rotary

    hf = cfg.hf_config
    fresh = Rotary(
        cfg.head_dim,
        int(hf.get("max_position_embeddings", cfg.max_model_len)),
        float(hf.get("rope_theta", 10000.0)),
        hf.get("rope_scaling"),
    ).to(device)
    model.rotary.cos, model.rotary.sin = fresh.cos, fresh.sin
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    shard_sizes = _shard_sizes(cfg)
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for hf_name in f.keys():  # noqa: SIM118 - safe_open has keys(), no __iter__
                    if "rotary_emb.inv_freq" in hf_name:
                        continue
                    name, shard = fused_param_name(hf_name)
                    if name == "lm_head.weight" and model.lm_head is None:
                        continue  # tied
                    param = params.get(name)
                    if param is None:
                        raise ModelLoadError(f"unexpected weight {hf_name!r} in {path.name}")
                    tensor = f.get_tensor(hf_name)
                    _copy_into(param, tensor, shard, shard_sizes, hf_name)
                    loaded.add(name if shard is None else f"{name}#{shard}")
        except SafetensorError as e:
            raise ModelLoadError(f"corrupt safetensors file {path}: {e}") from e
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {path}: {e}") from e
    missing = []
    for name, _param in params.items():
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
    return model


def _shard_sizes(cfg: ModelConfig) -> dict[str, list[int]]:
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    inter = int(cfg.hf_config["intermediate_size"])
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
