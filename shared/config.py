"""Engine configuration: the vLLM-named engine flags and the frozen configs derived from them.

``EngineArgs`` mirrors ``vllm.EngineArgs`` (same field names, same CLI flags, same defaults
where vLLM has one). ``EngineArgs.add_cli_args`` is the single place that defines the flags, so
every entry point (``pdserve prefill|decode|up``, ``LLM(...)``) accepts exactly the same set.
No torch import here: the router and the launcher use this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shared.cpu_bind import allowed_cpus

_DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
_KV_DTYPES = ("auto", "fp8", "fp8_e4m3")
GiB = 1 << 30


class ConfigError(ValueError):
    """An engine flag or a model directory is invalid."""


def parse_bytes(text: str | int | float) -> int:
    """Parse ``"4GiB"``, ``"512M"``, ``"1.5G"`` or a plain byte count."""
    if isinstance(text, (int, float)):
        return int(text)
    s = text.strip().lower().replace("ib", "").replace("b", "")
    mult = 1
    for suffix, m in (("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30), ("t", 1 << 40)):
        if s.endswith(suffix):
            s, mult = s[:-1], m
            break
    try:
        return int(float(s) * mult)
    except ValueError as e:
        raise ConfigError(f"cannot parse a byte size from {text!r}") from e


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; the whole machine's count
    where there is none)."""
    return len(allowed_cpus())


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about the checkpoint (read from config.json)."""

    path: str
    served_model_name: str
    architecture: str
    dtype: str  # resolved torch dtype name: float32 | bfloat16 | float16
    max_model_len: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: tuple[int, ...]
    hf_config: dict = field(hash=False, compare=False, repr=False)
    quantization: QuantizationConfig | None = None
    # vLLM's --enforce-eager: no captured step (here: the Python layer loop in every decode step)
    enforce_eager: bool = False


QUANTIZATION_METHODS = (
    "awq",
    "awq_marlin",
    "gptq",
    "gptq_marlin",
    "compressed-tensors",
    "int8",
    "fp8",
)
_QUANT_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}


@dataclass(frozen=True)
class QuantizationConfig:
    """A weight-only scheme, from ``--quantization`` and the checkpoint's ``quantization_config``.

    ``method``: ``awq`` | ``gptq`` | ``compressed-tensors`` (read from the checkpoint) or ``int8``
    (per-output-channel weights quantized at load from a dense checkpoint). ``skip``: module-name
    fragments left dense (AWQ ``modules_to_not_convert``, compressed-tensors ``ignore``); any
    linear the checkpoint stores as a dense ``weight`` also loads dense.
    """

    method: str
    bits: int
    group_size: int  # -1: per output channel
    symmetric: bool
    desc_act: bool = False
    checkpoint_format: str = ""  # gptq: "gptq" (v1 zero points) or "gptq_v2"
    skip: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.method == "fp8":
            return "fp8 (w8a16 e4m3, per-channel scales)"
        g = "per-channel" if self.group_size in (-1, 0) else f"group {self.group_size}"
        sym = "symmetric" if self.symmetric else "asymmetric"
        act = ", act-order" if self.desc_act else ""
        return f"{self.method} (w{self.bits}a16, {g}, {sym}{act})"


def resolve_quantization(requested: str | None, hf: dict) -> QuantizationConfig | None:
    """vLLM's ``--quantization`` rules: the checkpoint's ``quantization_config`` decides when
    the flag is absent; a flag that names another method is an error; unknown or unsupported
    schemes are refused with the scheme named."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ConfigError(
            f"--quantization {requested!r} is not supported; choose from "
            f"{', '.join(QUANTIZATION_METHODS)}"
        )
    want = _QUANT_ALIASES.get(requested or "", requested)
    qc = hf.get("quantization_config")
    if not qc:
        if want is None:
            return None
        if want not in ("int8", "fp8"):
            raise ConfigError(
                f"--quantization {requested} needs a checkpoint quantized with it; this one has "
                "no quantization_config (use --quantization int8 or fp8 to quantize a dense "
                "checkpoint at load)"
            )
        return QuantizationConfig(want, 8, -1, True)
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    method = {"compressed-tensors": "compressed-tensors"}.get(method, method)
    if want is not None and want != method:
        raise ConfigError(
            f"the checkpoint is quantized with {method!r} but --quantization {requested} was given"
        )
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        if version != "gemm" or bits != 4:
            raise ConfigError(f"AWQ {version} with {bits} bits is not supported (gemm, 4-bit)")
        return QuantizationConfig(
            "awq",
            4,
            int(qc.get("group_size", qc.get("q_group_size", 128))),
            not bool(qc.get("zero_point", True)),
            skip=tuple(qc.get("modules_to_not_convert") or ()),
        )
    if method == "gptq":
        bits = int(qc.get("bits", 4))
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if bits not in (4, 8):
            raise ConfigError(f"GPTQ with {bits} bits is not supported (4 or 8)")
        if fmt not in ("gptq", "gptq_v2"):
            raise ConfigError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        if qc.get("dynamic"):
            raise ConfigError("GPTQ per-module 'dynamic' overrides are not supported")
        return QuantizationConfig(
            "gptq",
            bits,
            int(qc.get("group_size", 128)),
            bool(qc.get("sym", True)),
            desc_act=bool(qc.get("desc_act", False)),
            checkpoint_format=fmt,
        )
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":  # AutoFP8 / vLLM Fp8Config checkpoints: e4m3 weights + weight_scale
        if qc.get("weight_block_size"):
            raise ConfigError(
                f"fp8 with weight_block_size {qc['weight_block_size']} is not supported "
                "(per-tensor or per-channel scales)"
            )
        return QuantizationConfig("fp8", 8, -1, True)
    raise ConfigError(
        f"quantization method {method!r} (from quantization_config) is not supported; "
        f"supported: awq, gptq, compressed-tensors, fp8, int8"
    )


