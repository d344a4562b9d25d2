"""Sampling parameters (vLLM's names, defaults and validation rules). No torch import.

``validate()`` is the engine's own boundary check: the offline ``LLM``, the workers' gRPC
services and the router all reach it, so every value the sampler sees is a finite number of
the right type in its range (a NaN temperature or a seed that overflows ``seed + n`` raises
here, naming the parameter, never on the engine thread).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT32_MAX = (1 << 31) - 1
#: Hard caps that protect a worker whatever its caller checked (the router's limits are
#: lower and configurable): samples per request and stop token ids per request.
MAX_N = 1024
MAX_STOP_TOKEN_IDS = 1024
#: logit_bias entries and allowed_token_ids per request: above any vocabulary in use (the
#: engine also checks every id against its model's vocabulary, EngineCore.add_request)
MAX_TOKEN_ID_SET = 1 << 18
#: OpenAI's range for a logit_bias value (it refuses values outside it)
MAX_LOGIT_BIAS = 100.0
DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the parameter and the value.

    ``param`` is the parameter's name (the OpenAI / vLLM field name)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _summary(v: object) -> object:
    """A value for an error message: a collection by its size, not its items."""
    return f"<{len(v)} entries>" if isinstance(v, (dict, list, tuple, set)) else v


MAX_GRAMMAR_CHARS = 256 * 1024  # a schema / regex / grammar larger than this is refused


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a JSON schema, as JSON text),
    ``regex``, ``choice``, ``grammar`` (EBNF / GBNF) or ``json_object`` (any JSON object)."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def kind(self) -> tuple[str, str]:
        """(kind, spec): the compiled-grammar cache key. Two different specs never share a
        key: a choice list is keyed by its JSON array (a separator-joined list is not
        one-to-one: the strings may hold any character, NUL included)."""
        set_ = [
            (k, v, len(v))
            for k, v in (
                ("json", self.json),
                ("regex", self.regex),
                ("grammar", self.grammar),
            )
            if v is not None
        ]
        if self.choice is not None:
            # its size is the characters of the strings and one per separator, not the key's
            # (JSON escapes would make a list of control characters count up to 6 times)
            size = sum(map(len, self.choice)) + max(len(self.choice) - 1, 0)
            set_.append(("choice", json.dumps(list(self.choice)), size))
        if self.json_object:
            set_.append(("json_object", "", 0))
        if len(set_) != 1:
            raise SamplingParamsError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {len(set_)}",
                param="structured_outputs",
            )
        kind, spec, size = set_[0]
        if size > MAX_GRAMMAR_CHARS:
            raise SamplingParamsError(
                f"structured_outputs {kind} has {size} characters; at most "
                f"{MAX_GRAMMAR_CHARS} allowed",
                param="structured_outputs",
            )
        if kind == "choice" and (not self.choice or not all(self.choice)):
            raise SamplingParamsError(
                "structured_outputs choice needs non-empty strings", param="structured_outputs"
            )
        return kind, spec


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per sampled token (0 = sampled token only)
    # vLLM's prompt_logprobs: top-N logprobs of every prompt token after the first (0 = the
    # prompt token's own only); the prompt is then computed in full, never read from a cache
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's logit_bias: token id -> value added to its logit before sampling; vLLM's
    # allowed_token_ids: only these ids may be sampled (see shared/engine/sampler.py)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # the sampler's device tensors of the two above, built on first use (per request: never
    # copied by clone() / for_sample(), compared or shown)
    sampler_cache: dict[str, object] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, max_logprobs: int | None = None) -> None:
        """Raise :class:`SamplingParamsError` naming the first bad parameter. ``max_logprobs``
        (the engine's ``--max-logprobs``) bounds ``logprobs``; construction checks the rest."""

        def bad(name: str, value: object, rule: str) -> SamplingParamsError:
            return SamplingParamsError(f"{name} must be {rule}, got {value!r}", param=name)

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", self.n, f"an integer in [1, {MAX_N}]")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            v = getattr(self, name)
            if not _is_real(v):
                raise bad(name, v, "a finite number")
        if self.temperature < 0:
            raise bad("temperature", self.temperature, ">= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "in (0, 1]")
        # above the vocabulary top_k keeps everything; int32 (the wire's type) bounds it, so
        # the sampler's int64 tensors never overflow
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            raise bad("top_k", self.top_k, f"-1, 0 (disabled) or an integer in [1, {INT32_MAX}]")
        if self.top_k == -1:
            self.top_k = 0
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "> 0")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        # sample i of an n > 1 request draws with seed + i: that must fit in int64 too
        if self.seed is not None and (
            not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX - (self.n - 1)
        ):
            raise bad(
                "seed",
                self.seed,
                f"an integer in [{INT64_MIN}, {INT64_MAX - (self.n - 1)}] for n={self.n} "
                "(sample i uses seed + i, a signed 64-bit integer)",
            )
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if (
            not _is_int(self.min_tokens)
            or self.min_tokens < 0
            or (self.max_tokens is not None and self.min_tokens > self.max_tokens)
        ):
            raise bad("min_tokens", self.min_tokens, "an integer in [0, max_tokens]")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (
                not _is_int(v) or v < 0 or (max_logprobs is not None and v > max_logprobs)
            ):
                raise bad(
                    name,
                    v,
                    "an integer >= 0"
                    if max_logprobs is None
                    else f"an integer in [0, {max_logprobs}] (--max-logprobs)",
                )
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", self.structured_outputs, "StructuredOutputsParams")
            self.structured_outputs.kind()
        if (
            not isinstance(self.stop_token_ids, list)
            or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS
        ):
            raise bad(
                "stop_token_ids",
                f"<{len(self.stop_token_ids)} ids>",
                f"a list of at most {MAX_STOP_TOKEN_IDS} token ids",
            )
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", self.ignore_eos, "a boolean")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_TOKEN_ID_SET:
                raise bad(
                    "logit_bias",
                    _summary(self.logit_bias),
                    f"a map of at most {MAX_TOKEN_ID_SET} token ids to numbers",
                )
            for t, v in self.logit_bias.items():
                if not _is_int(t) or t < 0:
                    raise SamplingParamsError(
                        f"logit_bias keys must be non-negative token ids, got {t!r}",
                        param="logit_bias",
                    )
                if not _is_real(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                    raise SamplingParamsError(
                        f"logit_bias values must be finite numbers in [-{MAX_LOGIT_BIAS:g}, "
                        f"{MAX_LOGIT_BIAS:g}], got {v!r} for token {t}",
                        param="logit_bias",
                    )
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not 1 <= len(ids) <= MAX_TOKEN_ID_SET:
                raise bad(
                    "allowed_token_ids",
                    _summary(ids),
                    f"a non-empty list of at most {MAX_TOKEN_ID_SET} token ids",
                )
            for t in ids:
                if not _is_int(t) or t < 0:
                    raise SamplingParamsError(
                        f"allowed_token_ids must hold non-negative token ids, got {t!r}",
                        param="allowed_token_ids",
                    )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def constrained(self) -> bool:
        return self.structured_outputs is not None

    @property
    def biased(self) -> bool:
        """A logit_bias or an allowed_token_ids list applies (the sampler's row rules)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def for_sample(self, index: int) -> SamplingParams:
        """Parameters of sample ``index`` of an ``n > 1`` request (seed + index, as vLLM).
        ``validate()`` guarantees that ``seed + index`` fits in a signed 64-bit integer.

        The samples share this object's lists and maps, and the sampler's tensors of them
        (``sampler_cache``: the same for every sample): nothing changes them once validated.
        A copy and a validation per sample cost ``n`` times the maps' size on the engine
        thread (a whole-vocabulary ``logit_bias`` at ``n=128``: 17 s and 640 MiB)."""
        sample = copy.copy(self)  # no __init__: validated once, as a whole
        sample.n = 1
        sample.seed = None if self.seed is None else self.seed + index
        return sample

    def clone(self) -> SamplingParams:
        """A copy that shares no mutable state with this one (its sampler cache starts empty)."""
        return dataclasses.replace(
            self,
            stop_token_ids=list(self.stop_token_ids),
            logit_bias=None if self.logit_bias is None else dict(self.logit_bias),
            allowed_token_ids=None
            if self.allowed_token_ids is None
            else list(self.allowed_token_ids),
        )
