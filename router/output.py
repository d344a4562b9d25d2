"""Per-sample output processing: incremental detokenization, stop strings, token accounting.

vLLM's semantics:

- text grows token by token through ``tokenizers``' ``DecodeStream``, so a UTF-8 character
  split across byte-level tokens appears only once it is complete (no U+FFFD mid-stream);
- stop strings are checked after every token once ``min_tokens`` tokens exist; a match ends
  the sample with ``finish_reason="stop"`` and ``stop_reason=<the string>``, the text is cut
  before the string (after it with ``include_stop_str_in_output``) and tokens after the one
  that completed the match are dropped (they are neither counted nor returned);
- a sample the engine ends with ``"stop"`` ended on an EOS or ``stop_token_ids`` token: that
  token is counted but not detokenized (unless ``include_stop_str_in_output``);
- while streaming, the last ``len(longest stop) - 1`` characters are held back so a partial stop
  string is never sent; a token that could be a terminal token (EOS / stop token id) at the end
  of a delta is held back until the engine says whether it ended the sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

from router.tokenizer import RouterTokenizer
from shared.proto import pdserve_pb2 as pb


@dataclass(frozen=True, slots=True)
class OutputParams:
    """What the router does with a request's output tokens."""

    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    terminal_ids: frozenset[int] = frozenset()  # tokens that may end a sample (EOS, stop ids)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    logprobs: int | None = None  # top-N per token; None = no logprobs
    return_tokens_as_token_ids: bool = False
    prompt_logprobs: int | None = None  # vLLM's: top-N per prompt token; None = none
    echo: bool = False  # completions: the prompt's text (and logprobs) before each choice's
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone
    return_token_ids: bool = False  # vLLM's: token ids with the text (streams: per chunk)


@dataclass(slots=True)
class TokenEntry:
    """One accounted output token, with its logprob data when requested."""

    token_id: int
    text_offset: int
    logprob: pb.TokenLogprob | None = None


_NO_ENTRIES: tuple[TokenEntry, ...] = ()


@dataclass(slots=True)
class SampleDelta:
    """What a sample produced since the previous :meth:`SampleOutput.take`."""

    index: int
    text: str
    tokens: Sequence[TokenEntry]  # only when logprobs or token ids were requested
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(slots=True)
class SampleOutput:
    """The state of one of the ``n`` samples of one prompt.

    :meth:`add` runs once per decode-worker message, so the common case (one token, no stop
    strings, no logprobs, not a possible terminal token) takes a short path that does only
    what the general one would do for it: count the token and append its text.
    """

    index: int
    tokenizer: RouterTokenizer
    params: OutputParams
    prime: Sequence[int] = ()  # the prompt's last tokens (RouterTokenizer.prompt_tail)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # the incremental decoder; always set by __post_init__ (None only as the field default)
    _step: Callable[[int], str | None] = cast("Callable[[int], str | None]", None)
    _held: TokenEntry | None = None
    _entries: list[TokenEntry] = field(default_factory=list)  # accounted, not yet taken
    _sent_chars: int = 0
    _finish_sent: bool = False
    _hold: int = 0  # characters held back while streaming (a stop string may still match)
    _plain: bool = False  # no stop strings and no logprobs: the one-token short path applies
    _want_entries: bool = False  # logprobs were requested: keep a TokenEntry per token

    def __post_init__(self) -> None:
        p = self.params
        self._step = self.tokenizer.stepper(p.skip_special_tokens, self.prime)
        max_stop = max((len(s) for s in p.stop), default=0)
        self._hold = 0 if p.include_stop_str_in_output else max(0, max_stop - 1)
        self._want_entries = p.logprobs is not None or p.return_token_ids
        self._plain = not p.stop and not self._want_entries

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[pb.TokenLogprob] = (),
        finish_reason: str = "",
        stop_token_id: int | None = None,
    ) -> None:
        """Account one engine delta. Ignored once the sample finished."""
        if self.finish_reason is not None:
            return
        if (
            self._plain
            and not finish_reason
            and len(token_ids) == 1
            and self._held is None
            and token_ids[0] not in self.params.terminal_ids
        ):
            tid = token_ids[0]
            self.token_ids.append(tid)
            new = self._step(tid)
            if new:
                self.text += new
            return
        last = len(token_ids) - 1
        for j, tid in enumerate(token_ids):
            if self._held is not None:
                held, self._held = self._held, None
                if self._detokenize(held):
                    return
            entry = TokenEntry(tid, len(self.text), logprobs[j] if j < len(logprobs) else None)
            self.token_ids.append(tid)
            if self._want_entries:
                self._entries.append(entry)
            if j == last and finish_reason == "stop" and not self.params.include_stop_str_in_output:
                break  # the EOS / stop token that ended the sample: counted, not shown
            if j == last and not finish_reason and tid in self.params.terminal_ids:
                self._held = entry  # wait to learn whether it ended the sample
                break
            if self._detokenize(entry):
                return
        if finish_reason:
            if self._held is not None and not (
                finish_reason == "stop" and not self.params.include_stop_str_in_output
            ):
                held, self._held = self._held, None
                if self._detokenize(held):
                    return
            self._held = None
            self.finish_reason = finish_reason
            if (
                finish_reason == "stop"
                and stop_token_id is not None
                and (stop_token_id in self.params.stop_token_ids)
            ):
                self.stop_reason = stop_token_id

    def _detokenize(self, entry: TokenEntry) -> bool:
        """Append one token's text; True when a stop string ended the sample."""
        entry.text_offset = len(self.text)
        new = self._step(entry.token_id)
        if not new:
            return False
        self.text += new
        # vLLM's rule: the first min_tokens tokens' text is never searched for a stop string
        if not self.params.stop or len(self.token_ids) <= self.params.min_tokens:
            return False
        return self._check_stop(len(new))

    def _check_stop(self, new_chars: int) -> bool:
        best: tuple[int, str] | None = None
        for s in self.params.stop:
            # only matches that end inside the new characters (older ones were checked before)
            start = max(0, len(self.text) - new_chars - len(s) + 1)
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = (
            self.text[: i + len(s)] if self.params.include_stop_str_in_output else self.text[:i]
        )
        self.finish_reason, self.stop_reason = "stop", s
        self._held = None
        return True

    def take(self) -> SampleDelta | None:
        """New text (minus the stop-string hold-back), new tokens (only when logprobs were
        requested), and the finish (once)."""
        sent = self._sent_chars
        if self.finish_reason is None:
            end = len(self.text) - self._hold
            finish = None
        else:
            end = len(self.text)
            finish = None if self._finish_sent else self.finish_reason
        if end <= sent:
            if not self._entries and finish is None:
                return None
            end = sent
        self._sent_chars = end
        entries: Sequence[TokenEntry] = self._entries
        if entries:
            self._entries = []
        else:
            entries = _NO_ENTRIES
        if finish is not None:
            self._finish_sent = True
        return SampleDelta(
            self.index,
            self.text[sent:end],
            entries,
            finish,
            self.stop_reason if finish is not None else None,
        )