def _compressed_tensors(qc: dict) -> QuantizationConfig:
    fmt = str(qc.get("format", ""))
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(
            f"compressed-tensors with {len(groups)} config groups is not supported (one)"
        )
    (group,) = groups.values()
    fmt = str(group.get("format") or fmt)
    w = group.get("weights") or {}
    if fmt != "pack-quantized":
        raise ConfigError(
            f"compressed-tensors format {fmt!r} is not supported (pack-quantized W4A16 / W8A16)"
        )
    if group.get("input_activations"):
        raise ConfigError(
            "compressed-tensors with quantized activations is not supported (weight-only)"
        )
    if w.get("type", "int") != "int" or int(w.get("num_bits", 0)) not in (4, 8):
        raise ConfigError(
            f"compressed-tensors weights {w.get('type')} {w.get('num_bits')}-bit are not "
            "supported (int 4 or 8)"
        )
    strategy = str(w.get("strategy", "group"))
    if strategy not in ("group", "channel"):
        raise ConfigError(f"compressed-tensors strategy {strategy!r} is not supported")
    targets = group.get("targets") or ["Linear"]
    if targets != ["Linear"]:
        raise ConfigError(f"compressed-tensors targets {targets} are not supported (['Linear'])")
    actorder = w.get("actorder")
    return QuantizationConfig(
        "compressed-tensors",
        int(w["num_bits"]),
        int(w.get("group_size") or -1) if strategy == "group" else -1,
        bool(w.get("symmetric", True)),
        desc_act=actorder in ("group", True),  # older llm-compressor: weight_g_idx stored
        skip=tuple(str(x) for x in (qc.get("ignore") or ())),
    )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool
    kv_cache_dtype: str  # "auto" (= model dtype) or "fp8_e4m3"
    gpu_memory_utilization: float
    kv_cache_memory: int | None  # bytes; overrides the utilization-based sizing
    swap_space: int  # bytes of host memory for swapped-out blocks
    num_gpu_blocks_override: int | None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    preemption_mode: str  # "recompute" | "swap"
    long_prefill_token_threshold: int
    # while any sequence is decoding, a step computes at most this many prompt tokens
    # (0: up to max_num_batched_tokens); pdserve up sets it on a disaggregated cluster's
    # decode workers, whose local prefills stall the streams they decode
    max_prefill_tokens_while_decoding: int = 0


