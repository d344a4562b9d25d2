"""Engine-side request record: tokens, progress, state. Plain data, no torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from shared.engine.sampling_params import SamplingParams
from shared.hashing import ROOT_HASH, block_hashes


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1  # blocks reserved, KV being pushed by a prefill worker
    RUNNING = 2
    PREEMPTED = 3  # blocks dropped; will recompute
    SWAPPED = 4  # blocks copied to the host pool; will swap back in
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13  # failed alone (sampling, stop handling, its output sink); see .error

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True)
class Logprob:
    """Logprob record of one sampled token: its logprob, 1-based rank and the top-N."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(eq=False, slots=True)
class Request:
    """One sequence. A parent request with ``n > 1`` becomes ``n`` sibling ``Request`` objects.

    ``num_computed_tokens`` (KV written) catches up with ``num_tokens`` (prompt + output);
    the scheduler alone advances it. ``block_hashes`` holds the chained hashes of every full
    block of ``all_token_ids`` and is extended as tokens are appended.
    """

    request_id: str  # engine-unique id of this sequence
    parent_id: str  # the id the caller used (equal to request_id when n == 1)
    index: int  # which of the parent's n samples
    prompt_token_ids: tuple[int, ...]  # never changes (siblings share it)
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_size: int
    hash_seed: int
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling (-1 = not yet)
    num_preemptions: int = 0
    logprobs: list[Logprob] = field(default_factory=list)
    stop_token_id: int | None = None
    siblings: list[Request] = field(default_factory=list)  # n > 1: forked at first token
    num_resumed_tokens: int = 0  # failover: output tokens given by the caller, not sampled here
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    error: str | None = None  # why it ended in FINISHED_ERROR
    grammar: object | None = None  # compiled structured-outputs grammar (opaque to the core)
    # prompt_logprobs: one entry per prompt token after the first, filled chunk by chunk
    prompt_logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False  # with the first token (a sibling never sends them)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        self._extend_hashes()

    # ---- tokens ----------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.num_tokens % self.block_size == 0:
            self._extend_hashes()

    def _extend_hashes(self) -> None:
        done = len(self.block_hashes)
        parent = self.block_hashes[-1] if done else ROOT_HASH
        self.block_hashes.extend(
            block_hashes(self.all_token_ids, self.block_size, self.hash_seed, parent, done)
        )

    @property
    def wants_prompt_logprobs(self) -> bool:
        """``prompt_logprobs`` asked for and not yet delivered (they go out with the first
        token): the prompt is computed here in full, none of it read from a cache."""
        return self.sampling_params.prompt_logprobs is not None and self.first_token_time is None

    @property
    def max_output_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
