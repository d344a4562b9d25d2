"""The model runner: the only place that turns a ``SchedulerOutput`` into tensors (it reads
nothing else: no ``Request``).

It owns the model, the KV pool tensor (block-major, see docs/architecture.md), the host swap
pool and the sampler. ``execute`` runs block copies/swaps, one forward pass over the packed
tokens of every scheduled sequence, and samples the sequences that reached their last token.
"""

from __future__ import annotations

import errno
import functools
import logging
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels import default_backend, get_backend
from shared.config import (
    KV_HUGEPAGES_ENV,
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    env_int,
    usable_cores,
)
from shared.cpu_bind import (
    HEAVY_SPILL_STEP_TOKENS,
    SPILL_STEP_TOKENS,
    bound_cpus,
    format_cpu_list,
    spill_cpus,
)
from shared.engine.request import Logprob
from shared.engine.sampler import Sampler
from shared.engine.scheduler_output import (
    SampledToken,
    SampleResult,
    SampleSpec,
    SchedulerOutput,
    position_spec,
)
from shared.models.llama import AttentionMetadata
from shared.models.loader import load_model
from shared.models.quantization import weight_bytes
from shared.models.sharding import Shard

if TYPE_CHECKING:
    from shared.engine.draft_model import DraftModelProposer

logger = logging.getLogger(__name__)
GiB = 1 << 30


def zeroed_host_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, pin: bool = False
) -> torch.Tensor:
    """A zero-filled CPU tensor whose pages are committed only when first written.

    Backed by a private anonymous mmap, so a large KV pool costs memory only as blocks are
    used, and its address never moves (the UCX transport registers it once). Transparent huge
    pages are asked for (``MADV_HUGEPAGE``; ``PDSERVE_KV_HUGEPAGES=0`` turns it off): decode
    attention reads blocks all over the pool, and a decode step at batch 64 over 1,088-token
    contexts took 0.72× the time on huge pages (docs/benchmarks.md, "The KV pool on huge
    pages"). Python's default ``mmap(-1, n)`` is a *shared* mapping (shmem), which gets no
    huge pages where the system's shmem THP setting is ``never`` (the default). ``pdserve up``
    turns them off for a disaggregated cluster's workers (see ``Cluster.spawn_worker``).
    """
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if pin:
        return torch.zeros(shape, dtype=dtype).pin_memory()
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if env_int(KV_HUGEPAGES_ENV, 1) and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError as e:  # a kernel without THP: 4 KiB pages, as before
            logger.debug("MADV_HUGEPAGE refused (%s): the KV pool stays on 4 KiB pages", e)
    t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    t._pdserve_mmap = buf  # keep the mapping alive with the tensor
    return t.view(dtype).view(shape)


#: madvise(2) advice (Linux 5.14+): fault a range's pages in writable without changing them.
MADV_POPULATE_WRITE = 23
_madvise_ok: bool | None = None  # None: not tried yet; False: this kernel lacks it


@functools.cache
def _libc_madvise():  # type: ignore[no-untyped-def]
    import ctypes

    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _madvise_populate(addr: int, length: int) -> int:
    """``madvise(addr, length, MADV_POPULATE_WRITE)``: 0, or the errno it failed with."""
    import ctypes

    if _libc_madvise()(addr, length, MADV_POPULATE_WRITE) == 0:
        return 0
    return ctypes.get_errno()


def populate_pages(t: torch.Tensor, start: int, stop: int) -> None:
    """Commit the memory pages under bytes ``[start, stop)`` of the contiguous CPU tensor
    ``t`` (from :func:`zeroed_host_tensor`) without changing what they hold.

    ``madvise(MADV_POPULATE_WRITE)`` over the pages (whole pages: bytes of a neighbouring
    block on a shared page are faulted in but never written). On a kernel without it (before
    Linux 5.14) one byte of each page in the range is read and written back: that is a
    write, so the range must hold no block another thread may be writing (the engine passes
    only blocks its pool has never handed out). Raises ``OSError`` when the kernel cannot
    commit the pages (``ENOMEM``: the machine is out of memory).
    """
    global _madvise_ok
    if start >= stop:
        return
    page = mmap.PAGESIZE
    if _madvise_ok is not False:
        base = t.data_ptr() + start
        first = base - base % page
        err = _madvise_populate(first, t.data_ptr() + stop - first)
        if err == 0:
            _madvise_ok = True
            return
        if err not in (errno.EINVAL, errno.ENOSYS) or _madvise_ok:
            raise OSError(err, f"committing the KV pool's pages: {os.strerror(err)}")
        _madvise_ok = False
        logger.info("madvise(MADV_POPULATE_WRITE) unsupported: touching one byte per page")
    flat = t.reshape(-1).view(torch.uint8)
    touched = flat[start:stop:page]  # one byte in each page of the range
    touched.copy_(touched.clone())


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


