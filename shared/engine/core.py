"""``EngineCore``: the step loop the services drive (the offline ``LLM`` API is in ``llm.py``).

``EngineCore`` is single-threaded by contract: call ``add_request`` / ``abort_request`` /
``step`` from one thread (the services run it in a dedicated engine thread and talk to it
through queues). Bad input raises ``InvalidRequestError`` before anything is queued, so one bad
request never disturbs the others; ``validate_prompt`` runs the same checks of a prompt and its
sampling from any thread (the services, before their admission check).

Failures (docs/architecture.md, "Failures"): an error that belongs to one request (its sampling,
its step update) ends that request alone with finish reason ``"error"`` and a
``RequestFailure`` of kind ``REQUEST``; the step goes on for the others, and the invariants are
checked right after (``check_integrity``), so a failure that did break them stops the engine.
Anything ``step()`` raises (the forward pass, the scheduler, a broken invariant) is fatal.
"""

from __future__ import annotations

import logging
import operator
import time
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from shared.config import ConfigError, EngineArgs, GiB, env_int
from shared.engine.connector import (
    KVConnector,
    KVTransferParams,
    KVTransferParamsError,
    RemotePrefillJob,
)
from shared.engine.kv_cache_manager import KVCacheManager
from shared.engine.outputs import (
    EngineCoreOutput,
    FailureKind,
    RequestFailure,
)
from shared.engine.request import Logprob, Request, RequestStatus
from shared.engine.sampling_params import SamplingParams, SamplingParamsError
from shared.engine.scheduler import SampledToken, Scheduler, SeqFailure, SeqUpdate
from shared.engine.scheduler_output import SampleResult, SchedulerOutput
from shared.hashing import hash_seed
from shared.kv_events import KVEvent

if TYPE_CHECKING:
    from shared.engine.structured_output import GrammarCompiler

logger = logging.getLogger(__name__)

#: How far an idle engine commits its KV pool's pages ahead of the blocks handed out so far
#: (PDSERVE_KV_PREFAULT_MIB, 0: never; at least 4 steps' worth of blocks), and how much per
#: turn of the engine loop (a request that arrives waits for at most one such chunk).
KV_PREFAULT_MIB = 256
KV_PREFAULT_CHUNK_BYTES = 256 << 10


