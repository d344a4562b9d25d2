"""Speculative decoding, the engine side (plain Python, no torch): proposals, budgets, stats.

A decoding request that speculates asks for ``1 + k`` slots in a step: its last sampled token
and ``k`` draft tokens, verified in the same forward pass (``ModelRunner`` + ``Sampler.
verify_rows``). The drafts come from the n-gram proposer here (prompt lookup, run by the
scheduler on token ids) or from a draft model (run by the model runner before the target's
forward; the scheduler only reserves ``k`` lookahead slots). After the step the scheduler
keeps the accepted drafts plus one token from the target, advances ``num_computed_tokens`` by
the positions whose KV is now valid, and gives back the blocks only rejected drafts needed.
Drafts are never part of a request's tokens until accepted, so they are never hashed into the
prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.config import SpeculativeConfig


class NgramIndex:
    """Latest end position of every n-gram (``lo <= n <= hi``) of a token sequence, built
    incrementally: the proposal for a sequence of length L is the continuation of the latest
    earlier occurrence of its longest suffix n-gram that has one."""

    __slots__ = ("lo", "hi", "ends", "upto")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.ends: dict[tuple[int, ...], int] = {}
        self.upto = 0  # n-grams ending before this position are registered

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        n_tokens = len(tokens)
        # register every n-gram that ends strictly before the end (the suffix is not its own match)
        for end in range(max(self.upto, 1), n_tokens):
            for n in range(self.lo, min(self.hi, end) + 1):
                self.ends[tuple(tokens[end - n : end])] = end
        self.upto = max(self.upto, n_tokens)
        for n in range(min(self.hi, n_tokens - 1), self.lo - 1, -1):
            end = self.ends.get(tuple(tokens[n_tokens - n :]))
            if end is not None and end < n_tokens:
                return list(tokens[end : min(end + k, n_tokens)])
        return []


@dataclass
class SpecStats:
    """vLLM's spec-decode counters (exported as ``pdserve:spec_decode_*``)."""

    num_drafts: int = 0  # sequence-steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos.extend([0] * (num_drafts - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


# A request whose drafts keep being rejected speculates less: below this acceptance (a moving
# average of accepted / proposed drafts) it decodes plainly for PAUSE_STEPS steps, then probes
# with one speculative step. A useless draft then costs ~1 step in PAUSE_STEPS + 1 instead of
# every step (vLLM has only disable_by_batch_size; both apply here).
MIN_ACCEPTANCE = 0.25
PAUSE_STEPS = 16
_EWMA = 0.3  # weight of the newest step


class SpecDecoder:
    """The scheduler's half of speculative decoding: how many drafts a request may carry this
    step and, for n-gram, which."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.stats = SpecStats()
        self._index: dict[str, NgramIndex] = {}
        self._accept: dict[str, list[float]] = {}  # request -> [acceptance average, paused steps]

    def allow(self, request_id: str) -> bool:
        """Whether this request may speculate this step (see ``MIN_ACCEPTANCE``)."""
        st = self._accept.get(request_id)
        if st is None or st[1] <= 0:
            return True
        st[1] -= 1
        return False

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        self.stats.record(num_drafts, num_accepted)
        st = self._accept.setdefault(request_id, [1.0, 0])
        st[0] = (1 - _EWMA) * st[0] + _EWMA * (num_accepted / num_drafts)
        if st[0] < MIN_ACCEPTANCE:
            st[1] = PAUSE_STEPS

    @property
    def uses_draft_model(self) -> bool:
        return self.config.method == "draft_model"

    def active(self, num_running: int) -> bool:
        dbs = self.config.disable_by_batch_size
        return dbs is None or num_running < dbs

    def max_drafts(self, num_tokens: int, num_output: int, max_tokens: int | None) -> int:
        """Drafts a request may carry: every accepted one becomes an output token, so stay
        within ``max_tokens`` and the model length (one more token comes from the target)."""
        k = min(self.k, self.max_model_len - num_tokens - 1)
        if max_tokens is not None:
            k = min(k, max_tokens - num_output - 1)
        return max(0, k)

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        """n-gram drafts (at most ``k``) for the sequence ``tokens``."""
        idx = self._index.get(request_id)
        if idx is None:
            idx = self._index[request_id] = NgramIndex(
                self.config.prompt_lookup_min, self.config.prompt_lookup_max
            )
        return idx.propose(tokens, k)

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)
        self._accept.pop(request_id, None)