@dataclass
class PendingLogits:
    """Rank 0 of a pipeline: the last stage's logits of a dispatched step, on their way."""

    logits: torch.Tensor
    work: object  # the irecv

    def wait(self) -> torch.Tensor:
        """The logits; on CPU (gloo) a last stage that does not send them within
        ``PDSERVE_DIST_TIMEOUT_S`` raises ``CommTimeoutError`` (a stuck rank)."""
        _wait_handoff(self.work, self.logits, "waiting for the last pipeline stage's logits")
        return self.logits


def _wait_handoff(work: object, t: torch.Tensor, what: str) -> None:
    """Wait for a pipeline hand-off (isend / irecv): bounded on CPU (gloo's wait with a
    timeout, see shared/engine/distributed.py::wait_work); on CUDA NCCL's own (stream-ordered,
    its watchdog holds the group's timeout)."""
    if t.device.type == "cpu":
        from shared.engine.distributed import wait_work

        wait_work(work, what)
    else:
        work.wait()  # type: ignore[attr-defined]


@dataclass
class GreedyTokens:
    """A step whose rows are all plain greedy, drawn with the LM head (the model's
    ``greedy_tokens``): each row's token, no logits."""

    ids: torch.Tensor  # [rows] int64


@dataclass
class _Dispatched:
    """A step between ``dispatch`` and ``collect``: its logits (or their pending receive, or
    the greedy draws themselves) and what the draws need."""

    logits: torch.Tensor | PendingLogits | GreedyTokens | None
    rows: list[SampleSpec]
    verify: list[tuple[str, list[int], int]]
    draft_probs: dict[str, torch.Tensor]
    # prompt_logprobs: (seq id, targets, top-N) per chunk, their logit rows after ``rows``'
    prompt_rows: list[tuple[str, tuple[int, ...], int]] = field(default_factory=list)
    # seq ids whose grammar matchers a later dispatch dropped while this step was in flight
    # (pipeline parallelism: an abort): dropped again once this step's draws are made
    dropped: set[str] = field(default_factory=set)


SMALL_STEP_TOKENS = 4
PROMPT_LOGPROB_ROWS = 256  # rows per log_softmax pass (a 2,048-token chunk: 8 passes)


def prompt_logprobs(
    logits: torch.Tensor, items: Sequence[tuple[str, tuple[int, ...], int]]
) -> dict[str, list[Logprob]]:
    """Each item's logprobs (``items``: seq id, prompt targets, top-N; their rows follow one
    another in ``logits``): the raw model's log-softmax at each row, the target token's value
    and 1-based rank, and the top N, as the sampler gives a sampled token's."""
    out: dict[str, list[Logprob]] = {}
    row = 0
    for seq_id, targets, top in items:
        lps: list[Logprob] = []
        for a in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            part = targets[a : a + PROMPT_LOGPROB_ROWS]
            raw = torch.log_softmax(logits[row + a : row + a + len(part)].float(), dim=-1)
            tgt = torch.tensor(part, device=raw.device)
            lp = raw.gather(1, tgt[:, None])
            ranks = ((raw > lp).sum(dim=1) + 1).tolist()
            tops: list[list[tuple[int, float]]] = [[] for _ in part]
            if top:
                vals, ids = raw.topk(top, dim=-1)
                tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
            lps += [Logprob(v, r, t) for v, r, t in zip(lp[:, 0].tolist(), ranks, tops)]
        out[seq_id] = lps
        row += len(targets)
    return out


