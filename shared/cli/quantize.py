"""Write a quantized copy of a dense checkpoint in the on-disk layout of a real quantizer.

``pdserve make-tiny-model --quantize awq|gptq|compressed-tensors|int8`` (and ``pdserve quantize
SRC DST --method ...`` for any dense Llama-family directory) round-to-nearest quantize every
projection (``q/k/v/o_proj``, ``gate/up/down_proj``) and write it the way AutoAWQ (GEMM),
AutoGPTQ / GPTQModel (``checkpoint_format: gptq``, zero points stored minus one, ``g_idx``) and
llm-compressor (``pack-quantized`` W4A16 / W8A16; ``int8`` is its W8A16 per-channel preset)
do: the same tensor names, packing order, zero-point convention and ``quantization_config``.
Round-to-nearest, not AWQ's or GPTQ's search: the point is the format, so the loaders are tested
on exactly what those tools write. A projection whose input size is not a multiple of the group
size stays dense and is listed where each format lists skipped modules.
"""

from __future__ import annotations

import argparse
import json
import shutil
import zlib
from pathlib import Path

METHODS = ("awq", "gptq", "compressed-tensors", "int8")
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    method: str,
    bits: int = 4,
    group_size: int = 128,
    desc_act: bool = False,
    seed: int = 0,
) -> Path:
    """Write ``dst``: ``src`` with its projections quantized in ``method``'s layout."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from kernels import quant
    from shared.models.loader import INDEX_FILE, weight_files

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    if method == "int8":
        method, bits, group_size = "compressed-tensors", 8, -1
    if method == "awq" and (bits != 4 or desc_act):
        raise ValueError("AWQ is 4-bit without act order")
    if method == "compressed-tensors" and desc_act:
        raise ValueError(
            "compressed-tensors >= 0.20 removed actorder='group' (the weight_g_idx layout); "
            "pdserve reads such checkpoints but writes act order only for gptq"
        )
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    # one output file: the source's index would name its shards and tensors, not ours
    (dst / INDEX_FILE).unlink(missing_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", INDEX_FILE):
            shutil.copy2(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    dense_dtype = getattr(torch, cfg.get("torch_dtype") or "float32")
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(src):
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open has keys(), no __iter__
                tensors[k] = f.get_tensor(k)
    out: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for name, t in sorted(tensors.items()):
        base, _, suffix = name.rpartition(".")
        if suffix != "weight" or base.rpartition(".")[2] not in _PROJ:
            out[name] = t
            continue
        k = int(t.shape[1])
        g = k if group_size in (-1, 0) else group_size
        if k % g or (method == "awq" and int(t.shape[0]) % 8):
            out[name] = t
            skipped.append(base)
            continue
        if desc_act:  # linears that read the same input share GPTQ's order (same Hessian)
            proj = base.rpartition(".")[2]
            shared_input = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
            key = base.rpartition(".")[0] + "." + shared_input.get(proj, proj)
            qw, g_idx = quant.quantize_rtn_act_order(t, bits, g, seed + zlib.crc32(key.encode()))
        else:
            qw, g_idx = quant.quantize_rtn(t, bits, g, symmetric=method != "awq"), None
        if method == "awq":
            packed = quant.to_awq(qw)
        elif method == "gptq":
            packed = quant.to_gptq(qw, g_idx)
        else:
            packed = quant.to_compressed_tensors(qw, dense_dtype)
        for suffix_q, tq in packed.items():
            out[f"{base}.{suffix_q}"] = tq.contiguous()
    cfg["quantization_config"] = _quant_config(method, bits, group_size, desc_act, skipped)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(dict(sorted(out.items())), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _quant_config(
    method: str, bits: int, group_size: int, desc_act: bool, skipped: list[str]
) -> dict:
    if method == "awq":
        return {
            "quant_method": "awq",
            "bits": bits,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": sorted(skipped) or None,
        }
    if method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group_size,
            "desc_act": desc_act,
            "sym": True,
            "static_groups": False,
            "true_sequential": True,
            "damp_percent": 0.01,
            "checkpoint_format": "gptq",
            "model_name_or_path": None,
            "model_file_base_name": None,
        }
    weights = {
        "num_bits": bits,
        "type": "int",
        "symmetric": True,
        "strategy": "channel" if group_size in (-1, 0) else "group",
        "group_size": None if group_size in (-1, 0) else group_size,
        "actorder": None,
        "dynamic": False,
        "observer": "minmax",
        "block_structure": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ["lm_head", *sorted(skipped)],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def add_cli_args(parser: argparse.ArgumentParser, with_paths: bool = True) -> None:
    if with_paths:
        parser.add_argument("src", help="dense Hugging Face model directory")
        parser.add_argument("dst", help="output directory")
        parser.add_argument("--method", required=True, choices=METHODS)
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    parser.add_argument(
        "--group-size", type=int, default=128, help="input features per scale; -1: per channel"
    )
    parser.add_argument(
        "--desc-act",
        action="store_true",
        help="act order (GPTQ desc_act with g_idx), a seeded permutation shared by the linears "
        "that read the same input",
    )


def run(args: argparse.Namespace) -> int:
    out = quantize_checkpoint(
        args.src, args.dst, args.method, args.bits, args.group_size, args.desc_act
    )
    print(f"wrote {args.method} checkpoint to {out}")
    return 0