@dataclass(frozen=True)
class ParallelConfig:
    """vLLM's parallelism flags. One worker is ``tensor_parallel_size x
    pipeline_parallel_size`` processes (ranks) on ``torch.distributed``; global rank
    ``pp_rank * tp + tp_rank``; rank 0 owns the scheduler and the service. With ``nnodes > 1``
    each node runs ``world_size / nnodes`` consecutive ranks (node 0 holds rank 0)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: any free port (single node only)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_world_size(self) -> int:
        return self.world_size // self.nnodes

    @property
    def first_local_rank(self) -> int:
        return self.node_rank * self.local_world_size

    def check(self, model: ModelConfig) -> None:
        """Refuse layouts the model cannot be sharded into (ConfigError naming the flag)."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if tp < 1 or pp < 1:
            raise ConfigError("--tensor-parallel-size and --pipeline-parallel-size must be >= 1")
        if self.distributed_executor_backend not in DISTRIBUTED_BACKENDS:
            raise ConfigError(
                f"--distributed-executor-backend {self.distributed_executor_backend!r} is not "
                f"supported; choose from {', '.join(DISTRIBUTED_BACKENDS)}"
            )
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ConfigError("--distributed-executor-backend uni runs one process: use mp")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} is not in [0, --nnodes {self.nnodes})")
        if self.world_size % self.nnodes:
            raise ConfigError(
                f"{self.world_size} ranks (TP {tp} x PP {pp}) do not split evenly over "
                f"--nnodes {self.nnodes}"
            )
        if self.nnodes > 1 and not self.master_port:
            raise ConfigError("--nnodes > 1 needs --master-addr and --master-port")
        if model.num_heads % tp:
            raise ConfigError(
                f"--tensor-parallel-size {tp} does not divide the model's "
                f"{model.num_heads} attention heads"
            )
        kv = model.num_kv_heads
        if kv % tp and tp % kv:
            raise ConfigError(
                f"--tensor-parallel-size {tp} and the model's {kv} KV heads: one must divide "
                "the other (KV heads are partitioned, or replicated when fewer than TP)"
            )
        inter = int(model.hf_config.get("intermediate_size", 0))
        if inter % tp:
            raise ConfigError(
                f"--tensor-parallel-size {tp} does not divide intermediate_size {inter}"
            )
        if pp > model.num_layers:
            raise ConfigError(
                f"--pipeline-parallel-size {pp} exceeds the model's {model.num_layers} layers"
            )
        if self.world_size > 1 and model.quantization is not None:
            raise ConfigError(
                f"--quantization {model.quantization.method} with TP/PP > 1 is not supported "
                "yet: serve it with --tensor-parallel-size 1 --pipeline-parallel-size 1"
            )

    def layer_range(self, pp_rank: int, num_layers: int) -> tuple[int, int]:
        """Layers ``[start, end)`` of pipeline stage ``pp_rank``: contiguous, as even as the
        count allows (the earlier stages take one more, the last holds the LM head)."""
        pp = self.pipeline_parallel_size
        base, extra = divmod(num_layers, pp)
        start = pp_rank * base + min(pp_rank, extra)
        return start, start + base + (1 if pp_rank < extra else 0)


DISTRIBUTED_BACKENDS = ("mp", "uni")
SPEC_METHODS = ("ngram", "draft_model")

# RoPE scalings the model implements, with the fields each needs (shared/models/llama.py)
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
HIDDEN_ACTS = ("silu", "swish")  # the same function in transformers' ACT2FN