def small_step_tokens(device: torch.device, threads: int, heavy: bool = False) -> int:
    """Steps of at most this many tokens run on one thread (0: never). On a CPU whose every
    core the worker's threads take (the router and the clients then share them), a decode step
    of a few sequences loses more waiting for its second thread's core than it gains from it:
    vLLM's c=1 workload ran 0.71x vLLM's throughput with 2 threads and 0.96x like this
    (docs/benchmarks.md, "Topology"). Not for a worker bound to cores of its own
    (``shared/cpu_bind.py``): nothing else runs there. A lone worker with spill CPUs keeps
    steps of up to ``SPILL_STEP_TOKENS`` (decode steps) on its own; with ``heavy`` projections
    (the ``avx2`` linear plan: bf16 widened to fp32 FMAs, a decode step 3-4x the compute of
    one on bf16 dot products, the router's share of the second core the same) only steps of
    up to ``HEAVY_SPILL_STEP_TOKENS``: vLLM's r256_n64 / c16 ran 1.13x / 1.10x with that on a Zen 3
    EPYC (docs/benchmarks.md, "Decode steps on both cores where the projections are heavy").
    ``PDSERVE_SMALL_STEP_TOKENS`` overrides (0: off)."""
    env = env_int("PDSERVE_SMALL_STEP_TOKENS", -1)
    if env >= 0:
        return env
    if device.type != "cpu" or threads < 2:
        return 0
    if spill_cpus():  # a lone worker's cores plus the router's for long steps only
        return HEAVY_SPILL_STEP_TOKENS if heavy else SPILL_STEP_TOKENS
    if bound_cpus() is not None:
        return 0
    return SMALL_STEP_TOKENS if threads >= usable_cores() else 0


SPILL_KV_TOKENS = 49152


def spill_kv_tokens() -> int:
    """A step small enough for one thread (``small_step_tokens``) still takes every thread when
    its attention reads at least this many distinct cached tokens (``ModelRunner._reads_much_kv``;
    0: never). A decode step of many long sequences is bound by reading their K/V, and one
    core draws about half of this machine's memory bandwidth: vLLM's r1088_n64 (64 x 1,088
    tokens, colocated) ran 3.8-9.6 % faster with such steps on both cores in three A/Bs
    (docs/benchmarks.md, "Long decode steps on both cores"). Above the largest decode step of
    256-token prompts (128 x ~320 tokens), which gained nothing from it.
    ``PDSERVE_SPILL_KV_TOKENS`` overrides."""
    return env_int("PDSERVE_SPILL_KV_TOKENS", SPILL_KV_TOKENS)


