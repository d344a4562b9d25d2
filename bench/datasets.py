"""Benchmark workloads as plain data: sessions made of turns.

Every dataset returns ``list[Session]``. A single-turn dataset has one turn per session; the
multi-turn dataset has several, and the runner resends the growing history for each. All
randomness comes from one ``numpy.random.Generator`` seeded by the caller, so a seed and the
same tokenizer give the same prompts.

Lengths are in tokens of the served model's tokenizer. ``Turn.prompt_len`` is what the server
sees for a completions request: ``len(encode(prompt))`` including the special tokens the
tokenizer adds (BOS), as vLLM's random dataset counts them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bench.tokenizer import BenchTokenizer

# ShareGPT length statistics (tokens). The means are those the vLLM paper (Kwon et al.,
# SOSP 2023, Fig. 11) reports for ShareGPT; the log-normal shape (sigma) is our assumption,
# not a fit, since no per-request data is downloaded. See docs/notes/bench.md.
SHAREGPT_INPUT_MEAN = 161.3
SHAREGPT_OUTPUT_MEAN = 338.0
SHAREGPT_SIGMA = 1.0
# vLLM's ShareGPT filter: drop prompts or outputs under 4 tokens, prompts over 1024 tokens and
# pairs over 2048 tokens. We redraw instead of dropping.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_INPUT = 1024
SHAREGPT_MAX_TOTAL = 2048

_FIT_TRIES = 24


@dataclass(frozen=True, slots=True)
class Turn:
    prompt: str  # the completions prompt, or the user message of a chat turn
    prompt_len: int  # tokens as the server counts a completions prompt (specials included)
    output_len: int  # max_tokens for this turn


@dataclass(frozen=True, slots=True)
class Session:
    session_id: int
    turns: tuple[Turn, ...]
    system: str | None = None  # chat system message (multi-turn only)
    group: int | None = None  # which shared prefix (prefix-repetition only)


@dataclass(slots=True)
class DatasetStats:
    """What the generator could not make exactly; reported with the results."""

    inexact_prompts: int = 0  # prompts whose token count missed the target
    prefix_mismatches: int = 0  # prompts whose tokens do not start with their shared prefix


class DatasetError(ValueError):
    """Bad dataset parameters."""


class TextMaker:
    """Builds text that the tokenizer encodes to an exact number of tokens.

    Random ids are decoded to text; re-encoding that text can merge or split tokens, so the
    text's own canonical ids are trimmed or extended and the text rebuilt until the count is
    exact (a few rounds in practice). If the rounds oscillate, the longest text under the
    target is topped up with single-token words. A miss after that is counted in
    ``stats.inexact_prompts`` and the closest text is used.
    """

    def __init__(self, tok: BenchTokenizer, rng: np.random.Generator, wordlike: bool = False):
        self.tok = tok
        self.rng = rng
        self.pool = np.asarray(tok.token_pool(wordlike), dtype=np.int64)
        if len(self.pool) == 0:
            raise DatasetError("the tokenizer has no non-special tokens to build prompts from")
        self.stats = DatasetStats()
        self._fillers: list[str] | None = None

    def _draw(self, n: int) -> list[int]:
        return self.rng.choice(self.pool, size=n).tolist() if n > 0 else []

    def fit(self, target: int, head: str = "", sep: str = " ") -> tuple[str, int]:
        """Return ``(prompt, n)``: ``prompt = head + sep + tail`` (just ``tail`` when ``head`` is
        empty) with ``n = len(encode(prompt))``, which aims at ``target``.

        ``encode(head)`` stays a prefix of ``encode(prompt)`` (the shared-prefix guarantee); a
        draw whose first token merges into the head is redrawn.
        """
        head_ids = self.tok.encode(head)
        lead = head + sep if head else ""
        need = target - len(head_ids)
        if need < 0 or (head and need == 0):
            raise DatasetError(
                f"cannot make a {target}-token prompt: the fixed part alone is "
                f"{len(head_ids)} tokens"
            )
        best: tuple[int, str, int] | None = None  # (distance, prompt, n)
        under: tuple[str, int] | None = None  # the longest candidate not over the target
        ids = self._draw(need)
        for _ in range(_FIT_TRIES):
            tail = self.tok.decode(ids)
            if head and tail.startswith(sep):
                tail = tail[len(sep) :]
            prompt = lead + tail
            full = self.tok.encode(prompt)
            n = len(full)
            if full[: len(head_ids)] != head_ids:  # the tail merged into the head: start over
                ids = self._draw(need)
                continue
            if n == target:
                return prompt, n
            if best is None or abs(n - target) < best[0]:
                best = (abs(n - target), prompt, n)
            if n < target and (under is None or n > under[1]) and (n > len(head_ids) or not head):
                under = (prompt, n)
            ids = full[len(head_ids) :]  # the tail's canonical ids (sep included)
            if n > target:
                ids = ids[: max(0, len(ids) - (n - target))]
            else:
                ids = ids + self._draw(target - n)
        if under is not None:  # rounds oscillated: top up one single-token word at a time
            prompt, n = self._pad(*under, target)
            if n == target and self.tok.encode(prompt)[: len(head_ids)] == head_ids:
                return prompt, n
        if best is None:
            self.stats.prefix_mismatches += 1
            prompt = lead + self.tok.decode(self._draw(need))
            return prompt, self.tok.count(prompt)
        self.stats.inexact_prompts += 1
        return best[1], best[2]

    def _pad(self, prompt: str, n: int, target: int) -> tuple[str, int]:
        """Append words (" w") that each add exactly one token, until ``n == target``."""
        if self._fillers is None:
            self._fillers = [self.tok.decode([i]) for i in self.tok.token_pool(wordlike=True)]
            self._fillers = [w for w in self._fillers if w.startswith(" ")]
        for _ in range(4 * (target - n) + 16):
            if n == target or not self._fillers:
                break
            w = self._fillers[int(self.rng.integers(len(self._fillers)))]
            c = self.tok.count(prompt + w)
            if c == n + 1:
                prompt, n = prompt + w, c
        return prompt, n


def _uniform_lens(
    rng: np.random.Generator, mean: int, ratio: float, n: int, low_min: int
) -> list[int]:
    """``n`` lengths uniform in [mean*(1-ratio), mean*(1+ratio)] (vLLM's range ratio), at least
    ``low_min``."""
    lo = max(low_min, int(mean * (1 - ratio)))
    hi = max(lo, int(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n).tolist()


def _check_ratio(ratio: float) -> None:
    if not 0.0 <= ratio < 1.0:
        raise DatasetError(f"range ratio must be in [0, 1), got {ratio}")


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise DatasetError(f"{name} must be >= 1, got {v}")


def random_dataset(
    tok: BenchTokenizer,
    rng: np.random.Generator,
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
) -> tuple[list[Session], DatasetStats]:
    """Random-token prompts of ``prefix_len + U(input_len ± ratio)`` tokens (all sharing one
    ``prefix_len``-token prefix when it is > 0), ``U(output_len ± ratio)`` output tokens."""
    _check_positive(num_prompts=num, input_len=input_len, output_len=output_len)
    _check_ratio(range_ratio)
    maker = TextMaker(tok, rng)
    prefix = maker.fit(prefix_len + tok.num_special_tokens_to_add)[0] if prefix_len > 0 else ""
    in_lens = _uniform_lens(rng, input_len, range_ratio, num, 1)
    out_lens = _uniform_lens(rng, output_len, range_ratio, num, 1)
    sessions = []
    for i in range(num):
        prompt, n = maker.fit(prefix_len + in_lens[i], head=prefix)
        sessions.append(Session(i, (Turn(prompt, n, out_lens[i]),)))
    return sessions, maker.stats


def _lognormal(rng: np.random.Generator, mean: float, sigma: float) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so that E[X] = mean before the filter
    return round(rng.lognormal(mu, sigma))


def sharegpt_dataset(
    tok: BenchTokenizer,
    rng: np.random.Generator,
    num: int,
    input_mean: float = SHAREGPT_INPUT_MEAN,
    output_mean: float = SHAREGPT_OUTPUT_MEAN,
    sigma: float = SHAREGPT_SIGMA,
    max_input: int = SHAREGPT_MAX_INPUT,
    max_total: int = SHAREGPT_MAX_TOTAL,
    fixed_output_len: int | None = None,
) -> tuple[list[Session], DatasetStats]:
    """ShareGPT-like single-turn chats of word-like text, no download.

    Input and output lengths are independent log-normals with the given means and ``sigma``
    (of the underlying normal); a pair is redrawn until it passes vLLM's ShareGPT filter
    (both >= 4, input <= ``max_input``, input + output <= ``max_total``).
    """
    _check_positive(num_prompts=num)
    if input_mean <= 0 or output_mean <= 0 or sigma <= 0:
        raise DatasetError("ShareGPT means and sigma must be > 0")
    if max_input < SHAREGPT_MIN_LEN or max_total < 2 * SHAREGPT_MIN_LEN:
        raise DatasetError("ShareGPT max input/total lengths are too small")
    maker = TextMaker(tok, rng, wordlike=True)
    sessions = []
    for i in range(num):
        for _ in range(10_000):
            n_in = _lognormal(rng, input_mean, sigma)
            n_out = fixed_output_len or _lognormal(rng, output_mean, sigma)
            if (
                n_in >= SHAREGPT_MIN_LEN
                and n_out >= SHAREGPT_MIN_LEN
                and n_in <= max_input
                and n_in + n_out <= max_total
            ):
                break
        else:
            raise DatasetError("ShareGPT length filter rejects almost every draw; check the means")
        text, n = maker.fit(n_in)
        sessions.append(Session(i, (Turn(text, n, n_out),)))
    return sessions, maker.stats


def prefix_repetition_dataset(
    tok: BenchTokenizer,
    rng: np.random.Generator,
    num: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
) -> tuple[list[Session], DatasetStats]:
    """``num_prefixes`` random prefixes of ``prefix_len`` tokens, each request one of them plus
    a unique ``suffix_len``-token suffix (prompt = prefix + " " + suffix), in shuffled order.

    The prefix's token ids are a prefix of every prompt's token ids that uses it (checked).
    """
    _check_positive(
        num_prompts=num,
        prefix_len=prefix_len,
        suffix_len=suffix_len,
        num_prefixes=num_prefixes,
        output_len=output_len,
    )
    maker = TextMaker(tok, rng)
    prefixes = [
        maker.fit(prefix_len + tok.num_special_tokens_to_add)[0] for _ in range(num_prefixes)
    ]
    groups = [i % num_prefixes for i in range(num)]
    rng.shuffle(groups)
    sessions = []
    for i, g in enumerate(groups):
        prompt, n = maker.fit(prefix_len + suffix_len, head=prefixes[g])
        sessions.append(Session(i, (Turn(prompt, n, output_len),), group=g))
    return sessions, maker.stats


def multi_turn_dataset(
    tok: BenchTokenizer,
    rng: np.random.Generator,
    num_sessions: int,
    turns: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    system_len: int = 0,
) -> tuple[list[Session], DatasetStats]:
    """``num_sessions`` chats of ``turns`` user messages of ``U(input_len ± ratio)`` word-like
    tokens each, asking for ``U(output_len ± ratio)`` tokens per answer. With ``system_len``
    > 0, every session starts with the same system message of that many tokens.

    The runner sends turn k as the system message, all earlier user messages and the
    server's earlier answers, then user message k; so each request's prompt starts with the
    previous request's prompt and answer.
    """
    _check_positive(
        num_sessions=num_sessions, turns=turns, input_len=input_len, output_len=output_len
    )
    _check_ratio(range_ratio)
    maker = TextMaker(tok, rng, wordlike=True)
    no_specials = tok.num_special_tokens_to_add
    system = maker.fit(system_len + no_specials)[0] if system_len > 0 else None
    sessions = []
    for s in range(num_sessions):
        in_lens = _uniform_lens(rng, input_len, range_ratio, turns, 1)
        out_lens = _uniform_lens(rng, output_len, range_ratio, turns, 1)
        ts = []
        for k in range(turns):
            text, n = maker.fit(in_lens[k] + no_specials)
            ts.append(Turn(text, n - no_specials, out_lens[k]))  # message tokens, no BOS
        sessions.append(Session(s, tuple(ts), system=system))
    return sessions, maker.stats