def rope_settings(hf: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from a config.json: transformers 5 writes them together as
    ``rope_parameters`` (``{"rope_type", "rope_theta", "factor", ...}``) and no longer writes
    ``rope_theta`` / ``rope_scaling`` (read here when ``rope_parameters`` is absent). Reading
    only the old keys served such a model with theta 10,000 and no scaling: wrong tokens."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return theta, scaling or None
    return float(hf.get("rope_theta", 10000.0)), hf.get("rope_scaling")


def rope_type(scaling: dict | None) -> str:
    """The RoPE scaling's kind (``default`` without one)."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def check_model_settings(hf: dict, where: str | Path) -> None:
    """Refuse, as a :class:`ConfigError` naming the field and ``where`` (the config.json),
    what the model does not implement: another ``hidden_act`` than SiLU, a RoPE scaling other
    than linear / llama3 or one without its fields. Checked at config load and at model build,
    so the worker reports one line instead of a NotImplementedError or a KeyError traceback."""
    act = hf.get("hidden_act", "silu")
    if act not in HIDDEN_ACTS:
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported (silu)")
    field_name = (
        "rope_parameters" if isinstance(hf.get("rope_parameters"), dict) else "rope_scaling"
    )
    try:
        _, scaling = rope_settings(hf)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: rope_theta is not a number: {e}") from e
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigError(f"{where}: {field_name} {scaling!r} is not an object")
    kind = rope_type(scaling)
    if kind not in ROPE_TYPES:
        raise ConfigError(
            f"{where}: {field_name} rope_type {kind!r} is not supported ({', '.join(ROPE_TYPES)})"
        )
    for key in ROPE_TYPES[kind]:
        value = (scaling or {}).get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(
                f"{where}: {field_name} ({kind}) needs a number {key!r}, got {value!r}"
            )


def _int_field(hf: dict, key: str, where: Path, default: int | None = None) -> int:
    """Positive integer ``key`` of config.json ``where`` (``default`` when absent and given):
    a missing one was a bare KeyError traceback from the worker."""
    value = hf.get(key)
    if value is None:
        if default is None:
            raise ConfigError(f"{where}: missing required field {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ConfigError(f"{where}: field {key!r} is {value!r}, expected a positive integer")
    if value < 1:
        raise ConfigError(f"{where}: field {key!r} is {value!r}, expected a positive integer")
    return int(value)


def _quantize_config_file(path: Path, requested: str | None) -> dict | None:
    """AutoGPTQ's ``quantize_config.json``, read (as vLLM and transformers read it) when
    config.json has no ``quantization_config``; it may not name its method: then the
    ``--quantization`` flag's, else GPTQ's (the tool that writes this file)."""
    f = path / "quantize_config.json"
    if not f.is_file():
        return None
    try:
        qc = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {f}: {e}") from e
    if not isinstance(qc, dict):
        raise ConfigError(f"{f}: expected a JSON object")
    if not qc.get("quant_method"):
        want = _QUANT_ALIASES.get(requested or "", requested)
        qc["quant_method"] = want if want in ("awq", "gptq") else "gptq"
    return qc


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` (same JSON keys): ``method`` ``ngram`` (prompt lookup:
    the tokens that followed the latest earlier occurrence of the sequence's last
    ``prompt_lookup_max .. prompt_lookup_min`` tokens) or ``draft_model`` (a small model
    with the target's vocabulary, ``model``); ``num_speculative_tokens`` drafts per step;
    speculation pauses while ``disable_by_batch_size`` or more sequences run."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: str | dict | None) -> SpeculativeConfig | None:
        if value is None or value == "" or value == {}:
            return None
        if isinstance(value, str):
            try:
                d = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--speculative-config is not JSON: {e}") from e
        else:
            d = dict(value)
        if not isinstance(d, dict):
            raise ConfigError("--speculative-config must be a JSON object")
        known = {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "model",
            "disable_by_batch_size",
        }
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"--speculative-config: unsupported key(s) {', '.join(unknown)}")
        method = d.get("method") or ("draft_model" if d.get("model") else None)
        if method == "draft":
            method = "draft_model"
        if method not in SPEC_METHODS:
            raise ConfigError(
                f"--speculative-config method {method!r} is not supported; choose from "
                f"{', '.join(SPEC_METHODS)}"
            )
        k = d.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ConfigError("--speculative-config num_speculative_tokens must be 1..16")
        lo = d.get("prompt_lookup_min")
        hi = d.get("prompt_lookup_max")
        if method == "ngram":
            if lo is None and hi is None:
                lo, hi = 1, 4
            elif lo is None:
                lo = hi
            elif hi is None:
                hi = lo
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 64):
                raise ConfigError(
                    "--speculative-config needs 1 <= prompt_lookup_min <= prompt_lookup_max <= 64"
                )
        if method == "draft_model" and not d.get("model"):
            raise ConfigError("--speculative-config method draft_model needs a model directory")
        dbs = d.get("disable_by_batch_size")
        if dbs is not None and (not isinstance(dbs, int) or dbs < 1):
            raise ConfigError("--speculative-config disable_by_batch_size must be a positive int")
        return cls(method, k, int(lo or 1), int(hi or 4), d.get("model"), dbs)

    def to_json(self) -> str:
        d: dict = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            d.update(
                prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max
            )
        if self.model:
            d["model"] = self.model
        if self.disable_by_batch_size:
            d["disable_by_batch_size"] = self.disable_by_batch_size
        return json.dumps(d, separators=(",", ":"))


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclass
class EngineArgs:
    """Engine flags with vLLM's names and defaults (``None`` = derived, as in vLLM)."""

    model: str = ""
    served_model_name: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int | None = 0
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int = 0
    # tokens, or below 1 a fraction of the step budget; None: 0 (pdserve up: see its launcher)
    max_prefill_tokens_while_decoding: float | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: str | int | None = None
    kv_cache_dtype: str = "auto"
    swap_space: float = 4.0  # GiB, as in vLLM
    preemption_mode: str | None = None  # vLLM: recompute unless told otherwise
    num_gpu_blocks_override: int | None = None
    device: str = "auto"
    attention_backend: str | None = None  # torch | triton | cpp; default by device
    enforce_eager: bool = False
    disable_log_stats: bool = False
    max_logprobs: int = 20  # vLLM's: most logprobs a request may ask for
    quantization: str | None = None  # vLLM's --quantization; None: from the checkpoint
    speculative_config: str | dict | None = None  # vLLM's JSON (SpeculativeConfig)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    # ---- CLI ---------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
        g = parser.add_argument_group("engine (vLLM flag names)")
        g.add_argument(
            "--model", required=model_required, default=None, help="Hugging Face model directory"
        )
        g.add_argument(
            "--served-model-name",
            default=None,
            help="model name in the API and the prefix-cache hash seed (default: --model)",
        )
        g.add_argument("--tokenizer", default=None)
        g.add_argument(
            "--dtype",
            default="auto",
            choices=_DTYPES,
            help="auto serves the checkpoint's torch_dtype (fp32 stays fp32)",
        )
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32, 64, 128))
        g.add_argument(
            "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
        )
        g.add_argument(
            "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True
        )
        g.add_argument("--max-num-seqs", type=int, default=None)
        g.add_argument("--max-num-batched-tokens", type=int, default=None)
        g.add_argument("--long-prefill-token-threshold", type=int, default=0)
        g.add_argument(
            "--max-prefill-tokens-while-decoding",
            type=float,
            default=None,
            help="while any sequence is decoding, a step computes at most this many prompt "
            "tokens, or this fraction of --max-num-batched-tokens when below 1 (pdserve's "
            "flag; 0, the default: no bound but the step budget). pdserve up gives a "
            "cluster's decode workers 0.5 when it has prefill workers: their local prefills "
            "(overflow) then stall the streams they decode for half as long",
        )
        g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        g.add_argument(
            "--kv-cache-memory",
            default=None,
            help="KV cache size in bytes (e.g. 2GiB); overrides --gpu-memory-utilization",
        )
        g.add_argument("--kv-cache-dtype", default="auto", choices=_KV_DTYPES)
        g.add_argument("--swap-space", type=float, default=4.0, help="GiB of host swap per worker")
        g.add_argument("--preemption-mode", default=None, choices=("recompute", "swap"))
        g.add_argument("--num-gpu-blocks-override", type=int, default=None)
        g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
        g.add_argument(
            "--attention-backend",
            default=None,
            choices=("torch", "triton", "cpp"),
            help="default: triton on CUDA; cpp (C++ paged decode kernel) on CPU, "
            "torch (the reference) if it cannot be built",
        )
        g.add_argument(
            "--enforce-eager",
            action="store_true",
            help="run every decode step layer by layer in Python (by default a bf16 decode "
            "step on the CPU runs its decoder layers in one C++ call)",
        )
        g.add_argument("--disable-log-stats", action="store_true")
        g.add_argument(
            "--max-logprobs",
            type=int,
            default=20,
            help="most top logprobs a request may ask for (vLLM's --max-logprobs)",
        )
        g.add_argument(
            "--quantization",
            "-q",
            default=None,
            choices=QUANTIZATION_METHODS,
            help="weight quantization; default: the checkpoint's quantization_config. int8 "
            "quantizes a dense checkpoint's linear layers per output channel at load",
        )
        g.add_argument(
            "--speculative-config",
            default=None,
            help='speculative decoding, vLLM\'s JSON: {"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_max": 4} or {"method": "draft_model", '
            '"model": DIR, "num_speculative_tokens": 3}; "disable_by_batch_size": N pauses it '
            "while N or more sequences run",
        )
        p = parser.add_argument_group("parallelism (vLLM flag names)")
        p.add_argument(
            "--tensor-parallel-size",
            "-tp",
            type=int,
            default=1,
            help="shard every layer over this many ranks (heads, MLP columns, vocabulary)",
        )
        p.add_argument(
            "--pipeline-parallel-size",
            "-pp",
            type=int,
            default=1,
            help="split the layers into this many contiguous stages",
        )
        p.add_argument(
            "--distributed-executor-backend",
            default="mp",
            choices=DISTRIBUTED_BACKENDS,
            help="mp: one process per rank on torch.distributed (gloo on CPU, NCCL on CUDA)",
        )
        p.add_argument("--nnodes", type=int, default=1, help="hosts one worker spans")
        p.add_argument(
            "--node-rank",
            type=int,
            default=0,
            help="this host's index; 0 runs the service, others only their ranks",
        )
        p.add_argument("--master-addr", default="127.0.0.1", help="node 0's address")
        p.add_argument(
            "--master-port", type=int, default=0, help="node 0's rendezvous port (0: any free)"
        )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})

    def to_cli_args(self) -> list[str]:
        """The flags that reproduce these args (``pdserve up`` passes them to its workers)."""
        out: list[str] = []
        defaults = EngineArgs()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == getattr(defaults, f.name):
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                if value:
                    out.append(flag)
                elif f.name.startswith("enable_"):  # BooleanOptionalAction flags
                    out.append("--no-" + flag[2:])
            elif isinstance(value, dict):
                out += [flag, json.dumps(value, separators=(",", ":"))]
            elif value is not None:
                out += [flag, str(value)]
        return out

    # ---- resolution --------------------------------------------------------------------
    def create_parallel_config(self) -> ParallelConfig:
        """The parallelism flags (``EngineArgs`` carries each ``ParallelConfig`` field under
        the same name, as vLLM's does)."""
        names = [f.name for f in dataclasses.fields(ParallelConfig)]
        return ParallelConfig(**{n: getattr(self, n) for n in names})

    def create_speculative_config(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    def create_model_config(self) -> ModelConfig:
        path = Path(self.model)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(
                f"{self.model!r} is not a Hugging Face model directory (no config.json)"
            )
        try:
            hf = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {cfg_file}: {e}") from e
        if not isinstance(hf, dict):
            raise ConfigError(f"{cfg_file}: expected a JSON object")
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or hf.get('model_type')!r} in {cfg_file}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        dtype = resolve_dtype(self.dtype, hf.get("torch_dtype") or hf.get("dtype"))
        check_model_settings(hf, cfg_file)
        for key in ("vocab_size", "num_hidden_layers", "intermediate_size"):
            _int_field(hf, key, cfg_file)
        native_len = _int_field(hf, "max_position_embeddings", cfg_file, 2048)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(
                f"--max-model-len {self.max_model_len}: must be positive (leave it out for the "
                f"model's {native_len})"
            )
        max_len = self.max_model_len or native_len
        window = hf.get("sliding_window")
        if window and hf.get("use_sliding_window", True) and int(window) < native_len:
            # Sliding-window attention is not implemented: serve only what full attention covers.
            native_len = int(window)
            max_len = min(max_len, native_len)
        if max_len > native_len:
            raise ConfigError(
                f"--max-model-len {max_len} exceeds the model's max_position_embeddings {native_len}"
            )
        n_heads = _int_field(hf, "num_attention_heads", cfg_file)
        hidden = _int_field(hf, "hidden_size", cfg_file)
        if not hf.get("quantization_config"):
            qfile = _quantize_config_file(path, self.quantization)
            if qfile is not None:
                hf["quantization_config"] = qfile
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        gen_cfg = path / "generation_config.json"
        if gen_cfg.is_file():
            g_eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            if isinstance(g_eos, list):
                eos_ids = tuple(dict.fromkeys(eos_ids + tuple(g_eos)))
            elif g_eos is not None and g_eos not in eos_ids:
                eos_ids = eos_ids + (g_eos,)
        return ModelConfig(
            path=str(path),
            served_model_name=self.served_model_name or self.model,
            architecture=arch,
            dtype=dtype,
            max_model_len=max_len,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=n_heads,
            num_kv_heads=_int_field(hf, "num_key_value_heads", cfg_file, n_heads),
            head_dim=_int_field(hf, "head_dim", cfg_file, hidden // n_heads),
            eos_token_ids=eos_ids,
            hf_config=hf,
            quantization=resolve_quantization(self.quantization, hf),
            enforce_eager=self.enforce_eager,
        )

    def create_cache_config(self) -> CacheConfig:
        if self.kv_cache_dtype not in _KV_DTYPES:
            raise ConfigError(
                f"--kv-cache-dtype must be one of {_KV_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("--gpu-memory-utilization must be in (0, 1]")
        return CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_dtype="auto" if self.kv_cache_dtype == "auto" else "fp8_e4m3",
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory=None
            if self.kv_cache_memory is None
            else parse_bytes(self.kv_cache_memory),
            swap_space=int(self.swap_space * GiB),
            num_gpu_blocks_override=self.num_gpu_blocks_override,
        )

    def create_scheduler_config(self, model_config: ModelConfig, device: str) -> SchedulerConfig:
        for flag, value in (
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
        ):
            if value is not None and value < 1:  # 0 had silently meant the default
                raise ConfigError(
                    f"{flag} {value}: must be positive (leave it out for the default)"
                )
        # vLLM's usage-context defaults: CPU 128 seqs / 2048 tokens per step; CUDA 256 / 8192.
        max_seqs = self.max_num_seqs or (128 if device == "cpu" else 256)
        default_tokens = 2048 if device == "cpu" else 8192
        max_tokens = self.max_num_batched_tokens or default_tokens
        if not self.enable_chunked_prefill:
            max_tokens = max(max_tokens, model_config.max_model_len)
        if max_seqs < 1 or max_tokens < 1:
            raise ConfigError("--max-num-seqs and --max-num-batched-tokens must be positive")
        room = self.max_prefill_tokens_while_decoding or 0
        if not 0 <= room < float("inf") or (room >= 1 and room != int(room)):
            raise ConfigError(
                "--max-prefill-tokens-while-decoding must be a whole number of tokens, or a "
                "fraction below 1 of --max-num-batched-tokens"
            )
        if 0 < room < 1:  # a share of the step budget, at least one token
            room = max(1, int(max_tokens * room))
        room = int(room)
        if max_tokens < max_seqs and self.max_num_batched_tokens:
            raise ConfigError(
                f"--max-num-batched-tokens ({max_tokens}) must be >= --max-num-seqs ({max_seqs})"
            )
        return SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max_tokens,
            max_model_len=model_config.max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            preemption_mode=self.preemption_mode or "recompute",
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_prefill_tokens_while_decoding=room,
        )


