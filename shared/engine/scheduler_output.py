"""What the scheduler hands the model runner, and what comes back: plain data, no torch.

The runner reads nothing but a :class:`SchedulerOutput`: per scheduled sequence the tokens to
compute and where (their first position and the block table, from which the slots follow), and
per token to draw a :class:`SampleSpec` with everything sampling needs. It answers with one
:class:`SampledToken` (or :class:`SampleError`) per ``SampleSpec.seq_id``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.engine.request import Logprob, Request
from shared.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SampleSpec:
    """One token to draw from the logits at the last position of a scheduled chunk.

    ``num_output_tokens`` is the draw's position (seeded sampling keys on it) and what
    ``min_tokens`` counts; the token lists are given only when the penalties need them.
    """

    seq_id: str
    params: SamplingParams
    num_output_tokens: int
    eos_token_ids: tuple[int, ...]
    prompt_token_ids: Sequence[int] = ()  # only with a repetition penalty
    output_token_ids: Sequence[int] = ()  # only with any penalty, or a grammar
    grammar: object | None = None  # structured outputs: the compiled grammar


def position_spec(spec: SampleSpec, drafts: Sequence[int], j: int) -> SampleSpec:
    """The draw at verified position ``j`` of a speculating sequence: as if ``drafts[:j]`` had
    been sampled already (its output position, and the outputs the penalties count)."""
    if j == 0:
        return spec
    outputs = (*spec.output_token_ids, *drafts[:j]) if spec.params.needs_penalties else ()
    return SampleSpec(
        spec.seq_id,
        spec.params,
        spec.num_output_tokens + j,
        spec.eos_token_ids,
        spec.prompt_token_ids,
        outputs,
        spec.grammar,
    )


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One sequence's work this step: compute ``token_ids`` at positions
    ``start .. start + len(token_ids) - 1`` (slot of position p: ``block_ids[p // block_size]``
    offset ``p % block_size``), attending over positions ``0 .. start + len - 1``; then draw
    one token per ``samples`` entry (several for the pending siblings of an ``n > 1`` request at
    its first token; none while a prefill is incomplete)."""

    seq_id: str
    start: int
    token_ids: Sequence[int]
    block_ids: Sequence[int]
    samples: tuple[SampleSpec, ...] = ()
    # speculative decoding (shared/engine/spec_decode.py): the n-gram drafts, already the tail
    # of token_ids; or, for a draft model, how many drafts the runner makes itself (token_ids
    # is then the last token only). Either way the step verifies them and draws one token more.
    draft_token_ids: tuple[int, ...] = ()
    num_lookahead: int = 0
    all_token_ids: Sequence[int] = ()  # with num_lookahead: the sequence so far (the draft
    # model recomputes its own KV from it where it lacks some)
    # prompt_logprobs: the prompt tokens that this chunk's first len(...) positions predict
    # (the runner returns their logprobs, ``prompt_logprobs_top`` best each)
    prompt_logprob_targets: tuple[int, ...] = ()
    prompt_logprobs_top: int = 0

    @property
    def num_new_tokens(self) -> int:
        """Positions computed this step (drafts included)."""
        return len(self.token_ids) + self.num_lookahead

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids) + self.num_lookahead


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    num_preempted: int = 0
    finished_seq_ids: list[str] = field(default_factory=list)  # ended since the last step

    @property
    def is_empty(self) -> bool:
        return not (
            self.scheduled
            or self.blocks_to_copy
            or self.blocks_to_swap_out
            or self.blocks_to_swap_in
        )


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: Logprob | None = None
    # the sequence ends with this token whatever its stop rules say: its grammar is complete,
    # or no token satisfies both the grammar and the request's other rules (allowed_token_ids)
    end: bool = False


@dataclass(frozen=True, slots=True)
class SampleError:
    """The sampler could not draw this sequence's token; its request fails alone."""

    reason: str


@dataclass(slots=True)
class SpecSample:
    """A speculating sequence's draws: the accepted drafts, then the target's own token (the
    correction at the first rejected draft, or the bonus after the last accepted)."""

    tokens: list[SampledToken]
    num_drafts: int
    num_accepted: int


SampleResult = SampledToken | SampleError | SpecSample


@dataclass(frozen=True, slots=True)
class SeqFailure:
    """A sequence whose step failed (its parent request fails; the others go on)."""

    request: Request
    reason: str


@dataclass(slots=True)
class SeqUpdate:
    """What one sequence gained this step (the engine turns these into outputs)."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[Logprob]
    finished: bool
    kv_blocks_ready: list[tuple[int, int]] = field(default_factory=list)  # (block index, id)
    kv_pin_id: int | None = None  # with kv_blocks_ready: the pin that holds them
