"""OpenAI request fields -> engine ``SamplingParams`` + router ``OutputParams``, with vLLM's checks.

Every invalid value raises :class:`InvalidRequestError` naming the parameter. Fields the
engine cannot honour (beam search, logit bias, guided decoding, ...) are refused clearly
instead of being ignored. Sampling defaults missing from the request come from the model's
``generation_config.json`` (vLLM's ``--generation-config auto``), else the engine's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from router.errors import InvalidRequestError
from router.output import OutputParams
from router.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from shared.proto import pdserve_pb2 as pb

MAX_N = 128
_INT64 = (-(1 << 63), (1 << 63) - 1)
_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True, slots=True)
class Limits:
    max_model_len: int
    vocab_size: int
    max_logprobs: int = 20
    eos_token_ids: frozenset[int] = frozenset()
    generation_defaults: Mapping[str, float] | None = None


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def check_unsupported(req: SamplingFields) -> None:
    """Refuse request features the engine does not implement."""
    if req.use_beam_search:
        raise _bad("beam search is not supported", "use_beam_search")
    if req.best_of is not None and req.best_of != req.n:
        raise _bad("best_of must equal n (best-of sampling is not supported)", "best_of")
    if req.logit_bias:
        raise _bad("logit_bias is not supported", "logit_bias")
    if req.allowed_token_ids:
        raise _bad("allowed_token_ids is not supported", "allowed_token_ids")
    if req.bad_words:
        raise _bad("bad_words is not supported", "bad_words")
    if req.prompt_logprobs is not None:
        raise _bad("prompt_logprobs is not supported", "prompt_logprobs")
    if any(v is not None for v in (req.guided_json, req.guided_regex, req.guided_choice,
                                    req.guided_grammar)):
        raise _bad("guided decoding is not supported", "guided_json")
    rf = req.response_format
    if rf is not None and rf.get("type", "text") != "text":
        raise _bad(f"response_format {rf.get('type')!r} is not supported (only 'text')",
                   "response_format")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise _bad("echo is not supported", "echo")
        if req.suffix:
            raise _bad("suffix is not supported", "suffix")
    if isinstance(req, ChatCompletionRequest):
        if req.echo:
            raise _bad("echo is not supported", "echo")
        if req.tool_choice not in (None, "none"):
            raise _bad("tool calling is not supported by this server: use tool_choice 'none' "
                       "(tools are still rendered into the prompt)", "tool_choice")


def requested_max_tokens(req: SamplingFields) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return req.max_tokens


def resolve_max_tokens(req: SamplingFields, prompt_len: int, limits: Limits) -> int:
    """The completion budget; 400 when prompt + budget exceed the context window."""
    name = "max_completion_tokens" if isinstance(req, ChatCompletionRequest) and \
        req.max_completion_tokens is not None else "max_tokens"
    if prompt_len >= limits.max_model_len:
        raise _bad(f"This model's maximum context length is {limits.max_model_len} tokens. "
                   f"However, your prompt has {prompt_len} tokens, leaving no room for output. "
                   f"Please reduce the length of the prompt.", "messages" if
                   isinstance(req, ChatCompletionRequest) else "prompt")
    max_tokens = requested_max_tokens(req)
    if max_tokens is None:
        return limits.max_model_len - prompt_len
    if max_tokens < 1:
        raise _bad(f"{name} must be at least 1, got {max_tokens}", name)
    if prompt_len + max_tokens > limits.max_model_len:
        raise _bad(f"This model's maximum context length is {limits.max_model_len} tokens. "
                   f"However, you requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
                   f"prompt, {max_tokens} in the completion). Please reduce the length of the "
                   f"prompt or of {name}.", name)
    return max_tokens


def validate_common(req: SamplingFields, limits: Limits) -> None:
    """Range checks that do not depend on the prompt."""
    if not 1 <= req.n <= MAX_N:
        raise _bad(f"n must be between 1 and {MAX_N}, got {req.n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v is not None and not -2.0 <= v <= 2.0:
            raise _bad(f"{name} must be in [-2, 2], got {v}", name)
    if req.repetition_penalty is not None and req.repetition_penalty <= 0:
        raise _bad(f"repetition_penalty must be greater than zero, got {req.repetition_penalty}",
                   "repetition_penalty")
    if req.temperature is not None and req.temperature < 0:
        raise _bad(f"temperature must be non-negative, got {req.temperature}", "temperature")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise _bad(f"top_p must be in (0, 1], got {req.top_p}", "top_p")
    if req.top_k is not None and req.top_k < -1:
        raise _bad(f"top_k must be -1 or 0 (disabled) or at least 1, got {req.top_k}", "top_k")
    if req.min_p is not None and not 0.0 <= req.min_p <= 1.0:
        raise _bad(f"min_p must be in [0, 1], got {req.min_p}", "min_p")
    if req.seed is not None and not _INT64[0] <= req.seed <= _INT64[1]:
        raise _bad("seed must fit in a signed 64-bit integer", "seed")
    if req.min_tokens < 0:
        raise _bad(f"min_tokens must be non-negative, got {req.min_tokens}", "min_tokens")
    mt = requested_max_tokens(req)
    if mt is not None and req.min_tokens > mt:
        raise _bad(f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({mt})", "min_tokens")
    for s in stop_strings(req):
        if not s:
            raise _bad("stop strings must be non-empty", "stop")
    for t in req.stop_token_ids or ():
        if not 0 <= t < limits.vocab_size:
            raise _bad(f"stop_token_ids contains {t}, outside the vocabulary [0, "
                       f"{limits.vocab_size})", "stop_token_ids")
    if req.stream_options is not None and not req.stream:
        raise _bad("stream_options is only allowed when stream is true", "stream_options")


def stop_strings(req: SamplingFields) -> tuple[str, ...]:
    if req.stop is None:
        return ()
    return (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)


def requested_logprobs(req: SamplingFields, limits: Limits) -> int | None:
    """Top-N logprobs per output token, or None."""
    if isinstance(req, ChatCompletionRequest):
        top = req.top_logprobs
        if top is not None and not 0 <= top <= limits.max_logprobs:
            raise _bad(f"top_logprobs must be between 0 and {limits.max_logprobs}, got {top}",
                       "top_logprobs")
        if top and not req.logprobs:
            raise _bad("top_logprobs requires logprobs to be true", "top_logprobs")
        return (top or 0) if req.logprobs else None
    lp = req.logprobs
    if lp is not None and not 0 <= lp <= limits.max_logprobs:
        raise _bad(f"logprobs must be between 0 and {limits.max_logprobs}, got {lp}", "logprobs")
    return lp


def build_params(req: SamplingFields, max_tokens: int,
                 limits: Limits) -> tuple[pb.SamplingParams, OutputParams]:
    """The engine's sampling parameters and the router's output parameters."""
    sp = pb.SamplingParams(n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens,
                           ignore_eos=req.ignore_eos,
                           stop_token_ids=list(req.stop_token_ids or ()))
    defaults = limits.generation_defaults or {}
    for name in _DEFAULTABLE:
        v = getattr(req, name)
        if v is None:
            v = defaults.get(name)
        if v is not None:
            setattr(sp, name, v)
    for name in ("presence_penalty", "frequency_penalty", "seed"):
        v = getattr(req, name)
        if v is not None:
            setattr(sp, name, v)
    logprobs = requested_logprobs(req, limits)
    if logprobs is not None:
        sp.logprobs = logprobs
    stop_ids = frozenset(req.stop_token_ids or ())
    terminal = stop_ids if req.ignore_eos else stop_ids | limits.eos_token_ids
    out = OutputParams(n=req.n, stop=stop_strings(req), stop_token_ids=stop_ids,
                       terminal_ids=terminal,
                       include_stop_str_in_output=req.include_stop_str_in_output,
                       skip_special_tokens=req.skip_special_tokens, min_tokens=req.min_tokens,
                       logprobs=logprobs,
                       return_tokens_as_token_ids=req.return_tokens_as_token_ids)
    return sp, out
