"""Llama-family decoder (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM) over a paged KV pool.

One implementation covers the three architectures: Qwen2 adds q/k/v biases and ties the LM head
to the embedding; Mistral is Llama with its own defaults; Llama-3 adds rope scaling. The math
follows the Hugging Face reference (RMSNorm in fp32, rotate-half RoPE with cos/sin cast to the
activation dtype) so greedy outputs match ``transformers`` token for token.

Tokens of every scheduled sequence are packed into one ``[T]`` batch (no padding); attention reads
and writes the paged pool through ``AttentionMetadata``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_linear, cpu_paged
from shared.config import ConfigError, ModelConfig, check_model_settings, rope_type
from shared.config import rope_settings as rope_settings  # re-exported (the loader uses it)
from shared.models.sharding import WHOLE, Shard


class Linear(nn.Linear):
    """``nn.Linear`` whose weight may be prepacked for the CPU's matrix units at load
    (``kernels/cpu_linear.py``: ``packed`` replaces ``weight``); an unpacked weight is first
    offered to the attention backend's small-batch kernel (``small_linear``: bf16 on an
    AVX512-BF16 CPU, a few rows), which returns ``None`` where it does not apply."""

    small: object = None  # the backend's small_linear, set by the model
    packed: torch.Tensor | None = None  # set by prepack_linears
    tiles: bool = False  # ``packed`` is cpu_paged.amx_pack's layout (the ``amx`` plan)
    tiles_n: int = 0  # then the weight's row count (the output width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.tiles_n if self.tiles else None
        return cpu_linear.linear(x, self.weight, self.bias, self.packed, self.small, n)


def _takes(lin: Linear, kind: str) -> bool:
    """Whether projection ``lin`` runs on the one-call decode step's ``kind`` of kernel
    (``"packed"``: oneDNN's packed primitive; ``"amx"``: the AMX projection on the tiles'
    layout, N a multiple of 32, or oneDNN's where K kept it there; ``"avx2"``: the AVX2 kernel on the plain bf16 weight, for every
    row count, as ``cpu_paged.avx2_linear`` takes it)."""
    if kind == "packed":
        return lin.packed is not None and not lin.tiles
    if kind == "amx":  # a projection left on oneDNN (K not a multiple of 32) rides along
        return lin.packed is not None and (not lin.tiles or lin.tiles_n % 32 == 0)
    w = lin.weight
    return (
        lin.packed is None
        and lin.small is cpu_paged.avx2_linear
        and w is not None
        and w.dtype == torch.bfloat16
        and w.is_contiguous()  # the C++ call takes it as it is (avx2_linear copies it)
        and w.shape[1] % 8 == 0
    )


def _projection(lin: Linear, kind: str) -> torch.Tensor:
    """The weight the one-call decode step reads for ``lin`` (checked by :func:`_takes`)."""
    w = lin.packed if kind in ("packed", "amx") else lin.weight
    assert w is not None
    return w


@dataclass
class AttentionMetadata:
    """Per-step attention inputs built by the model runner."""

    slot_mapping: torch.Tensor  # [T] int64: slot of each new token
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32: context length per sequence incl. new tokens
    query_start_loc: torch.Tensor  # [S + 1] int32
    decode_only: bool  # every sequence has exactly one new token
    k_scale: torch.Tensor | None = None  # fp8 KV scales, [1] or [Hkv]
    v_scale: torch.Tensor | None = None


class RMSNorm(nn.Module):
    fused: object = None  # the backend's rms_norm (bf16, one pass), set by the model

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, H]
        if self.fused is not None:
            y = self.fused(x, self.weight, self.eps)
            if y is not None:
                return y[0]
        return self._norm(x)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``."""
        if self.fused is not None:
            y = self.fused(x, self.weight, self.eps, residual)
            if y is not None:
                return y
        total = x + residual
        return self._norm(total), total

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with Llama-3 frequency-dependent scaling if asked."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_type(scaling)
    if kind == "default":
        return inv
    assert scaling is not None
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind != "llama3":  # create_model_config refuses it first (check_model_settings)
        raise ConfigError(f"rope_scaling rope_type {kind!r} is not supported")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary_positions(cfg: ModelConfig) -> int:
    """Rows of the cos / sin tables: the engine's ``max_model_len`` (at most the model's
    ``max_position_embeddings``), not the model's: a 1M-context config served at 8k had
    allocated 1 GiB of tables. No position reaches it: requests end at ``max_model_len``
    tokens and speculative drafts stay below it (``SpecDecoder.max_drafts``); the kernels check
    (``rope_bf16``'s TORCH_CHECK, an index error in Python). Scalings read their original
    context length from the config, never this size."""
    return cfg.max_model_len