class InvalidRequestError(ValueError):
    """A request the engine refuses (empty or oversize prompt, bad token ids, bad params).
    ``param`` names the offending field when one does."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    pass


class DuplicateRequestError(InvalidRequestError):
    """A request with this id is already in flight on this engine."""


class RequestFailedError(RuntimeError):
    """``LLM.generate``: a request failed inside the engine (the others completed)."""


class Runner(Protocol):
    """What the engine needs of its model runner (``ModelRunner``, or a test's fake)."""

    @property
    def block_bytes(self) -> int: ...

    def kv_cache_budget(self) -> int: ...

    def num_blocks_for(self, budget: int) -> int: ...

    def allocate_kv_cache(self, num_blocks: int, num_host_blocks: int) -> None: ...

    def execute(self, out: SchedulerOutput) -> dict[str, SampleResult]: ...

    def take_prompt_logprobs(self) -> dict[str, list[Logprob]]: ...


@dataclass
class EngineStats:
    num_blocks: int
    block_size: int
    free_blocks: int
    running: int
    waiting: int
    kv_cache_usage: float  # fraction of blocks held by live requests
    kv_utilization: float  # tokens held / token slots allocated to live requests
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    pinned_blocks: int  # blocks held by KV transfers (pins)
    prefill_backlog_tokens: int = 0  # prompt tokens not computed yet (waiting, running, swapped)
    spec_num_drafts: int = 0  # speculative decoding (vLLM's spec_decode_* counters)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


class EngineCore:
    """Scheduler + KV-cache manager + model runner, and the worker role's KV connector.

    ``runner`` (tests: a fake runner with ``kv_cache_budget``, ``num_blocks_for``,
    ``block_bytes``, ``allocate_kv_cache`` and ``execute``) replaces the ``ModelRunner`` the
    engine would build; ``connector`` (``shared/engine/connector.py``) is how a prefill or
    decode worker takes part in its requests' KV (default: none, colocated)."""

    def __init__(
        self, args: EngineArgs, runner: Runner | None = None, connector: KVConnector | None = None
    ) -> None:
        self.args = args
        from shared.engine.device import resolve_device  # the tensor side: deferred

        self.device = resolve_device(args.device)
        self.model_config = args.create_model_config()
        self.cache_config = args.create_cache_config()
        self.scheduler_config = args.create_scheduler_config(self.model_config, self.device)
        self.parallel_config = args.create_parallel_config()
        self.parallel_config.check(self.model_config)
        self.spec_config = args.create_speculative_config()
        if (
            self.spec_config is not None
            and self.spec_config.method == "draft_model"
            and self.parallel_config.world_size > 1
        ):
            raise ConfigError(
                "a draft model with TP/PP > 1 is not supported yet; the ngram method is"
            )
        if runner is None:
            from shared.engine.model_runner import ModelRunner

            runner = ModelRunner(
                self.model_config,
                self.cache_config,
                self.scheduler_config,
                self.device,
                args.attention_backend,
                args.seed,
                parallel=self.parallel_config,
            )
        self.runner: Runner = runner
        # TP/PP ranks: the runner's liveness check, and the KV it must gather before a send
        # and scatter after a receive (shared/engine/distributed.py)
        self._check_ranks = getattr(runner, "check_alive", None)
        self._export = getattr(runner, "export_blocks", None)
        self._import = getattr(runner, "import_blocks", None)
        # pipeline parallelism: steps in flight at once (dispatched, not collected yet)
        self._depth = int(getattr(runner, "pipeline_depth", 1))
        # tokens scheduled by the last step() (0: it scheduled nothing); the worker's metrics
        self.last_step_tokens = 0
        self._inflight: deque[tuple[SchedulerOutput, object]] = deque()
        self.max_inflight_steps = 0  # the most steps in flight at once so far
        try:
            self._set_up(connector)
        except BaseException:
            self.shutdown()  # a TP/PP runner's other ranks
            raise

    def _set_up(self, connector: KVConnector | None) -> None:
        """The KV pool, the scheduler and speculation, once the runner exists."""
        cc = self.cache_config
        draft = self.spec_config is not None and self.spec_config.method == "draft_model"
        load_draft = getattr(self.runner, "load_draft_model", None) if draft else None
        # the draft's weights first: a CUDA profile of the KV budget then counts them
        draft_block_bytes = load_draft(self.spec_config) if load_draft is not None else 0
        if cc.num_gpu_blocks_override:
            num_blocks = cc.num_gpu_blocks_override
        elif draft_block_bytes:
            num_blocks = self._split_draft_budget(draft_block_bytes)
        else:
            num_blocks = self.runner.num_blocks_for(self.runner.kv_cache_budget())
        if num_blocks * cc.block_size < self.model_config.max_model_len:
            raise ConfigError(
                f"the KV cache holds {num_blocks * cc.block_size} tokens ({num_blocks} blocks), "
                f"fewer than --max-model-len {self.model_config.max_model_len}: raise "
                f"--kv-cache-memory / --gpu-memory-utilization or lower --max-model-len"
            )
        num_host = (
            cc.swap_space // self.runner.block_bytes
            if self.scheduler_config.preemption_mode == "swap"
            else 0
        )
        self.runner.allocate_kv_cache(num_blocks, num_host)
        self.kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching, num_host)
        self.connector = connector or KVConnector()
        spec = None
        if self.spec_config is not None:
            from shared.engine.spec_decode import SpecDecoder

            spec = SpecDecoder(self.spec_config, self.model_config.max_model_len)
            if spec.uses_draft_model:
                attach = getattr(self.runner, "attach_draft_model", None)
                if attach is None:
                    raise ConfigError("this model runner cannot run a draft model")
                attach(self.spec_config, num_blocks)
            logger.info("speculative decoding: %s", self.spec_config.to_json())
        self.scheduler = Scheduler(self.scheduler_config, self.kv, self.connector, spec)
        self._grammars: GrammarCompiler | None = None
        self.hash_seeds: dict[str | None, int] = {}
        self.parents: dict[str, list[Request]] = {}
        self.capacity_line = self._capacity_line(num_blocks, num_host)
        logger.info(self.capacity_line)
        self._set_up_prefault()

    def _split_draft_budget(self, draft_block_bytes: int) -> int:
        """The target pool's blocks when a draft model's twin pool (one block per target
        block, ``draft_block_bytes`` each) must fit in the same KV budget."""
        budget = self.runner.kv_cache_budget()
        target_block_bytes = self.runner.block_bytes
        num_blocks = max(0, budget // (target_block_bytes + draft_block_bytes))
        logger.info(
            "KV budget %.2f GiB split with the draft model: %d blocks, target pool %.2f GiB + "
            "draft twin pool %.2f GiB",
            budget / GiB,
            num_blocks,
            num_blocks * target_block_bytes / GiB,
            num_blocks * draft_block_bytes / GiB,
        )
        return num_blocks

    def _set_up_prefault(self) -> None:
        """The pool's memory is committed only as pages are first written
        (``zeroed_host_tensor``). A step that writes KV into fresh pages pays a minor fault
        for each (~3 µs on the benchmark VM; the served suite ran up to 20 % slower). So an
        idle engine commits the pages its pool hands out next (:meth:`prefault_kv`); the rest
        stays uncommitted until used."""
        self._prefault = None
        self._prefaulted = 0  # blocks [0, _prefaulted) committed (or handed out)
        self._refilling = False  # between a refill's first chunk and its last
        mib = env_int("PDSERVE_KV_PREFAULT_MIB", KV_PREFAULT_MIB)
        prefault = getattr(self.runner, "prefault_blocks", None)
        if mib == 0 or prefault is None or not getattr(self.runner, "can_prefault", False):
            return
        block_bytes = self.runner.block_bytes
        steps = 4 * -(-self.scheduler_config.max_num_batched_tokens // self.block_size)
        self._prefault = prefault
        self._prefault_window = max(-(-(mib << 20) // block_bytes), steps)
        self._prefault_chunk = max(1, KV_PREFAULT_CHUNK_BYTES // block_bytes)

    def prefault_kv(self) -> bool:
        """Commit the memory of the next few blocks the pool will hand out (one chunk, up to
        the window past its high-water mark), their contents unchanged. A refill starts once
        less than half the window is left ahead of the mark and goes on, a chunk per call, to
        its end (so the rare turns that fault a 2 MiB huge page in come together, not one
        per few requests). False when there is nothing to do. The engine loop calls it while
        idle, one chunk per turn. A failure to commit (the host is out of memory) is logged
        and turns it off: blocks then fault in as they are written, as before."""
        if self._prefault is None:
            return False
        pool = self.kv.pool
        start = max(self._prefaulted, pool.high_water)  # never a block in use
        stop = min(
            pool.num_blocks, pool.high_water + self._prefault_window, start + self._prefault_chunk
        )
        if start >= stop:
            self._refilling = False
            return False
        if not self._refilling and self._prefaulted - pool.high_water >= self._prefault_window // 2:
            return False  # half the window still ahead: refill later, in one go
        self._refilling = True
        try:
            self._prefault(start, stop)
        except OSError as e:
            logger.warning("KV pool pages not committed ahead of use: %s", e)
            self._prefault = None
            return False
        self._prefaulted = stop
        return True

    # ---- capacity ----------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.kv.pool.num_blocks

    @property
    def block_size(self) -> int:
        return self.cache_config.block_size

    def _capacity_line(self, num_blocks: int, num_host: int) -> str:
        bs = self.block_size
        tokens = num_blocks * bs
        gib = num_blocks * self.runner.block_bytes / GiB
        max_len = self.model_config.max_model_len
        pc = self.parallel_config
        where = (
            f"{gib:.2f} GiB"
            if pc.world_size == 1
            else f"{gib:.2f} GiB on each of {pc.world_size} ranks, TP {pc.tensor_parallel_size} "
            f"x PP {pc.pipeline_parallel_size}"
        )
        line = (
            f"KV cache: {num_blocks:,} blocks x {bs} tokens = {tokens:,} tokens "
            f"({where}, {self.cache_config.kv_cache_dtype if self.cache_config.kv_cache_dtype != 'auto' else self.model_config.dtype}); "
            f"maximum concurrency for {max_len:,} tokens per request: {tokens / max_len:.1f}x"
        )
        if num_host:
            line += f"; swap: {num_host:,} host blocks"
        return line

    # ---- requests ----------------------------------------------------------------------
    def compile_grammar(self, params: SamplingParams) -> object:
        """The compiled grammar of ``params.structured_outputs`` (cached by spec; callers off
        the engine thread call this first so the engine thread only looks it up).
        ``InvalidRequestError`` when it does not compile."""
        if self._grammars is None:
            from shared.engine.structured_output import GrammarCompiler

            mc = self.model_config
            self._grammars = GrammarCompiler(
                self.args.tokenizer or mc.path, mc.vocab_size, mc.eos_token_ids
            )
        assert params.structured_outputs is not None
        try:
            return self._grammars.compile(params.structured_outputs)
        except SamplingParamsError as e:
            raise InvalidRequestError(str(e), "structured_outputs") from e

    def validate_prompt(
        self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams | None = None
    ) -> None:
        """Run :meth:`add_request`'s checks of a prompt, and of ``sampling_params`` when given
        (its own rules and ``--max-logprobs``, and its token ids and top-N against the
        vocabulary), raising what ``add_request`` would raise for them (``PromptTooLongError``,
        ``InvalidRequestError``, same messages); queues nothing. A service calls it before its
        admission check, so an invalid request is refused as such however busy the worker is.

        Reads only the engine's frozen configuration: safe on any thread while the engine
        thread steps. Not checked here: the request id (in flight or not is engine state), a
        grammar (``compile_grammar``: slow, and callers compile it off the engine thread
        anyway), ``resume`` and the KV transfer parameters; ``max_tokens`` past the context is
        not an error (``add_request`` lowers it to what fits)."""
        self._checked(prompt_token_ids, sampling_params, sampling_params is not None)

    def _checked(
        self, prompt_token_ids: Sequence[int], params: object, with_params: bool = True
    ) -> tuple[list[int], SamplingParams]:
        """The checks of :meth:`validate_prompt` (and :meth:`add_request`): the prompt's, then
        (``with_params``) those of ``params``, which must be ``SamplingParams``. Returns the
        prompt as a list and a validated copy of ``params`` (``params`` itself when not
        ``with_params``)."""
        mc = self.model_config
        if not isinstance(prompt_token_ids, Sequence) or isinstance(prompt_token_ids, (str, bytes)):
            raise InvalidRequestError("the prompt must be a list of token ids", "prompt")
        if len(prompt_token_ids) >= mc.max_model_len:  # before copying a huge list
            raise PromptTooLongError(
                f"prompt has {len(prompt_token_ids)} tokens; the model's maximum context length "
                f"is {mc.max_model_len} (prompt + at least one output token must fit)",
                "prompt",
            )
        prompt = list(prompt_token_ids)
        if not prompt:
            raise InvalidRequestError("the prompt is empty", "prompt")
        self._check_token_ids(prompt, "prompt")
        if not with_params:
            return prompt, params  # type: ignore[return-value]
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be SamplingParams", "sampling_params")
        try:
            params = params.clone()
            params.validate(self.args.max_logprobs)
        except (SamplingParamsError, TypeError) as e:
            raise InvalidRequestError(str(e), getattr(e, "param", None)) from e
        self._check_token_ids(params.stop_token_ids, "stop_token_ids")
        if params.logit_bias:
            self._check_token_ids(list(params.logit_bias), "logit_bias")
        if params.allowed_token_ids is not None:
            self._check_token_ids(params.allowed_token_ids, "allowed_token_ids")
        for name in ("logprobs", "prompt_logprobs"):  # the runner's top-N needs N <= vocab
            top = getattr(params, name)
            if top is not None and top > mc.vocab_size:
                raise InvalidRequestError(
                    f"{name} {top} exceeds the vocabulary ({mc.vocab_size})", name
                )
        return prompt, params

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        kv_transfer: KVTransferParams | None = None,
        resume: Sequence[Sequence[int]] | None = None,
        resume_finished: Collection[int] = (),
        arrival_time: float | None = None,
        grammar: object | None = None,
    ) -> None:
        """Validate and queue a request (``params.n`` sequences).

        ``kv_transfer``: the request's part in a KV transfer, for the engine's connector
        (``RemotePrefillParams``: the prompt's KV comes from a prefill worker;
        ``RemoteDecodeParams``: blocks go to a decode worker as they complete, each reported
        one pinned, ``EngineCoreOutput.kv_pin_id``, until the caller calls :meth:`unpin`).
        ``resume``: failover; per sample, output tokens already produced elsewhere (continue
        after them); the samples in ``resume_finished`` already ended there and are not
        continued (no output comes for them). Raises ``InvalidRequestError`` (nothing queued)
        on bad input. ``grammar``: ``params.structured_outputs`` compiled by
        :meth:`compile_grammar` off the engine thread (else it is compiled here, on the engine
        thread: an LRU eviction between the two would otherwise stall every step for a
        compile).
        """
        mc = self.model_config
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", "request_id")
        if request_id in self.parents:
            raise DuplicateRequestError(
                f"request id {request_id!r} is already in flight", "request_id"
            )
        prompt, params = self._checked(prompt_token_ids, params)
        if params.structured_outputs is None:
            grammar = None
        elif grammar is None:
            grammar = self.compile_grammar(params)
        room = mc.max_model_len - len(prompt)
        if params.max_tokens is None or params.max_tokens > room:
            params.max_tokens = room
        params.min_tokens = min(params.min_tokens, params.max_tokens)
        if resume is not None:
            if len(resume) not in (0, params.n):
                raise InvalidRequestError(
                    f"resume has {len(resume)} entries for n={params.n}", "resume"
                )
            finished = set(resume_finished)
            if not finished <= set(range(params.n)) or len(finished) == params.n:
                raise InvalidRequestError(
                    f"resume_finished {sorted(finished)} must name some, not all, of the "
                    f"{params.n} samples",
                    "resume",
                )
            for i, r in enumerate(resume):
                if i in finished:
                    # bounded first: it is read token by token on the engine thread
                    if len(r) > params.max_tokens:
                        raise InvalidRequestError(
                            f"resume holds {len(r)} tokens for finished sample {i}, more than "
                            f"max_tokens {params.max_tokens}",
                            "resume",
                        )
                    self._check_token_ids(r, "resume")
                    continue
                if len(r) >= params.max_tokens:
                    raise InvalidRequestError(
                        f"resume holds {len(r)} tokens; max_tokens {params.max_tokens} leaves "
                        "nothing to generate",
                        "resume",
                    )
                self._check_token_ids(r, "resume")
        try:
            self.connector.check(kv_transfer, len(prompt), self.block_size)
        except KVTransferParamsError as e:
            raise InvalidRequestError(str(e), e.param) from e
        seed = self.hash_seeds.get(cache_salt)
        if seed is None:
            if len(self.hash_seeds) >= 4096:  # salts are client strings: keep the map bounded
                self.hash_seeds.clear()
            seed = self.hash_seeds[cache_salt] = hash_seed(mc.served_model_name, cache_salt)
        now = arrival_time if arrival_time is not None else time.monotonic()
        prompt_ids = tuple(prompt)
        seqs: list[Request] = []
        for i in range(params.n):
            done = list(resume[i]) if resume else []
            seq_params = params.for_sample(i) if params.n > 1 else params
            seqs.append(
                Request(
                    request_id=request_id if params.n == 1 else f"{i}_{request_id}",
                    parent_id=request_id,
                    index=i,
                    prompt_token_ids=prompt_ids,
                    sampling_params=seq_params,
                    eos_token_ids=mc.eos_token_ids,
                    block_size=self.block_size,
                    hash_seed=seed,
                    arrival_time=now,
                    output_token_ids=done,
                    num_resumed_tokens=len(done),
                    grammar=grammar,
                )
            )
        leader = seqs[0]
        self.connector.add(leader, kv_transfer)
        self.parents[request_id] = seqs
        if resume:  # each sample has its own tokens: independent sequences, no fork
            for s in seqs:
                if s.index in resume_finished:  # ended on the previous worker
                    s.status = RequestStatus.FINISHED_ABORTED
                    s.finished_time = now
                else:
                    self.scheduler.add(s)
        else:
            leader.siblings = seqs[1:]
            self.scheduler.add(leader)

    def _check_token_ids(self, ids: Sequence[int], param: str) -> None:
        vocab = self.model_config.vocab_size
        try:  # the common case, all plain ints in [0, vocab), at C speed (about 2x the loop's)
            if len(ids) == 0 or (
                operator.countOf(map(type, ids), int) == len(ids)
                and min(ids) >= 0
                and max(ids) < vocab
            ):
                return
        except TypeError:  # (not comparable: the loop below names the culprit)
            pass
        for t in ids:  # the first bad one, by name
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"{param}: token ids must be in [0, {vocab}), got {t!r}", param
                )

    def abort_request(self, request_ids: Sequence[str]) -> list[EngineCoreOutput]:
        """Abort parents by id (unknown ids are ignored); returns their final outputs."""
        seq_ids = []
        for rid in request_ids:
            for s in self.parents.get(rid, ()):
                seq_ids.append(s.request_id)
        aborted = self.scheduler.abort(seq_ids)
        outs = [self._output(SeqUpdate(s, [], [], True)) for s in aborted]
        self._forget_finished(rid for rid in request_ids)
        return outs

    def abort_samples(self, request_id: str, indices: Collection[int]) -> list[EngineCoreOutput]:
        """Abort some samples of parent ``request_id`` (the router ended them with a stop
        string); the others go on. Returns the aborted samples' final outputs."""
        wanted = set(indices)  # once: not per sample (a long list held the engine thread)
        seqs = [s for s in self.parents.get(request_id, ()) if s.index in wanted]
        aborted = self.scheduler.abort([s.request_id for s in seqs])
        outs = [self._output(SeqUpdate(s, [], [], True)) for s in aborted]
        self._forget_finished([request_id])
        return outs

    def fail_request(self, request_id: str, reason: str) -> list[EngineCoreOutput]:
        """End parent ``request_id`` (every sample) with finish reason ``"error"``; the outputs
        carry a ``RequestFailure`` of kind ``REQUEST``. Unknown ids are ignored."""
        seqs = self.parents.get(request_id, ())
        for s in seqs:
            s.error = reason
        failed = self.scheduler.abort([s.request_id for s in seqs], RequestStatus.FINISHED_ERROR)
        outs = [self._output(SeqUpdate(s, [], [], True)) for s in failed]
        self._forget_finished([request_id])
        return outs

    def unpin(self, pin_id: int | None) -> bool:
        """Drop a transfer's pin (``RemotePrefill.pin_id`` / ``EngineCoreOutput.kv_pin_id``)
        once the transfer is terminal. Unknown pins and ``None`` are ignored (False)."""
        return pin_id is not None and self.kv.unpin(pin_id)

    def finish_remote_prefill(
        self,
        request_id: str,
        first_tokens: list[SampledToken] | None,
        received_block_ids: Sequence[int] = (),
        fresh_blocks: bool = False,
    ) -> list[EngineCoreOutput]:
        """The remote prefill of ``request_id`` ended: its KV arrived in ``received_block_ids``
        (of the runner's transfer pool) with ``first_tokens``, or failed (``None``; with
        ``fresh_blocks`` the local prefill uses new blocks: ``Scheduler.finish_remote_prefill``)."""
        seqs = self.parents.get(request_id)
        if not seqs:
            return []
        if first_tokens is not None and self._import is not None:
            self._import(list(received_block_ids))
        if first_tokens is None and fresh_blocks and not self.scheduler.fits_beside_pins(seqs[0]):
            # new blocks for the whole prompt are not there while the old ones stay pinned:
            # queued, it would stall the queue (or preempt itself) until the receive ends
            return self.fail_request(
                request_id,
                "remote prefill failed, its KV transfer did not stop, and the prompt does not "
                "fit in the KV blocks left beside the ones that transfer still holds",
            )
        updates = self.scheduler.finish_remote_prefill(
            seqs[0].request_id, first_tokens, fresh_blocks
        )
        return self._outputs(updates)

    # ---- stepping ----------------------------------------------------------------------
    def check_alive(self) -> None:
        """Raise when part of the engine is gone (a TP/PP rank's process): the engine loop
        calls this every turn, busy or idle, so a lost rank ends the worker in bounded time."""
        if self._check_ranks is not None:
            self._check_ranks()

    def shutdown(self) -> None:
        """Stop the runner's other ranks (no-op with one)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._inflight)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run one forward pass, sample; returns this step's per-sequence deltas.

        With pipeline parallelism up to ``pipeline_depth`` steps are in flight: a step is
        dispatched (stage 0 runs it and hands it on), the next one is scheduled from the
        sequences not in flight and dispatched, and the oldest is collected (its draws) once
        the pipeline is full or nothing else can be scheduled."""
        self.last_step_tokens = 0
        if self._depth > 1:
            return self._step_pipelined()
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        self.last_step_tokens = out.num_batched_tokens
        return self._finish_step(out, self.runner.execute(out))

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        if len(self._inflight) < self._depth:
            busy = {s.seq_id for out, _ in self._inflight for s in out.scheduled}
            # an equal share of the running sequences per step in flight: the micro-batches
            share = max(1, -(-len(self.scheduler.running) // self._depth))
            out = self.scheduler.schedule(skip=busy, max_running=share)
            if not out.is_empty:
                self.last_step_tokens = out.num_batched_tokens
                self._inflight.append((out, self.runner.dispatch(out)))  # type: ignore[attr-defined]
                self.max_inflight_steps = max(self.max_inflight_steps, len(self._inflight))
                if len(self._inflight) < self._depth:
                    return []
        if not self._inflight:
            return []
        out, dispatched = self._inflight.popleft()
        return self._finish_step(out, self.runner.collect(dispatched))  # type: ignore[attr-defined]

    def _finish_step(
        self, out: SchedulerOutput, sampled: dict[str, SampleResult]
    ) -> list[EngineCoreOutput]:
        updates, failures = self.scheduler.update_from_output(
            out, sampled, self.runner.take_prompt_logprobs()
        )
        if self._export is not None:
            ready = [b for u in updates for _, b in u.kv_blocks_ready]
            if ready:
                self._export(ready)
        outs = self._outputs(updates)
        if failures:
            outs += self._fail(failures)
        return outs

    def _fail(self, failures: list[SeqFailure]) -> list[EngineCoreOutput]:
        """Fail each failed sequence's parent alone, then make sure nothing else was hurt:
        a per-request failure that broke an invariant is an engine failure (raises)."""
        outs: list[EngineCoreOutput] = []
        for f in failures:
            logger.error("request %s failed: %s", f.request.parent_id, f.reason)
            outs += self.fail_request(f.request.parent_id, f.reason)
        self.check_integrity()
        return outs

    def _outputs(self, updates: list[SeqUpdate]) -> list[EngineCoreOutput]:
        outs = [self._output(u) for u in updates]
        self._forget_finished(u.request.parent_id for u in updates if u.finished)
        return outs

    def _output(self, u: SeqUpdate) -> EngineCoreOutput:
        r = u.request
        failure = None
        if u.finished and r.status == RequestStatus.FINISHED_ERROR:
            failure = RequestFailure(FailureKind.REQUEST, r.error or "the request failed")
        prompt_lps = None
        if (
            u.new_token_ids
            and r.sampling_params.prompt_logprobs is not None
            and not r.prompt_logprobs_sent
        ):
            prompt_lps, r.prompt_logprobs = r.prompt_logprobs, []
            r.prompt_logprobs_sent = True
        return EngineCoreOutput(
            request_id=r.parent_id,
            index=r.index,
            new_token_ids=u.new_token_ids,
            new_logprobs=u.new_logprobs,
            finish_reason=r.finish_reason() if u.finished else None,
            stop_token_id=r.stop_token_id,
            num_prompt_tokens=r.num_prompt_tokens,
            num_cached_tokens=max(r.num_cached_tokens, 0),
            kv_blocks_ready=u.kv_blocks_ready,
            kv_pin_id=u.kv_pin_id,
            failure=failure,
            arrival_time=r.arrival_time,
            first_scheduled_time=r.first_scheduled_time,
            first_token_time=r.first_token_time,
            finished_time=r.finished_time,
            prompt_logprobs=prompt_lps,
        )

    def _forget_finished(self, parent_ids: Iterable[str]) -> None:
        for pid in set(parent_ids):
            seqs = self.parents.get(pid)
            if seqs and all(s.is_finished for s in seqs):
                del self.parents[pid]

    def take_remote_prefills(self) -> list[RemotePrefillJob]:
        """Remote prefills reserved since the last call (decode role; ``request_id`` is the
        parent's). The caller owns each job's ``pin_id`` and must :meth:`unpin` it once its
        receive is terminal (or at once if it never posts one); requests aborted before this
        call were unpinned by the connector, since no transfer began."""
        return self.connector.take_jobs()

    # ---- introspection -----------------------------------------------------------------
    def block_ids_of(self, request_id: str) -> list[int]:
        seqs = self.parents.get(request_id)
        return self.kv.block_ids(seqs[0].request_id) if seqs else []

    def take_kv_events(self) -> list[KVEvent]:
        return self.kv.pool.take_events()

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` if a pool/table invariant is broken (tests call it per step)."""
        self.kv.check_integrity(self.scheduler.live_request_ids())

    def stats(self) -> EngineStats:
        sch = self.scheduler
        held_tokens = slots = backlog = 0
        running = tuple(sch.running)  # one atomic copy: other threads (metrics, lease) call this
        for r in running:
            held_tokens += r.num_computed_tokens
            slots += self.kv.num_blocks_of(r.request_id) * self.block_size
        for r in running + tuple(sch.waiting) + tuple(sch.swapped):
            backlog += max(0, r.num_prompt_tokens - r.num_computed_tokens)
        st = sch.spec.stats if sch.spec is not None else None
        return EngineStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            free_blocks=self.kv.pool.num_free_blocks,
            running=sch.num_running,
            waiting=sch.num_waiting,
            kv_cache_usage=self.kv.pool.usage(),
            kv_utilization=held_tokens / slots if slots else 0.0,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=sch.num_preemptions,
            pinned_blocks=self.kv.num_pinned_blocks,
            prefill_backlog_tokens=backlog,
            spec_num_drafts=st.num_drafts if st else 0,
            spec_num_draft_tokens=st.num_draft_tokens if st else 0,
            spec_num_accepted_tokens=st.num_accepted_tokens if st else 0,
            spec_accepted_per_pos=tuple(st.accepted_per_pos) if st else (),
        )


__all__ = [
    "EngineCore",
    "EngineStats",
    "InvalidRequestError",
    "PromptTooLongError",
    "DuplicateRequestError",
    "RequestFailedError",
]
