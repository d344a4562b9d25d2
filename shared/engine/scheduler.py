"""The scheduler: sole owner of the queues and the per-step token budget (vLLM V1 semantics).

There is no prefill or decode phase. Each step, every running request asks for
``num_tokens - num_computed_tokens`` tokens (1 for a decode, up to the rest of the prompt for a
prefill, capped by the budget: chunked prefill); then waiting requests are admitted while the
budget, ``max_num_seqs`` and the pool allow. When a running request cannot get a block, the
most recently admitted running request is preempted (swapped to the host pool when
``preemption_mode == "swap"`` and it fits, else dropped for recompute).

``schedule()`` returns plain data; ``update_from_output()`` applies the sampled tokens. No
torch import.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Collection, Iterable
from typing import cast

from shared.config import SchedulerConfig
from shared.engine.connector import KVConnector
from shared.engine.kv_cache_manager import KVCacheManager, cdiv
from shared.engine.request import Logprob, Request, RequestStatus
from shared.engine.scheduler_output import (
    SampledToken,
    SampleError,
    SampleResult,
    SampleSpec,
    ScheduledSeq,
    SchedulerOutput,
    SeqFailure,
    SeqUpdate,
    SpecSample,
)
from shared.engine.spec_decode import SpecDecoder

logger = logging.getLogger(__name__)

__all__ = [
    "Scheduler",
    "SchedulerOutput",
    "ScheduledSeq",
    "SampleSpec",
    "SampledToken",
    "SampleError",
    "SampleResult",
    "SeqFailure",
    "SeqUpdate",
]


class Scheduler:
    """Owns the queues, the token budget and request states; the only writer of
    ``Request.num_computed_tokens``. Roles take part only through ``connector``."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        connector: KVConnector | None = None,
        spec: SpecDecoder | None = None,
    ) -> None:
        self.config = config
        self.spec = spec
        self.kv = kv
        self.connector = connector or KVConnector()
        self.connector.bind(kv)
        self.block_size = kv.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.remote_waiting: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}  # every live sequence by request_id
        self.pending_copies: list[tuple[int, int]] = []
        self.num_preemptions = 0
        self.num_swapped_out = 0
        self.finished_since: list[str] = []  # handed to the runner with the next step

    # ---- intake ------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a sequence (its pending ``n > 1`` siblings are tracked, not queued)."""
        self.requests[request.request_id] = request
        for sib in request.siblings:
            self.requests[sib.request_id] = sib
        self.waiting.append(request)

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.remote_waiting)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.swapped)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.pending_copies)

    # ---- scheduling --------------------------------------------------------------------
    def schedule(
        self, skip: Collection[str] = (), max_running: int | None = None
    ) -> SchedulerOutput:
        """The next step's work. ``skip``: running sequences whose previous step is still in
        flight (pipeline parallelism: their tokens are not known yet), left out;
        ``max_running``: schedule at most this many running sequences (a pipeline's
        micro-batch, so the sequences split over the steps in flight)."""
        out = SchedulerOutput(blocks_to_copy=self.pending_copies)
        self.pending_copies = []
        out.finished_seq_ids, self.finished_since = self.finished_since, []
        budget = self.config.max_num_batched_tokens
        room = self._prefill_room()
        scheduled: dict[str, ScheduledSeq] = {}
        preempted = False

        i = 0
        req: Request | None  # None once the request preempted itself
        speculate = self.spec is not None and self.spec.active(len(self.running))
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.request_id in skip:
                i += 1
                continue
            if max_running is not None and len(scheduled) >= max_running:
                break
            num_new = self._num_new_tokens(req, budget)
            chunk = False
            if room is not None and num_new > 1:  # a prompt chunk while others decode
                chunk = True
                num_new = min(num_new, room)
            if num_new <= 0:
                i += 1
                continue
            drafts: list[int] = []
            lookahead = 0
            if speculate and num_new == 1 and budget > 1:
                drafts, lookahead = self._drafts(req, budget - 1)
            # drafts only where their slots fit without preempting anyone
            if (drafts or lookahead) and self.kv.allocate_slots(
                req, 1 + len(drafts) + lookahead
            ) is None:
                drafts, lookahead = [], 0
            elif drafts or lookahead:
                num_new = 1 + len(drafts) + lookahead
                scheduled[req.request_id] = self._scheduled(req, 1, drafts, lookahead)
                budget -= num_new
                i += 1
                continue
            while True:
                if self.kv.allocate_slots(req, num_new) is not None:
                    break
                victim = self.running.pop(self._victim_index(i, skip))
                self._preempt(victim, out)
                preempted = True
                scheduled.pop(victim.request_id, None)
                if victim is req:
                    req = None
                    break
            if req is None:
                break
            scheduled[req.request_id] = self._scheduled(req, num_new)
            budget -= num_new
            if chunk and room is not None:
                room -= num_new
            i += 1
        # Recount: preemption may have removed already-scheduled requests from the budget.
        budget = self.config.max_num_batched_tokens - sum(
            s.num_new_tokens for s in scheduled.values()
        )

        if not preempted:
            budget = self._schedule_swapped(out, scheduled, budget)
            if not self.swapped:
                self._schedule_waiting(out, scheduled, budget, room)

        out.scheduled = list(scheduled.values())
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        if out.is_empty:  # nothing runs: the finished ids go with the next step that does
            self.finished_since[:0] = out.finished_seq_ids
            out.finished_seq_ids = []
        now = time.monotonic()
        for s in out.scheduled:
            req = self.requests[s.seq_id]
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        return out

    def _victim_index(self, first: int, skip: Collection[str] = ()) -> int:
        """Index of the request to preempt among ``running[first:]``: the most recently
        admitted one that holds no transfer pin (preempting a request whose blocks a transfer
        pins frees little, since the pin keeps them, and delays the transfer that would release
        them); the most recently admitted one when every candidate holds a pin. Never one in
        ``skip``, whose step is still in flight (pipeline parallelism): its blocks are being
        written, and its step's tokens would be applied again after a re-admission;
        ``running[first]`` itself is never in ``skip``."""
        candidates = [
            j
            for j in range(len(self.running) - 1, first - 1, -1)
            if self.running[j].request_id not in skip
        ]
        for j in candidates:
            if not self.connector.holds_pin(self.running[j]):
                return j
        return candidates[0]

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        num_new = req.num_tokens - req.num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        if threshold and num_new > threshold:
            num_new = threshold
        return min(num_new, budget)

    def _drafts(self, req: Request, room: int) -> tuple[list[int], int]:
        """(n-gram drafts, draft-model lookahead) for a decoding request, within ``room``
        budget tokens. None for a request's first token or pending ``n > 1`` siblings."""
        assert self.spec is not None
        if req.siblings or req.num_output_tokens == req.num_resumed_tokens:
            return [], 0  # no drafts at the first token or for pending siblings
        if not self.spec.allow(req.request_id):
            return [], 0
        k = min(
            room,
            self.spec.max_drafts(
                req.num_tokens, req.num_output_tokens, req.sampling_params.max_tokens
            ),
        )
        if k <= 0:
            return [], 0
        if self.spec.uses_draft_model:
            return [], k
        return self.spec.propose(req.request_id, req.all_token_ids, k), 0

    def _scheduled(
        self, req: Request, num_new: int, drafts: list[int] | None = None, lookahead: int = 0
    ) -> ScheduledSeq:
        """The plain-data work item of ``req`` for this step (its tokens, block table and, when
        the chunk reaches the last known token, what to sample)."""
        c = req.num_computed_tokens
        samples: tuple[SampleSpec, ...] = ()
        if c + num_new >= req.num_tokens:
            first = req.num_output_tokens == req.num_resumed_tokens
            seqs = [req, *req.siblings] if first and req.siblings else [req]
            samples = tuple(_sample_spec(s) for s in seqs)
        tokens = req.all_token_ids[c : c + num_new]
        if drafts:
            tokens = [*tokens, *drafts]
        targets: tuple[int, ...] = ()
        if req.wants_prompt_logprobs and c < req.num_prompt_tokens - 1:
            # position p's logits give the logprob of prompt token p + 1
            end = min(c + num_new, req.num_prompt_tokens - 1)
            targets = tuple(req.prompt_token_ids[c + 1 : end + 1])
        return ScheduledSeq(
            req.request_id,
            c,
            tokens,
            self.kv.block_ids(req.request_id),
            samples,
            tuple(drafts or ()),
            lookahead,
            req.all_token_ids if lookahead else (),
            targets,
            req.sampling_params.prompt_logprobs or 0,
        )

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        out.num_preempted += 1
        req.num_preemptions += 1
        pairs = None
        if self.config.preemption_mode == "swap":
            pairs = self.kv.swap_out(req)
        if pairs is not None:
            self.num_swapped_out += 1
            out.blocks_to_swap_out.extend(pairs)
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
            logger.debug("request %s swapped out (%d blocks)", req.request_id, len(pairs))
        else:
            self.kv.free(req)
            req.num_computed_tokens = 0
            if req.wants_prompt_logprobs:
                req.prompt_logprobs.clear()  # the recompute gives them again
            req.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(req)
            logger.debug("request %s preempted for recompute", req.request_id)

    def _schedule_swapped(
        self, out: SchedulerOutput, scheduled: dict[str, ScheduledSeq], budget: int
    ) -> int:
        while self.swapped and budget > 0 and self.num_running < self.config.max_num_seqs:
            req = self.swapped[0]
            num_new = self._num_new_tokens(req, budget)
            extra = cdiv(req.num_computed_tokens + num_new, self.block_size) - len(
                self.kv.swapped[req.request_id]
            )
            if not self.kv.can_swap_in(req, max(0, extra)):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.kv.swap_in(req))
            if self.kv.allocate_slots(req, num_new) is None:  # cannot happen after the check
                raise RuntimeError("swap-in accounting error")
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = self._scheduled(req, num_new)
            budget -= num_new
        return budget

    def _prefill_room(self) -> int | None:
        """Prompt tokens this step may compute: ``max_prefill_tokens_while_decoding`` while a
        running sequence is decoding (one token to compute), else no bound beyond the budget
        (None). A prompt chunk in a step stalls every sequence decoding in it; a decode worker
        of a disaggregated cluster prefills locally only as overflow, so it bounds that stall
        (the rest of the prompt follows in later steps)."""
        cap = self.config.max_prefill_tokens_while_decoding
        if not cap or not self.config.enable_chunked_prefill:
            return None
        for r in self.running:
            if r.num_tokens - r.num_computed_tokens == 1:
                return cap
        return None

    def _schedule_waiting(
        self,
        out: SchedulerOutput,
        scheduled: dict[str, ScheduledSeq],
        budget: int,
        room: int | None = None,
    ) -> None:
        cfg = self.config
        while self.waiting and budget > 0 and self.num_running < cfg.max_num_seqs:
            req = self.waiting[0]
            computed, num_computed = self.kv.get_computed_blocks(req)
            external = self.connector.num_external_tokens(req, num_computed)
            if external:
                # Reserve (uncached) blocks for them; another worker computes their KV.
                if self.kv.allocate_slots(req, external, computed, cache=False) is None:
                    break
                self.waiting.popleft()
                self._admitted(req, num_computed)
                self.connector.on_reserved(
                    req, self.kv.block_ids(req.request_id), num_computed // self.block_size
                )
                req.status = RequestStatus.WAITING_FOR_REMOTE_KV
                self.remote_waiting[req.request_id] = req
                continue
            num_new = req.num_tokens - num_computed
            if not cfg.enable_chunked_prefill and num_new > budget:
                break
            num_new = self._num_new_tokens_from(req, num_computed, budget)
            chunk = False
            if room is not None and num_new > 1:
                if room <= 0:
                    break
                chunk = True
                num_new = min(num_new, room)
            if self.kv.allocate_slots(req, num_new, computed) is None:
                break
            self.waiting.popleft()
            self._admitted(req, num_computed)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = self._scheduled(req, num_new)
            budget -= num_new
            if chunk and room is not None:
                room -= num_new

    def _admitted(self, req: Request, num_computed: int) -> None:
        """``req`` got its blocks with ``num_computed`` tokens from the prefix cache. Only now
        do the hit and usage's cached tokens count: until its allocation succeeds a waiting
        request looks again every step, and what it found may be evicted meanwhile. A
        re-admission after a preemption counts neither (``record_lookup``)."""
        req.num_computed_tokens = num_computed
        if req.num_cached_tokens < 0:  # the first admission's (vLLM's), not a recompute's
            req.num_cached_tokens = num_computed
            # (nor a fresh-block fallback's: Scheduler.finish_remote_prefill)
            self.kv.record_lookup(req, num_computed)

    def _num_new_tokens_from(self, req: Request, num_computed: int, budget: int) -> int:
        num_new = req.num_tokens - num_computed
        threshold = self.config.long_prefill_token_threshold
        if threshold and num_new > threshold:
            num_new = threshold
        return min(num_new, budget)

    # ---- results -----------------------------------------------------------------------
    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: dict[str, SampleResult],
        prompt_logprobs: dict[str, list[Logprob]] | None = None,
    ) -> tuple[list[SeqUpdate], list[SeqFailure]]:
        """Advance every scheduled request by its computed tokens and append sampled ones.

        ``sampled`` maps request ids (including pending siblings of an ``n > 1`` request at
        its first token) to their new token or a :class:`SampleError`. Finished requests
        release their blocks. A request whose sample failed, or whose update raised, is
        returned in the failures (untouched by the rest of the step); the caller aborts it.
        """
        updates: list[SeqUpdate] = []
        failures: list[SeqFailure] = []
        now = time.monotonic()
        for s in out.scheduled:
            req = self.requests.get(s.seq_id)
            if req is None or req.status != RequestStatus.RUNNING:  # aborted meanwhile
                continue
            try:
                bad = self._sample_error(s, sampled)
                if bad is not None:
                    failures.append(SeqFailure(req, bad.reason))
                    continue
                if s.num_drafts:
                    update = self._append_spec(req, s, sampled[req.request_id], now)
                    if not update.finished:
                        update.kv_blocks_ready = self.connector.blocks_ready(req)
                        if update.kv_blocks_ready:
                            update.kv_pin_id = self.connector.pin_of(req)
                    updates.append(update)
                    continue
                if s.prompt_logprob_targets:
                    got = (prompt_logprobs or {}).get(req.request_id)
                    if got is None or len(got) != len(s.prompt_logprob_targets):
                        raise ValueError(
                            f"the step returned {0 if got is None else len(got)} prompt "
                            f"logprobs for {len(s.prompt_logprob_targets)} positions"
                        )
                    req.prompt_logprobs.extend(got)
                req.num_computed_tokens += s.num_new_tokens
                ready = self.connector.blocks_ready(req)
                pin = self.connector.pin_of(req) if ready else None
                if not s.samples:
                    if ready:
                        updates.append(SeqUpdate(req, [], [], False, ready, pin))
                    continue
                first = req.num_output_tokens == req.num_resumed_tokens
                # _sample_error found no SampleError among s.samples (req and its siblings)
                sibs = [
                    (sib, cast(SampledToken, sampled[sib.request_id]))
                    for sib in (req.siblings if first else ())
                    if not sib.is_finished
                ]
                update, *started = self._first_tokens(
                    req, cast(SampledToken, sampled[req.request_id]), sibs, now
                )
                update.kv_blocks_ready, update.kv_pin_id = ready, pin
                updates.append(update)
                updates.extend(started)
            except Exception as e:  # the request's own failure (logged, then failed alone)
                logger.exception("step update of request %s failed", req.request_id)
                failures.append(SeqFailure(req, f"{type(e).__name__}: {e}"))
        return updates, failures

    @staticmethod
    def _sample_error(s: ScheduledSeq, sampled: dict[str, SampleResult]) -> SampleError | None:
        for spec in s.samples:
            tok = sampled.get(spec.seq_id)
            if tok is None:
                return SampleError(f"no token was sampled for {spec.seq_id}")
            if isinstance(tok, SampleError):
                return tok
        return None

    def _append_spec(
        self, req: Request, s: ScheduledSeq, result: SampleResult, now: float
    ) -> SeqUpdate:
        """Apply a verified speculative step: KV is valid for the last token and the accepted
        drafts; their tokens are appended one by one (a stop among them ends the request
        there); blocks only rejected drafts needed go back to the pool."""
        if not isinstance(result, SpecSample):
            raise TypeError(f"a speculative step got {type(result).__name__}")
        if not 0 <= result.num_accepted <= s.num_drafts or len(result.tokens) != (
            result.num_accepted + 1
        ):
            raise ValueError(
                f"bad verification: {result.num_accepted} of {s.num_drafts} drafts accepted, "
                f"{len(result.tokens)} tokens"
            )
        assert self.spec is not None
        self.spec.observe(req.request_id, s.num_drafts, result.num_accepted)
        req.num_computed_tokens += 1 + result.num_accepted
        merged = SeqUpdate(req, [], [], False)
        for tok in result.tokens:  # one by one, as if sampled in as many steps
            u = self._append(req, tok, now)  # finishes the request at a stop
            merged.new_token_ids += u.new_token_ids
            merged.new_logprobs += u.new_logprobs
            if u.finished:
                merged.finished = True
                return merged
        # the KV of the last token is computed next step: keep the blocks that hold
        # num_computed_tokens, give back those only rejected drafts needed
        self.kv.trim(req, req.num_computed_tokens)
        return merged

    def _append(self, req: Request, tok: SampledToken, now: float) -> SeqUpdate:
        req.append_output_token(tok.token_id)
        if tok.logprob is not None:
            req.logprobs.append(tok.logprob)
        if req.first_token_time is None:
            req.first_token_time = now
        if tok.end and tok.token_id not in req.sampling_params.stop_token_ids:
            # the sampler ended the row (its grammar left no token): a stop, also at
            # max_tokens (a prefill worker runs with max_tokens 1 and must say "stop")
            req.status = RequestStatus.FINISHED_STOPPED
            finished = True
        else:
            finished = self._check_stop(req, tok.token_id)
        if finished:
            self._finish(req, now)
        return SeqUpdate(req, [tok.token_id], [tok.logprob] if tok.logprob else [], finished)

    def _check_stop(self, req: Request, token: int) -> bool:
        p = req.sampling_params
        if not p.ignore_eos and token in req.eos_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
        elif token in p.stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_token_id = token
        elif (p.max_tokens is not None and req.num_output_tokens >= p.max_tokens) or (
            req.num_tokens >= self.config.max_model_len
        ):
            req.status = RequestStatus.FINISHED_LENGTH
        else:
            return False
        return True

    def _first_tokens(
        self,
        req: Request,
        tok: SampledToken,
        sibs: list[tuple[Request, SampledToken]],
        now: float,
    ) -> list[SeqUpdate]:
        """``tok`` for ``req`` and, on its first token, each live ``n > 1`` sibling's own
        (``sibs``): the leader's update, then the siblings'. The siblings fork the leader's
        prompt blocks before its token is appended: a leader that finishes on that token
        frees its blocks at once."""
        started = [self._start_sibling(req, sib, t, now) for sib, t in sibs]
        req.siblings = []
        return [self._append(req, tok, now), *started]

    def _start_sibling(
        self, leader: Request, sib: Request, tok: SampledToken, now: float
    ) -> SeqUpdate:
        """Fork an ``n > 1`` sibling off its leader's computed prompt, then give it its token."""
        sib.num_cached_tokens = leader.num_cached_tokens
        sib.first_scheduled_time = leader.first_scheduled_time
        sib.prompt_logprobs_sent = True  # the leader's first output carries them
        update = self._append(sib, tok, now)
        if sib.is_finished:
            return update
        # Over --max-num-seqs, or no block for the copy: admitted later like any waiting
        # request, its prompt from the prefix cache (the leader's blocks are cached).
        full = self.num_running >= self.config.max_num_seqs
        copies = None if full else self.kv.fork(leader, sib)
        if copies is None:
            sib.status = RequestStatus.WAITING
            self.waiting.append(sib)
        else:
            sib.num_computed_tokens = leader.num_computed_tokens
            self.pending_copies.extend(copies)
            sib.status = RequestStatus.RUNNING
            self.running.append(sib)
        return update

    def _finish(self, req: Request, now: float) -> None:
        req.finished_time = now
        if req in self.running:
            self.running.remove(req)
        if self.spec is not None:
            self.spec.forget(req.request_id)
        if req.grammar is not None:
            self.finished_since.append(req.request_id)
        self.kv.free(req)
        self.connector.request_finished(req)
        self.requests.pop(req.request_id, None)

    # ---- remote prefill (decode role) --------------------------------------------------
    def finish_remote_prefill(
        self,
        request_id: str,
        first_tokens: list[SampledToken] | None,
        fresh_blocks: bool = False,
    ) -> list[SeqUpdate]:
        """The prefill worker's KV for ``request_id`` arrived (``first_tokens``: one per
        sample) or failed (``None``: prefill the missing blocks locally). ``fresh_blocks``
        (with ``None``): the blocks reserved for the transfer may still be written (its receive
        did not stop), so the request leaves them to the transfer's pin and goes back to the
        front of the queue, to be admitted afresh (its cached prefix again, new blocks for the
        rest) and prefilled here."""
        req = self.remote_waiting.pop(request_id, None)
        if req is None:
            return []
        if first_tokens is None and fresh_blocks:
            self.kv.free(req)  # the pinned blocks stay pinned until the receive ends
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
            return []
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if first_tokens is None:
            return []  # num_computed_tokens stays at the local prefix: scheduled as a prefill
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv.cache_blocks(req, req.num_prompt_tokens)
        now = time.monotonic()
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        sibs = [(s, t) for s, t in zip(req.siblings, first_tokens[1:]) if not s.is_finished]
        return self._first_tokens(req, first_tokens[0], sibs, now)

    def fits_beside_pins(self, req: Request) -> bool:
        """Whether ``req``'s whole prompt and its first new token fit in the pool's blocks that
        no KV transfer pins (a fresh-block re-admission's bound: ``finish_remote_prefill``)."""
        need = cdiv(req.num_tokens + 1, self.block_size)
        return need <= self.kv.pool.num_blocks - self.kv.num_pinned_blocks

    # ---- abort -------------------------------------------------------------------------
    def abort(
        self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[Request]:
        """End live sequences by id with ``status`` (aborted, or failed); unknown or finished
        ids are ignored. Their block tables are freed (pinned blocks stay pinned)."""
        aborted = []
        ids = list(request_ids)
        dropped = set(ids)
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is None or req.is_finished:
                continue
            if req.siblings:  # n > 1 samples that would fork at this one's first token
                rest = [s for s in req.siblings if s.request_id not in dropped]
                req.siblings = []
                if rest:  # the first goes on as their leader, from the prompt
                    rest[0].siblings = rest[1:]
                    self.waiting.appendleft(rest[0])
            if req in self.running:
                self.running.remove(req)
            elif req.status == RequestStatus.SWAPPED:
                self.swapped.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                self.remote_waiting.pop(rid, None)
            else:
                try:
                    self.waiting.remove(req)
                except ValueError:
                    pass  # a pending sibling: not queued yet
            req.status = status
            req.finished_time = time.monotonic()
            if self.spec is not None:
                self.spec.forget(rid)
            if req.grammar is not None:
                self.finished_since.append(rid)
            self.kv.free(req)
            self.connector.request_finished(req)
            aborted.append(req)
        return aborted

    def live_request_ids(self) -> set[str]:
        return set(self.requests)


def _sample_spec(req: Request) -> SampleSpec:
    p = req.sampling_params
    if req.grammar is None and not p.needs_penalties:
        return SampleSpec(req.request_id, p, req.num_output_tokens, req.eos_token_ids)
    return SampleSpec(  # the token lists the penalties or the grammar's matcher need
        req.request_id,
        p,
        req.num_output_tokens,
        req.eos_token_ids,
        req.prompt_token_ids if p.repetition_penalty != 1.0 else (),
        tuple(req.output_token_ids),
        req.grammar,
    )