class Rotary(nn.Module):
    fused: object = None  # the backend's rope (bf16, one pass), set by the model

    def __init__(self, head_dim: int, max_pos: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        if torch.get_default_device().type == "meta":
            # built under torch.device("meta") (the loader, which computes the tables on the
            # real device): shapes only. Computing them here ran torch's Python meta kernels,
            # whose first use imports torch._dynamo: ~3 s of every worker's start
            self.register_buffer("cos", torch.empty(max_pos, head_dim), persistent=False)
            self.register_buffer("sin", torch.empty(max_pos, head_dim), persistent=False)
            return
        inv = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.int64).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D]
        if self.fused is not None:
            y = self.fused(q, k, self.cos, self.sin, positions)
            if y is not None:
                return y
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        backend: ModuleType,
        rotary: Rotary,
        bias: bool,
        shard: Shard = WHOLE,
        o_bias: bool = False,
    ) -> None:
        super().__init__()
        self.layer = layer  # index into this rank's KV pool (its stage's layers)
        self.shard = shard
        self.num_heads = shard.heads(cfg.num_heads)[1]
        self.num_kv_heads = shard.kv_heads(cfg.num_kv_heads)[1]
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        # row-parallel: its bias (Llama's attention_bias) is held whole by TP rank 0 only
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        self.scale = self.head_dim**-0.5
        self.backend = backend
        self.rotary = rotary

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        be = self.backend
        be.write_kv(k, v, kv_cache, self.layer, meta.slot_mapping, meta.k_scale, meta.v_scale)
        if meta.decode_only:
            o = be.paged_decode_attention(
                q,
                kv_cache,
                self.layer,
                meta.block_tables,
                meta.seq_lens,
                self.scale,
                meta.k_scale,
                meta.v_scale,
            )
        else:
            o = be.paged_attention(
                q,
                kv_cache,
                self.layer,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                self.scale,
                meta.k_scale,
                meta.v_scale,
            )
        return self.shard.all_reduce(self.o_proj(o.reshape(t, self.q_size)))