def resolve_dtype(requested: str, checkpoint: str | None) -> str:
    """vLLM's ``--dtype`` rules: ``auto`` serves the checkpoint dtype (fp32 stays fp32)."""
    aliases = {
        "float": "float32",
        "half": "float16",
        "float32": "float32",
        "bfloat16": "bfloat16",
        "float16": "float16",
    }
    if requested == "auto":
        return aliases.get(str(checkpoint or "float32").replace("torch.", ""), "float32")
    if requested not in aliases:
        raise ConfigError(f"--dtype must be one of {_DTYPES}, got {requested!r}")
    return aliases[requested]


def env_flag(name: str, default: bool = False) -> bool:
    v = os.environ.get(name)
    return default if v is None else v.lower() in ("1", "true", "yes", "on")


# 0: the CPU KV pool on 4 KiB pages instead of transparent huge pages (``zeroed_host_tensor``);
# ``pdserve up`` sets it for the workers of a disaggregated cluster unless the user did
KV_HUGEPAGES_ENV = "PDSERVE_KV_HUGEPAGES"


def env_int(name: str, default: int, minimum: int = 0) -> int:
    """The integer in environment variable ``name``, or ``default`` when it is unset or empty.
    Anything else (``"1.5"``, ``"abc"``, below ``minimum``) is a :class:`ConfigError` naming
    the variable, which a worker reports as one line and exit status 2."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected an integer >= {minimum}") from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r}: expected an integer >= {minimum}")
    return value


def env_float(name: str, default: float, minimum: float = 0.0) -> float:
    """As :func:`env_int` for a finite number (seconds, MiB)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < minimum:
        raise ConfigError(f"{name}={raw!r}: expected a number >= {minimum:g}")
    return value


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum`` (a worker count, a thread count), else
    the usual one-line ``argument --x: ...`` error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value

    return parse


def float_at_least(minimum: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number >= ``minimum`` (seconds)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a number")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value:g} is below {minimum:g}")
        return value

    return parse


def port_number(text: str) -> int:
    """An argparse ``type``: a TCP port, 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0 to 65535)")
    return value