class ModelRunner:
    """One rank's model, KV pool and (on rank 0) sampler. With ``parallel`` of more than one
    rank, rank 0 (the serving process) starts the others (shared/engine/distributed.py) and
    broadcasts each step to them; every rank holds its ``Shard`` of the weights and a pool of
    the same block count holding its layers and KV heads."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device: str,
        attention_backend: str | None,
        seed: int | None,
        parallel: ParallelConfig | None = None,
        rank: int = 0,
        groups: list | None = None,
        comm: object = None,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.parallel = pc = parallel or ParallelConfig()
        self.rank = rank
        self.world_size = pc.world_size
        self.executor = None  # rank 0 of several: the MultiprocExecutor
        if self.world_size > 1 and rank == 0:
            from shared.engine.distributed import MultiprocExecutor, WorkerSpec

            self.executor = MultiprocExecutor(
                WorkerSpec(
                    model_config,
                    cache_config,
                    scheduler_config,
                    device,
                    attention_backend,
                    seed,
                    pc,
                )
            )
            groups, comm = self.executor.groups, self.executor.comm
        try:
            self._build(groups, comm, device, attention_backend, seed)
        except BaseException:
            self.shutdown()
            raise

    def _build(
        self,
        groups: list | None,
        comm: object,
        device: str,
        attention_backend: str | None,
        seed: int | None,
    ) -> None:
        pc, model_config, cache_config = self.parallel, self.model_config, self.cache_config
        stage = self.rank // pc.tensor_parallel_size
        self.shard = self._shard_of(self.rank, groups[stage] if groups else None, comm)
        self.device = torch.device(device)
        if self.device.type == "cpu":
            threads = env_int("PDSERVE_NUM_THREADS", 0, minimum=1)
            if threads:
                torch.set_num_threads(threads)
            elif self.world_size > 1:  # the node's cores split between its ranks
                torch.set_num_threads(max(1, usable_cores() // pc.local_world_size))
        self._threads = self._threads_now = torch.get_num_threads()
        self._spill_kv_tokens = spill_kv_tokens()
        # with spill CPUs (shared/cpu_bind.py) short steps run on the worker's own CPUs, one
        # thread each, the engine thread pinned there; long steps widen it to the spill CPUs
        # first, so the thread pool they start may run there too
        home = bound_cpus() if self.device.type == "cpu" else None
        spill = [c for c in spill_cpus() if c not in home] if home else []
        self._cpus_small = home if spill else None  # None: no spill CPUs
        self._cpus_large = home + spill if home and spill else None
        self._small_threads = max(1, min(self._threads, len(home))) if home and spill else 1
        if self._cpus_small is not None:
            self._threads_now = 0  # the first step sets both (the process is on home only)
        self.backend_name = attention_backend or default_backend(device)
        self.backend = get_backend(self.backend_name)
        self.dtype = getattr(torch, model_config.dtype)
        self.kv_dtype = (
            torch.float8_e4m3fn if cache_config.kv_cache_dtype == "fp8_e4m3" else self.dtype
        )
        if seed is not None:
            torch.manual_seed(seed)
        self.model = load_model(model_config, device, self.backend, self.shard)
        # known once the model's linear plan is made
        heavy = self.model.heavy_projections()
        self._small_step_tokens = small_step_tokens(self.device, self._threads, heavy)
        q = model_config.quantization
        logger.info(
            "model weights: %.1f MiB read per decode step (%s)%s",
            weight_bytes(self.model) / (1 << 20),
            q.describe() if q is not None else f"{model_config.dtype}, not quantized",
            self._rank_note(),
        )
        if self._cpus_small is not None:
            logger.info(
                "torch threads: %d on CPU %s for steps of at most %d tokens over fewer than %d "
                "cached ones, %d on CPU %s for the others (PDSERVE_CPU_SPILL_BIND; "
                "PDSERVE_SMALL_STEP_TOKENS and PDSERVE_SPILL_KV_TOKENS set the sizes, 0: off)",
                self._small_threads,
                format_cpu_list(self._cpus_small),
                self._small_step_tokens,
                self._spill_kv_tokens,
                self._threads,
                format_cpu_list(self._cpus_large or []),
            )
        elif self._small_step_tokens:
            logger.info(
                "torch threads: %d; steps of at most %d tokens over fewer than %d cached ones "
                "on 1 (the worker's threads take every core; PDSERVE_SMALL_STEP_TOKENS=0 turns "
                "this off, PDSERVE_SPILL_KV_TOKENS sets the cached tokens, 0: any)",
                self._threads,
                self._small_step_tokens,
                self._spill_kv_tokens,
            )
        self.sampler = Sampler(
            model_config.vocab_size,
            self.device,
            seed,
            argmax_rows=self.backend.argmax_rows,
            race_rows=getattr(self.backend, "race_rows", None),
            cut_rows=getattr(self.backend, "cut_rows", None),
        )
        self.block_size = cache_config.block_size
        self.drafter: DraftModelProposer | None = None  # a draft model, when configured
        self.kv_cache: torch.Tensor | None = None
        self.host_cache: torch.Tensor | None = None
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None  # rank 0 of several: canonical transfer pool
        self._sends: list = []  # pipeline hand-offs in flight: (isend work, its buffer)
        self._prompt_logprobs: dict[str, list[Logprob]] = {}  # the last collected step's
        self._uncollected: list[_Dispatched] = []  # dispatched steps not collected yet

    def _shard_of(self, rank: int, group: object = None, comm: object = None) -> Shard:
        """What rank ``rank`` of this worker holds (global rank ``pp_rank * TP + tp_rank``)."""
        pc = self.parallel
        tp = pc.tensor_parallel_size
        start, end = pc.layer_range(rank // tp, self.model_config.num_layers)
        return Shard(
            tp_size=tp,
            tp_rank=rank % tp,
            pp_size=pc.pipeline_parallel_size,
            pp_rank=rank // tp,
            layer_start=start,
            layer_end=end,
            group=group,
            comm=comm,
        )

    def _rank_note(self) -> str:
        if self.world_size == 1:
            return ""
        sh, m = self.shard, self.model_config
        return (
            f" on rank {self.rank} (TP {sh.tp_rank}/{sh.tp_size}: {sh.heads(m.num_heads)[1]} of "
            f"{m.num_heads} heads, {sh.kv_heads(m.num_kv_heads)[1]} of {m.num_kv_heads} KV heads; "
            f"PP {sh.pp_rank}/{sh.pp_size}: layers {sh.layer_start}-{sh.layer_end - 1})"
        )

    def check_alive(self) -> None:
        """Raise ``RankDiedError`` if another rank of this worker has exited."""
        if self.executor is not None:
            self.executor.check_alive()

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()

    def load_draft_model(self, spec) -> int:  # type: ignore[no-untyped-def]
        """Load the speculative draft model's weights (before the KV budget is measured, so
        a CUDA profile counts them); the bytes of one block of its KV twin pool."""
        from shared.engine.draft_model import DraftModelProposer

        if self.drafter is None:
            self.drafter = DraftModelProposer(self, spec)
        return self.drafter.block_bytes

    def attach_draft_model(self, spec, num_blocks: int) -> None:  # type: ignore[no-untyped-def]
        """Load the speculative draft model (unless :meth:`load_draft_model` did) with a KV
        twin pool of ``num_blocks`` blocks."""
        self.load_draft_model(spec)
        assert self.drafter is not None
        self.drafter.allocate_kv(num_blocks)

    # ---- KV pool -----------------------------------------------------------------------
    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block of this rank's pool: its stage's layers and its KV heads."""
        m = self.model_config
        layers = len(self.shard.layers(m.num_layers))
        return (layers, 2, self.block_size, self.shard.kv_heads(m.num_kv_heads)[1], m.head_dim)

    @property
    def canonical_block_shape(self) -> tuple[int, ...]:
        """One block of the whole model (every layer and KV head): what KV transfer moves."""
        m = self.model_config
        return (m.num_layers, 2, self.block_size, m.num_kv_heads, m.head_dim)

    def _nbytes(self, shape: tuple[int, ...]) -> int:
        return int(np.prod(shape)) * torch.empty((), dtype=self.kv_dtype).element_size()

    @property
    def block_bytes(self) -> int:
        return self._nbytes(self.block_shape)

    @property
    def transfer_block_bytes(self) -> int:
        return self._nbytes(self.canonical_block_shape)

    @property
    def transfer_pool(self) -> torch.Tensor:
        """The tensor KV transfer reads and writes, in the canonical layout: the pool itself
        with one rank; with several, a host pool of the same block count (pages committed as
        blocks pass through it) that :meth:`export_blocks` fills from every rank's shard and
        :meth:`import_blocks` scatters back."""
        assert self.kv_cache is not None, "allocate_kv_cache() first"
        if self.world_size == 1:
            return self.kv_cache
        if self._staging is None:
            with torch.inference_mode(False):  # written by transfers and tests, not only steps
                self._staging = zeroed_host_tensor(
                    (self.kv_cache.shape[0], *self.canonical_block_shape), self.kv_dtype
                )
        return self._staging

    def kv_cache_budget(self) -> int:
        """Bytes available for the KV pool (``--kv-cache-memory`` or by memory sizing)."""
        cc = self.cache_config
        if cc.kv_cache_memory is not None:
            return cc.kv_cache_memory
        if self.device.type == "cuda":
            return self._profile_cuda_budget()
        # CPU: vLLM's default KV space is 4 GiB (per rank); never more than a fifth of the
        # machine over this node's ranks.
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(min(4 * GiB, 0.2 * total / self.parallel.local_world_size))

    def _profile_cuda_budget(self) -> int:
        if self.world_size > 1:  # a profiling pass would need every rank: weights only
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - total * (1 - self.cache_config.gpu_memory_utilization))
            logger.warning(
                "TP/PP: the KV budget (%.2f GiB) is free memory less (1 - "
                "--gpu-memory-utilization); activations were not profiled",
                budget / GiB,
            )
            return max(0, budget)
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
        if self.executor is not None:
            self.executor.broadcast(("alloc", num_blocks, num_host_blocks))
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
        if self.executor is not None:  # the last of start-up: every rank loaded
            self.executor.wait_ready()

    @property
    def can_prefault(self) -> bool:
        """Whether :meth:`prefault_blocks` can commit this process's KV pool (one CPU rank;
        the ranks of TP / PP are other processes and commit their shards as they are used)."""
        return self.device.type == "cpu" and self.world_size == 1 and self.kv_cache is not None

    def prefault_blocks(self, start: int, stop: int) -> None:
        """Commit the memory of blocks ``[start, stop)`` of the KV pool (and of the draft
        model's twin pool), leaving their contents as they are: see
        ``EngineCore.prefault_kv``. Blocks another thread may be writing must not be in the
        range (:func:`populate_pages`)."""
        assert self.can_prefault, "prefault_blocks needs a single-rank CPU pool"
        pools = [self.kv_cache]
        if self.drafter is not None and self.drafter.kv is not None:
            pools.append(self.drafter.kv)
        for pool in pools:
            assert pool is not None
            per_block = pool[0].numel() * pool.element_size()
            populate_pages(pool, start * per_block, stop * per_block)

    def _init_scales(self) -> None:
        if self.kv_dtype == torch.float8_e4m3fn:
            # No calibration data: scale 1.0 per tensor, as vLLM does without kv-scale checkpoints.
            self.k_scale = torch.ones(1, dtype=torch.float32, device=self.device)
            self.v_scale = torch.ones(1, dtype=torch.float32, device=self.device)

    # ---- one step ----------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> dict[str, SampleResult]:
        """Copies / swaps, one forward pass over every scheduled chunk, and one draw per
        ``SampleSpec``; returns the draws by ``seq_id`` (rank 0)."""
        return self.collect(self.dispatch(out))

    def take_prompt_logprobs(self) -> dict[str, list[Logprob]]:
        """The prompt logprobs of the last collected step, by seq id (then forgotten)."""
        out, self._prompt_logprobs = self._prompt_logprobs, {}
        return out

    @property
    def pipeline_depth(self) -> int:
        """Steps that may be in flight at once: the pipeline stages (``dispatch`` returns
        once stage 0 has its share of a step; ``collect`` waits for the logits)."""
        return self.shard.pp_size

    @torch.inference_mode()
    def dispatch(self, out: SchedulerOutput) -> _Dispatched:
        """Start a step: everything but the draws (see :meth:`collect`)."""
        assert self.kv_cache is not None, "allocate_kv_cache() first"
        if out.finished_seq_ids:
            self.sampler.matchers.drop(out.finished_seq_ids)
            # a step still in flight may hold one of them (aborted meanwhile): its draws
            # would build the matcher again, so it drops them again once collected
            for older in self._uncollected:
                older.dropped.update(out.finished_seq_ids)
        d = self._dispatch(out)
        self._uncollected.append(d)
        return d

    def _dispatch(self, out: SchedulerOutput) -> _Dispatched:
        moves = (out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)
        if not out.scheduled:
            self.run_step(moves, [], [])
            return _Dispatched(None, [], [], {}, [])
        drafted: dict[str, list[int]] = {}  # draft-model drafts, by seq id
        draft_probs: dict[str, torch.Tensor] = {}
        if self.drafter is not None and any(s.num_lookahead for s in out.scheduled):
            drafted, draft_probs = self.drafter.propose(out, self.sampler)
        chunks: list[tuple[Sequence[int], int, Sequence[int]]] = []
        logit_rows: list[int] = []
        rows: list[SampleSpec] = []
        t = 0
        verify: list[tuple[str, list[int], int]] = []  # (seq id, drafts, first row index)
        prompt_rows: list[tuple[str, tuple[int, ...], int]] = []
        prompt_logit_rows: list[int] = []  # packed after the sampling rows
        for s in out.scheduled:
            token_ids = s.token_ids
            drafts = list(s.draft_token_ids)
            if s.num_lookahead:
                drafts = drafted[s.seq_id]
                token_ids = [*s.token_ids, *drafts]
            chunks.append((s.block_ids, s.start, token_ids))
            if s.prompt_logprob_targets:  # the chunk's first positions predict these
                prompt_rows.append((s.seq_id, s.prompt_logprob_targets, s.prompt_logprobs_top))
                prompt_logit_rows.extend(range(t, t + len(s.prompt_logprob_targets)))
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
        greedy = not verify and not prompt_rows and self.sampler.plain_greedy(rows)
        return _Dispatched(
            self.run_step(moves, chunks, logit_rows + prompt_logit_rows, greedy),
            rows,
            verify,
            draft_probs,
            prompt_rows,
        )

    @torch.inference_mode()
    def collect(self, d: _Dispatched) -> dict[str, SampleResult]:
        """Finish a dispatched step: wait for its logits, draw; the draws by ``seq_id``."""
        for i, x in enumerate(self._uncollected):
            if x is d:
                del self._uncollected[i]
                break
        try:
            return self._collect(d)
        finally:
            if d.dropped:  # their sequences ended while in flight: no matcher stays behind
                self.sampler.matchers.drop(d.dropped & {r.seq_id for r in d.rows})

    def _collect(self, d: _Dispatched) -> dict[str, SampleResult]:
        logits = d.logits.wait() if isinstance(d.logits, PendingLogits) else d.logits
        self._prompt_logprobs = {}
        if logits is None:
            return {}
        rows, verify, draft_probs = d.rows, d.verify, d.draft_probs
        if d.prompt_rows:
            assert isinstance(logits, torch.Tensor)  # no greedy-only draw with prompt rows
            self._prompt_logprobs = prompt_logprobs(logits[len(rows) :], d.prompt_rows)
            if not rows:
                return {}
            logits = logits[: len(rows)]
        if isinstance(logits, GreedyTokens):
            return {r.seq_id: SampledToken(t) for r, t in zip(rows, logits.ids.tolist())}
        dev = self.device
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

    def _reads_much_kv(self, chunks: Sequence[tuple[Sequence[int], int, Sequence[int]]]) -> bool:
        """Whether the step's attention reads at least ``spill_kv_tokens`` distinct cached
        tokens: the sequences' lengths, and where they add up to that, their distinct blocks
        (a prefix that several sequences share is read once for all of them, so a batch
        sharing long prompts reads little and stays on one thread)."""
        limit = self._spill_kv_tokens
        if sum(c + len(toks) for _, c, toks in chunks) < limit:
            return False
        return len(set().union(*(b for b, _, _ in chunks))) * self.block_size >= limit

    @torch.inference_mode()
    def run_step(
        self,
        moves: tuple[Sequence[tuple[int, int]], ...],
        chunks: Sequence[tuple[Sequence[int], int, Sequence[int]]],
        logit_rows: Sequence[int],
        greedy: bool = False,
    ) -> torch.Tensor | PendingLogits | GreedyTokens | None:
        """Every rank's part of a step: the block ``moves`` (swap out, swap in, copy), one
        forward pass over ``chunks`` (block table, first position, tokens) and the logits of
        the packed ``logit_rows``, returned on rank 0 (``None`` elsewhere, or without rows);
        with ``greedy`` (every row a plain greedy draw) the rows' argmax instead where the
        model draws it with its LM head (``greedy_tokens``).
        Rank 0 broadcasts the arguments first; a later pipeline stage receives its input
        hidden states from the previous stage and the last stage sends the logits to rank 0."""
        if self.executor is not None and (chunks or any(moves)):
            # greedy too: every rank must take the same path through the LM head (its
            # collectives), not only rank 0
            self.executor.broadcast(("step", moves, chunks, logit_rows, greedy))
        for work, buf in self._sends:  # the last step's hand-offs (buffers live until done)
            _wait_handoff(work, buf, "a pipeline hand-off to the next stage")
        self._sends.clear()
        self._move_blocks(*moves)
        if not chunks:
            return None
        input_ids, positions, meta = pack_chunks(
            chunks, self.block_size, self.device, self.k_scale, self.v_scale
        )
        t = int(input_ids.shape[0])
        if self._threads > 1 and (self._small_step_tokens or self._cpus_small is not None):
            small = t <= self._small_step_tokens
            if small and self._spill_kv_tokens:  # long contexts: reading K/V needs both
                small = not self._reads_much_kv(chunks)
            want = self._small_threads if small else self._threads
            if want != self._threads_now:
                if self._cpus_small is not None:  # this (the engine) thread, not the process
                    try:
                        os.sched_setaffinity(0, self._cpus_small if small else self._cpus_large)
                    except OSError as e:
                        logger.warning("engine thread affinity not changed (%s): spill off", e)
                        self._cpus_small = None
                torch.set_num_threads(want)
                self._threads_now = want
        dev, sh, tp = self.device, self.shard, self.shard.tp_size
        hidden_in = None
        if not sh.first_stage:
            import torch.distributed as dist

            hidden_in = torch.empty(
                (t, self.model_config.hidden_size), dtype=self.dtype, device=dev
            )
            _wait_handoff(
                dist.irecv(hidden_in, src=self.rank - tp),
                hidden_in,
                "waiting for the previous pipeline stage's hidden states",
            )
        hidden = self.model(input_ids, positions, self.kv_cache, meta, hidden_in)
        if not sh.last_stage:
            import torch.distributed as dist

            # non-blocking hand-offs: stage 0 starts the next step while later stages work
            out = hidden.contiguous()
            self._sends.append((dist.isend(out, dst=self.rank + tp), out))
            if self.rank != 0 or not logit_rows:
                return None
            logits = torch.empty(
                (len(logit_rows), self.model_config.vocab_size), dtype=self.dtype, device=dev
            )
            return PendingLogits(logits, dist.irecv(logits, src=(sh.pp_size - 1) * tp))
        if not logit_rows:
            return None
        last = hidden[torch.tensor(logit_rows, device=dev)]
        if greedy and sh.pp_size == 1:  # every rank of the stage gets the same ``greedy``
            ids = self.model.greedy_tokens(last)
            if ids is not None:
                return GreedyTokens(ids)
        logits = self.model.compute_logits(last)
        if sh.pp_size > 1 and sh.tp_rank == 0:
            import torch.distributed as dist

            out = logits.contiguous()
            self._sends.append((dist.isend(out, dst=0), out))
        return logits if self.rank == 0 else None

    def _move_blocks(
        self,
        swap_out: Sequence[tuple[int, int]],
        swap_in: Sequence[tuple[int, int]],
        copy: Sequence[tuple[int, int]],
    ) -> None:
        # Byte views: index_put is not implemented for every dtype (fp8), bytes always are.
        # Copies first: a fork's copy was scheduled a step earlier, and this step may swap its
        # destination out (a sibling preempted at once) or swap another sequence into its
        # source (a leader that finished on its first token freed it).
        assert self.kv_cache is not None
        kv = self.kv_cache.view(torch.uint8)
        host = self.host_cache.view(torch.uint8) if self.host_cache is not None else None
        if copy:
            s, d = zip(*copy)
            kv[list(d)] = kv[list(s)]
        if swap_out:
            assert host is not None
            d, h = zip(*swap_out)
            host[list(h)] = kv[list(d)].to(host.device)
        if swap_in:
            assert host is not None
            h, d = zip(*swap_in)
            kv[list(d)] = host[list(h)].to(kv.device)

    # ---- KV transfer across layouts ---------------------------------------------------
    def _shard_box(self, rank: int) -> tuple[slice, slice]:
        """Where rank ``rank``'s shard sits in a canonical block: (layers, KV heads)."""
        m, shard = self.model_config, self._shard_of(rank)
        layers = shard.layers(m.num_layers)
        first, n = shard.kv_heads(m.num_kv_heads)
        return slice(layers.start, layers.stop), slice(first, first + n)

    @torch.inference_mode()
    def export_blocks(self, block_ids: Sequence[int]) -> None:
        """Rank 0 of several: copy blocks ``block_ids`` from every rank's shard into the same
        ids of :attr:`transfer_pool` (before a prefill worker sends them). No-op on one rank."""
        if self.world_size == 1 or not block_ids:
            return
        import torch.distributed as dist

        from shared.engine.distributed import run_collective

        if self.executor is not None:
            self.executor.broadcast(("export", list(block_ids)))
        assert self.kv_cache is not None
        ids = torch.tensor(list(block_ids), device=self.device)
        mine = self.kv_cache.view(torch.uint8)[ids].contiguous()
        parts = [torch.empty_like(mine) for _ in range(self.world_size)] if self.rank == 0 else None
        run_collective(
            lambda a: dist.gather(mine, parts, dst=0, async_op=a),
            "the KV export's gather",
            self.device.type,
        )
        if parts is None:
            return
        pool = self.transfer_pool.view(torch.uint8)
        host_ids = ids.to(pool.device)
        full = torch.empty((len(block_ids), *pool.shape[1:]), dtype=torch.uint8)
        for r, part in enumerate(parts):  # every byte of a canonical block is some rank's
            layers, heads = self._shard_box(r)
            full[:, layers, :, :, heads] = part.to(full.device)
        pool[host_ids] = full

    @torch.inference_mode()
    def import_blocks(self, block_ids: Sequence[int]) -> None:
        """Rank 0 of several: scatter blocks ``block_ids`` of :attr:`transfer_pool` (just
        received) into every rank's shard. No-op on one rank."""
        if self.world_size == 1 or not block_ids:
            return
        import torch.distributed as dist

        from shared.engine.distributed import run_collective

        if self.executor is not None:
            self.executor.broadcast(("import", list(block_ids)))
        assert self.kv_cache is not None
        kv = self.kv_cache.view(torch.uint8)
        ids = torch.tensor(list(block_ids), device=self.device)
        mine = torch.empty((len(block_ids), *kv.shape[1:]), dtype=torch.uint8, device=self.device)
        pieces = None
        if self.rank == 0:
            pool = self.transfer_pool.view(torch.uint8)
            full = pool[ids.to(pool.device)]
            pieces = []
            for r in range(self.world_size):
                layers, heads = self._shard_box(r)
                pieces.append(full[:, layers, :, :, heads].contiguous().to(self.device))
        run_collective(
            lambda a: dist.scatter(mine, pieces, src=0, async_op=a),
            "the KV import's scatter",
            self.device.type,
        )
        kv[ids] = mine