class MLP(nn.Module):
    fused: object = None  # the backend's silu_mul (bf16, one pass), set by the model

    def __init__(self, hidden: int, inter: int, shard: Shard = WHOLE, bias: bool = False) -> None:
        """``bias``: Llama's ``mlp_bias`` (gate, up and down projections)."""
        super().__init__()
        self.shard = shard
        self.inter = shard.columns(inter)[1]
        self.gate_up_proj = Linear(hidden, 2 * self.inter, bias=bias)  # column-parallel
        self.down_proj = Linear(self.inter, hidden, bias=bias)  # row-parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        h = self.fused(gu) if self.fused is not None else None
        if h is None:
            gate, up = gu.split(self.inter, dim=-1)
            h = F.silu(gate) * up
        return self.shard.all_reduce(self.down_proj(h))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        backend: ModuleType,
        rotary: Rotary,
        bias: bool,
        shard: Shard = WHOLE,
    ) -> None:
        super().__init__()
        hf = cfg.hf_config
        eps = float(hf.get("rms_norm_eps", 1e-6))
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        llama_bias = cfg.architecture == "LlamaForCausalLM"
        self.self_attn = Attention(
            cfg,
            layer,
            backend,
            rotary,
            bias,
            shard,
            o_bias=llama_bias and bool(hf.get("attention_bias", False)),
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = MLP(
            cfg.hidden_size,
            int(hf["intermediate_size"]),
            shard,
            bias=llama_bias and bool(hf.get("mlp_bias", False)),
        )

    def projections(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        """The layer's qkv, o, gate_up and down projections, in that order."""
        a, m = self.self_attn, self.mlp
        return (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)

    def forward(self, positions, x, kv_cache, meta):
        h, x = self.post_attention_layernorm.add_forward(
            self.self_attn(positions, self.input_layernorm(x), kv_cache, meta), x
        )
        return x + self.mlp(h)


class LlamaForCausalLM(nn.Module):
    """Also serves Qwen2ForCausalLM (q/k/v bias) and MistralForCausalLM.

    Built for one rank's ``shard`` (shared/models/sharding.py): its heads and columns of its
    stage's layers; the embedding on the first stage (and on the last when the LM head is tied
    to it), the LM head on the last."""

    def __init__(self, cfg: ModelConfig, backend: ModuleType, shard: Shard = WHOLE) -> None:
        super().__init__()
        hf = cfg.hf_config
        check_model_settings(hf, f"{cfg.path}/config.json")
        bias = cfg.architecture == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False))
        self.config = cfg
        self.shard = shard
        self.layer_ids = shard.layers(cfg.num_layers)
        self.vocab_start, self.vocab_rows = shard.vocab(cfg.vocab_size)
        rotary = Rotary(cfg.head_dim, rotary_positions(cfg), *rope_settings(hf))
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        needs_embed = shard.first_stage or (shard.last_stage and self.tie_word_embeddings)
        # given its (uninitialized) weight, nn.Embedding skips its random init: the loader
        # builds on the meta device, where that init imports torch._dynamo (~3 s a worker)
        self.embed_tokens = (
            nn.Embedding(
                self.vocab_rows,
                cfg.hidden_size,
                _weight=torch.empty(self.vocab_rows, cfg.hidden_size),
            )
            if needs_embed
            else None
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i - self.layer_ids.start, backend, rotary, bias, shard)
            for i in self.layer_ids
        )
        self.norm = (
            RMSNorm(cfg.hidden_size, float(hf.get("rms_norm_eps", 1e-6)))
            if shard.last_stage
            else None
        )
        self.lm_head = (
            Linear(cfg.hidden_size, self.vocab_rows, bias=False)
            if shard.last_stage and not self.tie_word_embeddings
            else None
        )
        self.rotary = rotary
        self.tied_packed: torch.Tensor | None = None  # a packed copy of a tied LM head
        # the LM head in the one-pass projection's tile layout (``prepack_linears``; whole model
        # only), run on AMX tiles when ``head_tiles``, else on AVX512-BF16 dot products
        self.head_packed: torch.Tensor | None = None
        self.head_tiles = False
        # the decode step's layers as one call (``plan_decode``, set by the loader)
        self._decode_plan: Callable[..., torch.Tensor] | None = None
        self.small_linear = getattr(backend, "small_linear", None)
        fused = {
            RMSNorm: getattr(backend, "rms_norm", None),
            Rotary: getattr(backend, "rope", None),
            MLP: getattr(backend, "silu_mul", None),
        }
        for m in self.modules():
            if isinstance(m, Linear):
                m.small = self.small_linear
            elif type(m) in fused:
                m.fused = fused[type(m)]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden states [T, H]: normalised on the last stage; a
        # later stage starts from the previous stage's ``hidden``
        x = self.embed(input_ids) if hidden is None else hidden
        plan = self._decode_plan
        if (
            plan is not None
            and meta.decode_only
            and meta.k_scale is None
            and x.dtype == torch.bfloat16
            and kv_cache.dtype == torch.bfloat16
            and x.device.type == "cpu"
        ):
            x = plan(x, positions, kv_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens)
        else:
            for layer in self.layers:
                x = layer(positions, x, kv_cache, meta)
        return x if self.norm is None else self.norm(x)

    def plan_decode(self) -> bool:
        """Run a decode step's decoder layers as one C++ call (``kernels/cpu_paged.py::
        decode_layers``) from now on, when the backend has it and every op of the Python layer
        loop would take the path that call makes (every projection packed for oneDNN, or every
        one on the ``avx2`` plan's kernel; the fused bf16 RMSNorm, RoPE and SiLU x mul; one
        rank); ``--enforce-eager`` keeps the Python loop. The loader calls it once, after
        packing the weights. Returns whether the call is used."""
        self._decode_plan = self._build_decode_plan()
        return self._decode_plan is not None

    def _build_decode_plan(self) -> Callable[..., torch.Tensor] | None:
        cfg = self.config
        be = self.layers[0].self_attn.backend if len(self.layers) else None
        run = getattr(be, "decode_layers", None)
        # the projections' kernel: oneDNN's packed primitive, the amx plan's tiles, or the avx2
        # plan's kernel on plain weights
        tiles = [
            getattr(lin, "tiles", False) for layer in self.layers for lin in layer.projections()
        ]
        kind = "avx2" if self.heavy_projections() else "amx" if any(tiles) else "packed"
        if (
            cfg.enforce_eager
            or run is None
            or not be.decode_layers_available(kind)  # type: ignore[union-attr]
            or self.shard.tp_size != 1
            or cfg.hidden_size % 16
            or cfg.head_dim % 32
            or self.rotary.fused is None
            or self.rotary.cos.dtype != torch.float32
        ):
            return None
        weights: list[torch.Tensor] = []
        eps: set[float] = set()
        biases = {layer.self_attn.qkv_proj.bias is not None for layer in self.layers}
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            lins = layer.projections()
            if (
                any(type(lin) is not Linear or not _takes(lin, kind) for lin in lins)
                or any(lin.bias is not None for lin in lins[1:])  # it adds only a q/k/v bias
                or any(n.fused is None or n.weight.dtype != torch.bfloat16 for n in norms)
                or m.fused is None
                or (2 * m.inter) % 32
            ):
                return None
            qkv, o, gu, down = (_projection(lin, kind) for lin in lins)
            bias = a.qkv_proj.bias if a.qkv_proj.bias is not None else qkv
            weights += [norms[0].weight, qkv, bias, o]
            weights += [norms[1].weight, gu, down]
            eps.update(n.eps for n in norms)
        if len(eps) != 1 or len(biases) != 1:
            return None
        a0 = self.layers[0].self_attn
        plan = functools.partial(
            run,
            scale=a0.scale,
            cos=self.rotary.cos,
            sin=self.rotary.sin,
            heads=(a0.num_heads, a0.num_kv_heads, a0.head_dim),
            eps=eps.pop(),
            weights=weights,
            layers=[layer.self_attn.layer for layer in self.layers],
            qkv_bias=biases.pop(),
            linear=kind,
        )
        return plan

    def heavy_projections(self) -> bool:
        """Whether the decoder layers' projections all run on the ``avx2`` plan's kernel (bf16
        widened to fp32 FMAs where oneDNN has no bf16): a step's compute per token is then 3-4x
        what it is on AVX512-BF16 or AMX (``ModelRunner``'s thread rule reads it). Quantized
        layers (their own kernels) are not."""
        lins = [lin for layer in self.layers for lin in layer.projections()]
        return bool(lins) and all(
            type(lin) is Linear and lin.packed is None and lin.small is cpu_paged.avx2_linear
            for lin in lins
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None
        if self.shard.tp_size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_rows)
        x = self.embed_tokens(local.masked_fill(~mine, 0)) * mine.unsqueeze(-1).to(
            self.embed_tokens.weight.dtype
        )
        return self.shard.all_reduce(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] -> logits [N, V] in the model dtype (the sampler upcasts when it must)
        if self.head_packed is not None:
            return cpu_paged.amx_linear(hidden, self.head_packed, self.vocab_rows, self.head_tiles)
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            assert self.embed_tokens is not None
            logits = cpu_linear.linear(
                hidden, self.embed_tokens.weight, None, self.tied_packed, self.small_linear
            )
        if self.shard.tp_size == 1:
            return logits
        return self.shard.all_gather_last(logits)[:, : self.config.vocab_size]

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``compute_logits(hidden).argmax(-1)`` (the first index of each row's largest bf16
        logit) in one pass over the LM head that writes no logits, where the head is packed for
        the one-pass projection; else ``None`` (the caller computes the logits)."""
        if self.head_packed is None:
            return None
        return cpu_paged.amx_argmax(hidden, self.head_packed, self.vocab_rows, self.head_tiles)

    def prepack_linears(self, plan: cpu_linear.LinearPlan) -> int:
        """Reorder every dense projection's weight (and the LM head's) for ``plan``'s kernel;
        the packed weight replaces the plain one. The LM head of a whole (unsharded) model goes
        to the one-pass projection where ``cpu_linear.head_kernel`` names one. Returns the bytes
        packed. The ``avx2`` plan packs nothing: every projection and the LM head go to the
        AVX2 + FMA kernel on their plain weights."""
        if plan.path == "avx2":
            self.small_linear = cpu_paged.avx2_linear
            for m in self.modules():
                if isinstance(m, Linear):
                    m.small = cpu_paged.avx2_linear
        if not plan.packed:
            return 0
        total = 0
        head = self.lm_head.weight if self.lm_head is not None else None
        if head is None and self.embed_tokens is not None:
            head = self.embed_tokens.weight  # tied: the lookup keeps the table, this is a copy
        kernel = (
            cpu_linear.head_kernel(plan, head)
            if head is not None and self.shard.tp_size == 1 and self.shard.pp_size == 1
            else None
        )
        if head is not None and kernel is not None:
            self.head_packed = cpu_paged.amx_pack(head)
            self.head_tiles = kernel == "amx"
            total += head.numel() * head.element_size()
            if self.lm_head is not None:
                del self.lm_head.weight
                self.lm_head.register_parameter("weight", None)
        for m in self.modules():
            if isinstance(m, Linear) and m.packed is None and m.weight is not None:
                w = m.weight
                # the amx plan: the tiles' layout where K allows it (a multiple of 32), else oneDNN
                m.tiles = plan.path == "amx" and w.dtype == torch.bfloat16 and w.shape[1] % 32 == 0
                m.tiles_n = w.shape[0]
                m.packed = cpu_paged.amx_pack(w) if m.tiles else cpu_linear.pack(w)
                total += m.weight.numel() * m.weight.element_size()
                del m.weight
                m.register_parameter("weight", None)
        if (
            self.lm_head is None
            and self.head_packed is None
            and self.embed_tokens is not None
            and self.shard.last_stage
        ):
            w = self.embed_tokens.weight  # the lookup still reads the plain table: a copy
            self.tied_packed = cpu_linear.pack(w)
            total += w.numel() * w.element_size()
        return total

    # ---- loading one rank's share ----------------------------------------------------
    def local_name(self, name: str) -> str | None:
        """Our parameter name for checkpoint name ``name`` (``layers.<i>`` renumbered within
        the stage), or ``None`` when this rank does not hold it."""
        if name.startswith("layers."):
            i, rest = name[len("layers.") :].split(".", 1)
            if int(i) not in self.layer_ids:
                return None
            return f"layers.{int(i) - self.layer_ids.start}.{rest}"
        if name.startswith("embed_tokens.") and self.embed_tokens is None:
            return None
        if name.startswith("lm_head.") and self.lm_head is None:
            return None
        if name.startswith("norm.") and not self.shard.last_stage:
            return None
        return name

    def shard_tensor(self, name: str, part: int | None, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of checkpoint tensor ``tensor`` for parameter ``name`` (``part``:
        q/k/v or gate/up within a fused weight)."""
        sh, cfg = self.shard, self.config
        if sh.tp_size == 1:
            return tensor
        d = cfg.head_dim
        if "qkv_proj" in name:
            first, n = sh.heads(cfg.num_heads) if part == 0 else sh.kv_heads(cfg.num_kv_heads)
            return tensor.narrow(0, first * d, n * d)
        if "gate_up_proj" in name:
            return tensor.narrow(0, *sh.columns(tensor.shape[0]))
        if name.endswith(("o_proj.bias", "down_proj.bias")):
            # row-parallel: the ranks' partial products are summed, so one rank adds the bias
            return tensor if sh.tp_rank == 0 else torch.zeros_like(tensor)
        if name.endswith("o_proj.weight"):
            first, n = sh.heads(cfg.num_heads)
            return tensor.narrow(1, first * d, n * d)
        if name.endswith("down_proj.weight"):
            return tensor.narrow(1, *sh.columns(tensor.shape[1]))
        if name in ("embed_tokens.weight", "lm_head.weight"):
            rows = tensor[self.vocab_start : self.vocab_start + self.vocab_rows]
            if rows.shape[0] < self.vocab_rows:  # the last rank's padding
                pad = rows.new_zeros(self.vocab_rows - rows.shape[0], rows.shape[1])
                rows = torch.cat([rows, pad])
            return rows
        return tensor


def fused_param_name(hf_name: str) -> tuple[str, int | None]:
    """Map a Hugging Face weight name to (our parameter, shard index within a fused weight)."""
    name = hf_name[len("model.") :] if hf_name.startswith("model.") else hf_name
    for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
        if f"self_attn.{proj}." in name:
            return name.replace(proj, "qkv_proj"), i
    for i, proj in enumerate(("gate_proj", "up_proj")):
        if f"mlp.{proj}." in name:
            return name.replace(proj, "gate_up_proj"), i
    return name, None
