"""The model runner: the only place that turns a ``SchedulerOutput`` into tensors (it reads
nothing else: no ``Request``).

It owns the model, the KV pool tensor (block-major, see docs/architecture.md), the host swap
pool and the sampler. ``execute`` runs block copies/swaps, one forward pass over the packed
tokens of every scheduled sequence, and samples the sequences that reached their last token.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Sequence

import numpy as np
import torch

from kernels import default_backend, get_backend
from shared.config import CacheConfig, ModelConfig, SchedulerConfig, usable_cores
from shared.engine.sampler import Sampler
from shared.engine.scheduler_output import (
    SampleResult,
    SampleSpec,
    SchedulerOutput,
    position_spec,
)
from shared.models.llama import AttentionMetadata
from shared.models.loader import load_model
from shared.models.quantization import weight_bytes

logger = logging.getLogger(__name__)
GiB = 1 << 30


def zeroed_host_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, pin: bool = False
) -> torch.Tensor:
    """A zero-filled CPU tensor whose pages are committed only when first written.

    Backed by an anonymous mmap, so a large KV pool costs memory only as blocks are used, and
    its address never moves (the UCX transport registers it once).
    """
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if pin:
        return torch.zeros(shape, dtype=dtype).pin_memory()
    buf = mmap.mmap(-1, max(nbytes, 1))
    t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    t._pdserve_mmap = buf  # keep the mapping alive with the tensor
    return t.view(dtype).view(shape)


def pack_chunks(
    chunks: Sequence[tuple[Sequence[int], int, Sequence[int]]],
    block_size: int,
    device: torch.device,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One forward pass's inputs for ``chunks`` of (block table, first position, tokens):
    the packed token ids and positions ``[T]`` and the attention metadata (the slot of
    position p is ``block_ids[p // block_size] * block_size + p % block_size``)."""
    bs = block_size
    n_seqs = len(chunks)
    total = sum(len(toks) for _, _, toks in chunks)
    input_ids = np.empty(total, dtype=np.int64)
    positions = np.empty(total, dtype=np.int64)
    slots = np.empty(total, dtype=np.int64)
    seq_lens = np.empty(n_seqs, dtype=np.int32)
    qsl = np.zeros(n_seqs + 1, dtype=np.int32)
    tables = np.zeros((n_seqs, max(len(b) for b, _, _ in chunks)), dtype=np.int32)
    t = 0
    for i, (block_ids, c, token_ids) in enumerate(chunks):
        n = len(token_ids)
        ids = np.asarray(block_ids, dtype=np.int64)
        tables[i, : len(ids)] = ids
        if n == 1:
            input_ids[t] = token_ids[0]
            positions[t] = c
            slots[t] = ids[c // bs] * bs + c % bs
        else:
            pos = np.arange(c, c + n)
            input_ids[t : t + n] = token_ids
            positions[t : t + n] = pos
            slots[t : t + n] = ids[pos // bs] * bs + pos % bs
        t += n
        seq_lens[i] = c + n
        qsl[i + 1] = t
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        block_tables=torch.from_numpy(tables).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device),
        query_start_loc=torch.from_numpy(qsl).to(device),
        decode_only=total == n_seqs,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return torch.from_numpy(input_ids).to(device), torch.from_numpy(positions).to(device), meta


SMALL_STEP_TOKENS = 4


def small_step_tokens(device: torch.device, threads: int) -> int:
    """Steps of at most this many tokens run on one thread (0: never). On a CPU whose every
    core the worker's threads take (the router and the clients then share them), a decode step
    of a few sequences loses more waiting for its second thread's core than it gains from it:
    vLLM's c=1 workload ran 0.71x vLLM's throughput with 2 threads and 0.96x like this
    (docs/benchmarks.md, "Topology"). ``PDSERVE_SMALL_STEP_TOKENS`` overrides (0: off)."""
    env = os.environ.get("PDSERVE_SMALL_STEP_TOKENS")
    if env is not None:
        return max(0, int(env))
    if device.type != "cpu" or threads < 2:
        return 0
    return SMALL_STEP_TOKENS if threads >= usable_cores() else 0


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device: str,
        attention_backend: str | None,
        seed: int | None,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.device = torch.device(device)
        if self.device.type == "cpu":
            threads = os.environ.get("PDSERVE_NUM_THREADS")
            if threads:
                torch.set_num_threads(int(threads))
        self._threads = self._threads_now = torch.get_num_threads()
        self._small_step_tokens = small_step_tokens(self.device, self._threads)
        self.backend_name = attention_backend or default_backend(device)
        self.backend = get_backend(self.backend_name)
        self.dtype = getattr(torch, model_config.dtype)
        self.kv_dtype = (
            torch.float8_e4m3fn if cache_config.kv_cache_dtype == "fp8_e4m3" else self.dtype
        )
        if seed is not None:
            torch.manual_seed(seed)
        self.model = load_model(model_config, device, self.backend)
        q = model_config.quantization
        logger.info(
            "model weights: %.1f MiB read per decode step (%s)",
            weight_bytes(self.model) / (1 << 20),
            q.describe() if q is not None else f"{model_config.dtype}, not quantized",
        )
        if self._small_step_tokens:
            logger.info(
                "torch threads: %d; steps of at most %d tokens on 1 (the worker's threads "
                "take every core; PDSERVE_SMALL_STEP_TOKENS=0 turns this off)",
                self._threads,
                self._small_step_tokens,
            )
        self.sampler = Sampler(
            model_config.vocab_size, self.device, seed, argmax_rows=self.backend.argmax_rows
        )
        self.block_size = cache_config.block_size
        self.drafter = None  # DraftModelProposer (shared/engine/draft_model.py) when configured
        self.kv_cache: torch.Tensor | None = None
        self.host_cache: torch.Tensor | None = None
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def attach_draft_model(self, spec, num_blocks: int) -> None:  # type: ignore[no-untyped-def]
        """Load the speculative draft model with a KV twin pool of ``num_blocks`` blocks."""
        from shared.engine.draft_model import DraftModelProposer

        self.drafter = DraftModelProposer(self, spec, num_blocks)

    # ---- KV pool -----------------------------------------------------------------------
    @property
    def block_shape(self) -> tuple[int, ...]:
        m = self.model_config
        return (m.num_layers, 2, self.block_size, m.num_kv_heads, m.head_dim)

    @property
    def block_bytes(self) -> int:
        return int(np.prod(self.block_shape)) * torch.empty((), dtype=self.kv_dtype).element_size()

    def kv_cache_budget(self) -> int:
        """Bytes available for the KV pool (``--kv-cache-memory`` or by memory sizing)."""
        cc = self.cache_config
        if cc.kv_cache_memory is not None:
            return cc.kv_cache_memory
        if self.device.type == "cuda":
            return self._profile_cuda_budget()
        # CPU: vLLM's default KV space is 4 GiB; never more than a fifth of the machine.
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(min(4 * GiB, 0.2 * total))

    def _profile_cuda_budget(self) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(self.scheduler_config.max_num_batched_tokens, self.model_config.max_model_len)
        nb = -(-n // self.block_size)
        dummy = torch.zeros((nb, *self.block_shape), dtype=self.kv_dtype, device=self.device)
        saved = self.kv_cache
        self.kv_cache = dummy
        self._init_scales()
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=self.device),
            block_tables=torch.arange(nb, dtype=torch.int32, device=self.device).unsqueeze(0),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            decode_only=False,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
        with torch.inference_mode():
            h = self.model(
                torch.zeros(n, dtype=torch.long, device=self.device),
                torch.arange(n, device=self.device),
                dummy,
                meta,
            )
            self.model.compute_logits(h[-self.scheduler_config.max_num_seqs :])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        del dummy, h
        self.kv_cache = saved
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * self.cache_config.gpu_memory_utilization) - peak - used_by_others
        if budget <= 0:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: --gpu-memory-utilization "
                f"{self.cache_config.gpu_memory_utilization} of {total / GiB:.1f} GiB is taken by "
                f"weights and activations ({peak / GiB:.2f} GiB)"
            )
        return budget

    def num_blocks_for(self, budget: int) -> int:
        return max(0, budget // self.block_bytes)

    def allocate_kv_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        shape = (num_blocks, *self.block_shape)
        if self.device.type == "cpu":
            self.kv_cache = zeroed_host_tensor(shape, self.kv_dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        if num_host_blocks:
            self.host_cache = zeroed_host_tensor(
                (num_host_blocks, *self.block_shape), self.kv_dtype, pin=self.device.type == "cuda"
            )
        self._init_scales()

    def _init_scales(self) -> None:
        if self.kv_dtype == torch.float8_e4m3fn:
            # No calibration data: scale 1.0 per tensor, as vLLM does without kv-scale checkpoints.
            self.k_scale = torch.ones(1, dtype=torch.float32, device=self.device)
            self.v_scale = torch.ones(1, dtype=torch.float32, device=self.device)

    # ---- one step ----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampleResult]:
        """Copies / swaps, one forward pass over every scheduled chunk, and one draw per
        ``SampleSpec``; returns the draws by ``seq_id``."""
        assert self.kv_cache is not None, "allocate_kv_cache() first"
        if out.finished_seq_ids:
            self.sampler.matchers.drop(out.finished_seq_ids)
        self._move_blocks(out)
        if not out.scheduled:
            return {}
        drafted: dict[str, list[int]] = {}  # draft-model drafts, by seq id
        draft_probs: dict[str, torch.Tensor] = {}
        if self.drafter is not None and any(s.num_lookahead for s in out.scheduled):
            drafted, draft_probs = self.drafter.propose(out, self.sampler)
        chunks: list[tuple[Sequence[int], int, Sequence[int]]] = []
        logit_rows: list[int] = []
        rows: list[SampleSpec] = []
        t = 0
        verify: list[tuple[str, list[int], int]] = []  # (seq id, drafts, first row index)
        for s in out.scheduled:
            token_ids = s.token_ids
            drafts = list(s.draft_token_ids)
            if s.num_lookahead:
                drafts = drafted[s.seq_id]
                token_ids = [*s.token_ids, *drafts]
            chunks.append((s.block_ids, s.start, token_ids))
            t += len(token_ids)
            if drafts:  # one row per verified position: the last token's and each draft's
                (spec,) = s.samples
                verify.append((s.seq_id, drafts, len(rows)))
                for j in range(len(drafts) + 1):
                    logit_rows.append(t - 1 - len(drafts) + j)
                    rows.append(position_spec(spec, drafts, j))
                continue
            for spec in s.samples:
                logit_rows.append(t - 1)
                rows.append(spec)
        input_ids, positions, meta = pack_chunks(
            chunks, self.block_size, self.device, self.k_scale, self.v_scale
        )
        if self._small_step_tokens and self._threads > 1:
            want = 1 if t <= self._small_step_tokens else self._threads
            if want != self._threads_now:
                torch.set_num_threads(want)
                self._threads_now = want
        dev = self.device
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        if not rows:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(logit_rows, device=dev)])
        if not verify:
            sampled = self.sampler(logits, rows)
            return {r.seq_id: tok for r, tok in zip(rows, sampled)}
        covered = {i for _, d, first in verify for i in range(first, first + len(d) + 1)}
        plain = [i for i in range(len(rows)) if i not in covered]
        result: dict[str, SampleResult] = {}
        if plain:
            idx = torch.tensor(plain, device=dev)
            for i, tok in zip(plain, self.sampler(logits[idx], [rows[i] for i in plain])):
                result[rows[i].seq_id] = tok
        for seq_id, drafts, first in verify:
            k = len(drafts)
            result[seq_id] = self.sampler.verify(
                logits[first : first + k + 1],
                rows[first : first + k + 1],
                drafts,
                draft_probs.get(seq_id),
            )
        return result

    def _move_blocks(self, out: SchedulerOutput) -> None:
        # Byte views: index_put is not implemented for every dtype (fp8), bytes always are.
        kv = self.kv_cache.view(torch.uint8)
        host = self.host_cache.view(torch.uint8) if self.host_cache is not None else None
        if out.blocks_to_swap_out:
            d, h = zip(*out.blocks_to_swap_out)
            host[list(h)] = kv[list(d)].to(host.device)
        if out.blocks_to_swap_in:
            h, d = zip(*out.blocks_to_swap_in)
            kv[list(d)] = host[list(h)].to(kv.device)
        if out.blocks_to_copy:
            s, d = zip(*out.blocks_to_copy)
            kv[list(d)] = kv[list(s)]
