"""Engine outputs: per-step deltas for the services and vLLM-shaped results for ``LLM``."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.engine.request import Logprob


class FailureKind(str, enum.Enum):
    """Who a failure belongs to (docs/architecture.md, "Failures")."""

    REQUEST = "request"  # this request failed alone; the engine goes on serving the others
    ENGINE = "engine"  # the engine stopped (a broken invariant or a failed forward pass)


@dataclass(frozen=True, slots=True)
class RequestFailure:
    kind: FailureKind
    message: str


@dataclass(slots=True)
class EngineCoreOutput:
    """What one sequence (``index`` of parent ``request_id``) produced in one step."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[Logprob]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_blocks_ready: list[tuple[int, int]] = field(default_factory=list)  # (block index, id)
    kv_pin_id: int | None = None  # with kv_blocks_ready: the pin holding them (unpin when sent)
    failure: RequestFailure | None = None  # with finish_reason "error"
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # prompt_logprobs: one per prompt token after the first, once, with the first token
    prompt_logprobs: list[Logprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[Logprob] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    error: str | None = None  # with finish_reason "error": why this request failed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # vLLM's: None for the first prompt token, then one per token (with prompt_logprobs)
    prompt_logprobs: list[Logprob | None] | None = None
