"""OpenAI request fields -> engine ``SamplingParams`` + router ``OutputParams``, with vLLM's checks.

Every invalid value raises :class:`InvalidRequestError` naming the parameter. Fields the
engine cannot honour (beam search, best_of, bad_words, ...) are refused clearly
instead of being ignored. Sampling defaults missing from the request come from the model's
``generation_config.json`` (vLLM's ``--generation-config auto``), else the engine's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.errors import InvalidRequestError
from router.output import OutputParams
from router.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from shared.proto import pdserve_pb2 as pb

# The two request kinds (what a field only one of them has, e.g. max_tokens, needs).
SamplingRequest = CompletionRequest | ChatCompletionRequest

MAX_N = 128
_INT64 = (-(1 << 63), (1 << 63) - 1)
_INT32_MAX = (1 << 31) - 1
_FLOAT32_MAX = 3.4028234663852886e38
_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may ask for (the router's flags; docs/architecture.md, "Limits")."""

    max_model_len: int
    vocab_size: int
    max_logprobs: int = 20  # --max-logprobs (vLLM's)
    eos_token_ids: frozenset[int] = frozenset()
    generation_defaults: Mapping[str, float] | None = None
    max_n: int = MAX_N  # --max-n
    max_prompts: int = 256  # --max-prompts-per-request
    max_choices: int = 1024  # --max-choices-per-request: prompts x n
    max_stop_strings: int = 64  # --max-stop-strings
    max_stop_chars: int = 8192  # --max-stop-chars: their total length
    max_cache_salt_chars: int = 256  # --max-cache-salt-length
    max_json_depth: int = 64  # --max-json-depth: nesting of tools, tool calls, schemas


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_SCHEMA_CHARS = 256 * 1024


def structured_outputs(req: SamplingFields) -> pb.StructuredOutputs | None:
    """The request's constraint, from ``response_format`` (``json_object``, ``json_schema``),
    vLLM's ``structured_outputs`` extra or its older ``guided_*`` fields; at most one of them."""
    found: list[tuple[str, pb.StructuredOutputs]] = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type", "text")
        if kind == "json_object":
            found.append(("response_format", pb.StructuredOutputs(json_object=True)))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise _bad(
                    "response_format json_schema needs json_schema.schema (an object)",
                    "response_format",
                )
            found.append(("response_format", pb.StructuredOutputs(json=_schema_text(schema))))
        elif kind != "text":
            raise _bad(
                f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                "response_format",
            )
    so = req.structured_outputs
    if so is not None:
        keys = [k for k in _SO_KINDS if so.get(k) not in (None, False)]
        unknown = sorted(set(so) - set(_SO_KINDS) - {"disable_any_whitespace"})
        if unknown or len(keys) != 1:
            raise _bad(
                f"structured_outputs needs exactly one of {', '.join(_SO_KINDS)}"
                + (f"; unknown: {', '.join(unknown)}" if unknown else ""),
                "structured_outputs",
            )
        found.append(("structured_outputs", _so_message(keys[0], so[keys[0]])))
    for name, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        v = getattr(req, name)
        if v is not None:
            found.append((name, _so_message(kind, v)))
    if len(found) > 1:
        raise _bad(
            f"{' and '.join(n for n, _ in found)} both constrain the output: use one",
            found[1][0],
        )
    return found[0][1] if found else None


def _schema_text(schema: object) -> str:
    try:
        text = json.dumps(schema, separators=(",", ":"))
    except RecursionError:
        raise _bad("the schema nests too deeply", "structured_outputs") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise _bad(
            f"the schema has {len(text)} characters; at most {MAX_SCHEMA_CHARS}",
            "structured_outputs",
        )
    return text


def _so_message(kind: str, value: object) -> pb.StructuredOutputs:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise _bad(f"structured_outputs json is not JSON: {e}", "structured_outputs") from e
            except RecursionError:
                raise _bad(
                    "structured_outputs json nests too deeply", "structured_outputs"
                ) from None
        if not isinstance(value, dict):
            raise _bad("structured_outputs json must be a JSON schema object", "structured_outputs")
        return pb.StructuredOutputs(json=_schema_text(value))
    if kind == "json_object":
        return pb.StructuredOutputs(json_object=True)
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise _bad("choice must be a non-empty list of non-empty strings", "structured_outputs")
        return pb.StructuredOutputs(choice=pb.ChoiceList(items=value))
    if not isinstance(value, str) or not value:
        raise _bad(f"structured_outputs {kind} must be a non-empty string", "structured_outputs")
    if len(value) > MAX_SCHEMA_CHARS:
        raise _bad(f"structured_outputs {kind} is too long", "structured_outputs")
    if kind == "regex":
        return pb.StructuredOutputs(regex=value)
    return pb.StructuredOutputs(grammar=value)


# OpenAI chat fields that would change the output and are not served: a 400, not an ignore
_CHAT_UNSUPPORTED = {
    "functions": " (the deprecated form of tools: send tools)",
    "function_call": " (the deprecated form of tool_choice: send tool_choice)",
    "audio": " (text only)",
    "prediction": "",
    "web_search_options": "",
}


def check_unsupported(req: SamplingFields) -> None:
    """Refuse request features the engine does not implement."""
    if req.use_beam_search:
        raise _bad("beam search is not supported", "use_beam_search")
    if req.best_of is not None and req.best_of != req.n:
        raise _bad("best_of must equal n (best-of sampling is not supported)", "best_of")
    if req.bad_words:
        raise _bad("bad_words is not supported", "bad_words")
    structured_outputs(req)  # 400 for a malformed response_format / structured_outputs
    if isinstance(req, CompletionRequest) and req.suffix:
        raise _bad("suffix is not supported", "suffix")
    if isinstance(req, ChatCompletionRequest):
        extra = req.model_extra or {}
        for name, why in _CHAT_UNSUPPORTED.items():
            if extra.get(name) is not None:
                raise _bad(f"{name} is not supported{why}", name)
        modalities = extra.get("modalities")
        if modalities is not None and modalities != ["text"]:
            raise _bad("only the text modality is supported", "modalities")


def requested_max_tokens(req: SamplingRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        return (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
    return req.max_tokens


def max_tokens_name(req: SamplingRequest) -> str:
    """The name of the budget field the client sent (what an error about it names)."""
    return (
        "max_completion_tokens"
        if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None
        else "max_tokens"
    )


def check_max_tokens(req: SamplingRequest, max_tokens: int) -> None:
    """A budget under 1 (0 only for a completion's echo of the prompt alone, vLLM's)."""
    if max_tokens < 1 and not (max_tokens == 0 and echo_only(req)):
        name = max_tokens_name(req)
        raise _bad(f"{name} must be at least 1, got {max_tokens}", name)


def resolve_max_tokens(req: SamplingRequest, prompt_len: int, limits: Limits) -> int:
    """The completion budget; 400 when prompt + budget exceed the context window."""
    name = max_tokens_name(req)
    if prompt_len >= limits.max_model_len:
        raise _bad(
            f"This model's maximum context length is {limits.max_model_len} tokens. "
            f"However, your prompt has {prompt_len} tokens, leaving no room for output. "
            f"Please reduce the length of the prompt.",
            "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
        )
    max_tokens = requested_max_tokens(req)
    if max_tokens is None:
        return limits.max_model_len - prompt_len
    check_max_tokens(req, max_tokens)
    if max_tokens == 0:  # echo_only (check_max_tokens)
        return 1  # vLLM's: one token is generated and dropped, the prompt is the answer
    if prompt_len + max_tokens > limits.max_model_len:
        raise _bad(
            f"This model's maximum context length is {limits.max_model_len} tokens. "
            f"However, you requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
            f"prompt, {max_tokens} in the completion). Please reduce the length of the "
            f"prompt or of {name}.",
            name,
        )
    return max_tokens


def validate_common(req: SamplingRequest, limits: Limits) -> None:
    """Range checks that do not depend on the prompt: every value that reaches a worker fits
    its protobuf field, is finite, and is in the engine's range (the workers check again)."""
    if not 1 <= req.n <= limits.max_n:
        raise _bad(f"n must be between 1 and {limits.max_n}, got {req.n}", "n")
    for name in _FLOATS:
        v = getattr(req, name)
        if v is not None and not (math.isfinite(v) and abs(v) <= _FLOAT32_MAX):
            raise _bad(f"{name} must be a finite number, got {v}", name)
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v is not None and not -2.0 <= v <= 2.0:
            raise _bad(f"{name} must be in [-2, 2], got {v}", name)
    if req.repetition_penalty is not None and req.repetition_penalty <= 0:
        raise _bad(
            f"repetition_penalty must be greater than zero, got {req.repetition_penalty}",
            "repetition_penalty",
        )
    if req.temperature is not None and req.temperature < 0:
        raise _bad(f"temperature must be non-negative, got {req.temperature}", "temperature")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise _bad(f"top_p must be in (0, 1], got {req.top_p}", "top_p")
    if req.top_k is not None and not -1 <= req.top_k <= _INT32_MAX:
        raise _bad(
            f"top_k must be -1 or 0 (disabled) or in [1, {_INT32_MAX}], got {req.top_k}", "top_k"
        )
    if req.min_p is not None and not 0.0 <= req.min_p <= 1.0:
        raise _bad(f"min_p must be in [0, 1], got {req.min_p}", "min_p")
    if req.seed is not None and not _INT64[0] <= req.seed <= _INT64[1] - (req.n - 1):
        # sample i of an n > 1 request draws with seed + i, which must fit in int64 too
        raise _bad(
            f"seed must be a signed 64-bit integer such that seed + n - 1 fits "
            f"(at most {_INT64[1] - (req.n - 1)} for n={req.n}), got {req.seed}",
            "seed",
        )
    if not 0 <= req.min_tokens <= limits.max_model_len:
        raise _bad(
            f"min_tokens must be in [0, {limits.max_model_len}], got {req.min_tokens}", "min_tokens"
        )
    mt = requested_max_tokens(req)
    if mt is not None:
        # before min_tokens' bound: a negative budget was refused as min_tokens exceeding it
        check_max_tokens(req, mt)
    if mt is not None and req.min_tokens > mt:
        raise _bad(
            f"min_tokens ({req.min_tokens}) must not exceed {max_tokens_name(req)} ({mt})",
            "min_tokens",
        )
    stops = stop_strings(req)
    if len(stops) > limits.max_stop_strings:
        raise _bad(
            f"at most {limits.max_stop_strings} stop strings are allowed, got {len(stops)}", "stop"
        )
    if sum(map(len, stops)) > limits.max_stop_chars:
        raise _bad(
            f"the stop strings hold {sum(map(len, stops))} characters; at most "
            f"{limits.max_stop_chars} are allowed",
            "stop",
        )
    for s in stops:
        if not s:
            raise _bad("stop strings must be non-empty", "stop")
    stop_ids = req.stop_token_ids or ()
    if len(stop_ids) > limits.max_stop_strings:
        raise _bad(
            f"at most {limits.max_stop_strings} stop_token_ids are allowed, got {len(stop_ids)}",
            "stop_token_ids",
        )
    for t in stop_ids:
        if not 0 <= t < limits.vocab_size:
            raise _bad(
                f"stop_token_ids contains {t}, outside the vocabulary [0, {limits.vocab_size})",
                "stop_token_ids",
            )
    if req.cache_salt is not None:
        if not req.cache_salt:
            raise _bad("cache_salt must be a non-empty string when given", "cache_salt")
        if len(req.cache_salt) > limits.max_cache_salt_chars:
            raise _bad(
                f"cache_salt has {len(req.cache_salt)} characters; at most "
                f"{limits.max_cache_salt_chars} are allowed",
                "cache_salt",
            )
    if req.truncate_prompt_tokens is not None and not (
        req.truncate_prompt_tokens == -1 or req.truncate_prompt_tokens >= 1
    ):
        raise _bad("truncate_prompt_tokens must be -1 or at least 1", "truncate_prompt_tokens")
    _check_token_sets(req, limits)
    if req.stream_options is not None and not req.stream:
        raise _bad("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(req, ChatCompletionRequest):
        check_json_depth(req.tools, limits.max_json_depth, "tools")
        check_json_depth(req.tool_choice, limits.max_json_depth, "tool_choice")
        check_json_depth(req.documents, limits.max_json_depth, "documents")
        check_json_depth(req.chat_template_kwargs, limits.max_json_depth, "chat_template_kwargs")
    check_json_depth(req.response_format, limits.max_json_depth, "response_format")
    check_json_depth(req.model_extra, limits.max_json_depth, "body")
    so = req.structured_outputs
    for name, schema in (
        ("guided_json", req.guided_json),
        ("structured_outputs", so.get("json") if isinstance(so, dict) else None),
    ):
        if isinstance(schema, str):  # a schema given as a string nests as deeply once parsed
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError):
                raise _bad(f"{name} is not a JSON schema", name) from None
        check_json_depth(schema, limits.max_json_depth, name)


MAX_LOGIT_BIAS = 1024  # entries (OpenAI allows 300; vLLM has no cap)


def _check_token_sets(req: SamplingFields, limits: Limits) -> None:
    """``logit_bias`` (token id strings -> [-100, 100]) and ``allowed_token_ids``."""
    if req.logit_bias is not None:
        if len(req.logit_bias) > MAX_LOGIT_BIAS:
            raise _bad(f"logit_bias has more than {MAX_LOGIT_BIAS} entries", "logit_bias")
        for k, v in req.logit_bias.items():
            try:
                tid = int(k)
            except ValueError:
                raise _bad(f"logit_bias key {k!r} is not a token id", "logit_bias") from None
            if not 0 <= tid < limits.vocab_size:
                raise _bad(
                    f"logit_bias token id {tid} is outside the vocabulary [0, {limits.vocab_size})",
                    "logit_bias",
                )
            if not (math.isfinite(v) and -100.0 <= v <= 100.0):
                raise _bad(f"logit_bias values must be in [-100, 100], got {v}", "logit_bias")
    if req.allowed_token_ids is not None:
        if not req.allowed_token_ids:
            raise _bad("allowed_token_ids must not be empty", "allowed_token_ids")
        if len(req.allowed_token_ids) > limits.vocab_size:
            raise _bad("allowed_token_ids is longer than the vocabulary", "allowed_token_ids")
        for t in req.allowed_token_ids:
            if not 0 <= t < limits.vocab_size:
                raise _bad(
                    f"allowed_token_ids contains {t}, outside the vocabulary "
                    f"[0, {limits.vocab_size})",
                    "allowed_token_ids",
                )


def check_json_depth(value: object, max_depth: int, param: str) -> None:
    """400 when ``value`` (parsed JSON) nests lists / dicts deeper than ``max_depth``. Iterative,
    so no depth a client sends can exhaust the stack here (or in the chat template later)."""
    if not isinstance(value, (list, dict)):
        return
    stack: list[tuple[list[Any] | dict[Any, Any], int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > max_depth:
            raise _bad(f"{param} nests more than {max_depth} levels deep (--max-json-depth)", param)
        children = v.values() if isinstance(v, dict) else v
        for c in children:
            if isinstance(c, (list, dict)):
                stack.append((c, depth + 1))


def check_prompt_count(num_prompts: int, n: int, limits: Limits) -> None:
    """Caps on prompts per request and on choices (prompts x n)."""
    if num_prompts > limits.max_prompts:
        raise _bad(
            f"at most {limits.max_prompts} prompts per request are allowed, got "
            f"{num_prompts} (--max-prompts-per-request)",
            "prompt",
        )
    if num_prompts * n > limits.max_choices:
        raise _bad(
            f"{num_prompts} prompts x n={n} = {num_prompts * n} choices; at most "
            f"{limits.max_choices} are allowed (--max-choices-per-request)",
            "n",
        )


def stop_strings(req: SamplingFields) -> tuple[str, ...]:
    if req.stop is None:
        return ()
    return (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)


def requested_logprobs(req: SamplingRequest, limits: Limits) -> int | None:
    """Top-N logprobs per output token, or None."""
    if isinstance(req, ChatCompletionRequest):
        top = req.top_logprobs
        if top is not None and not 0 <= top <= limits.max_logprobs:
            raise _bad(
                f"top_logprobs must be between 0 and {limits.max_logprobs}, got {top}",
                "top_logprobs",
            )
        if top and not req.logprobs:
            raise _bad("top_logprobs requires logprobs to be true", "top_logprobs")
        return (top or 0) if req.logprobs else None
    lp = req.logprobs
    if lp is not None and not 0 <= lp <= limits.max_logprobs:
        raise _bad(f"logprobs must be between 0 and {limits.max_logprobs}, got {lp}", "logprobs")
    return lp


def echo_only(req: SamplingRequest) -> bool:
    """A completion with ``echo`` and ``max_tokens`` 0: the prompt alone (vLLM's)."""
    return isinstance(req, CompletionRequest) and req.echo and req.max_tokens == 0


def requested_prompt_logprobs(req: SamplingRequest, limits: Limits) -> int | None:
    """vLLM's ``prompt_logprobs``; with ``echo`` and none given, the output's top-N (the
    echoed prompt's tokens then carry logprobs too)."""
    plp = req.prompt_logprobs
    if plp is not None:
        if not 0 <= plp <= limits.max_logprobs:
            raise _bad(
                f"prompt_logprobs must be between 0 and {limits.max_logprobs}, got {plp}",
                "prompt_logprobs",
            )
        if req.stream:
            raise _bad("prompt_logprobs are not available when stream=True", "prompt_logprobs")
        return plp
    if not req.echo:
        return None
    if isinstance(req, ChatCompletionRequest):
        return req.top_logprobs if req.logprobs else None
    return req.logprobs


def build_params(
    req: SamplingRequest, max_tokens: int, limits: Limits
) -> tuple[pb.SamplingParams, OutputParams]:
    """The engine's sampling parameters and the router's output parameters."""
    if req.min_tokens > max_tokens:
        raise _bad(
            f"min_tokens ({req.min_tokens}) must not exceed the completion budget "
            f"({max_tokens} tokens)",
            "min_tokens",
        )
    sp = pb.SamplingParams(
        n=req.n,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        stop_token_ids=list(req.stop_token_ids or ()),
    )
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
    prompt_logprobs = requested_prompt_logprobs(req, limits)
    if prompt_logprobs is not None:
        sp.prompt_logprobs = prompt_logprobs
    so = structured_outputs(req)
    if so is not None:
        sp.structured_outputs.CopyFrom(so)
    for k, v in (req.logit_bias or {}).items():
        sp.logit_bias[int(k)] = v
    if req.allowed_token_ids:
        sp.allowed_token_ids.extend(req.allowed_token_ids)
    stop_ids = frozenset(req.stop_token_ids or ())
    terminal = stop_ids if req.ignore_eos else stop_ids | limits.eos_token_ids
    out = OutputParams(
        n=req.n,
        stop=stop_strings(req),
        stop_token_ids=stop_ids,
        terminal_ids=terminal,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        return_tokens_as_token_ids=req.return_tokens_as_token_ids,
        prompt_logprobs=prompt_logprobs,
        echo=isinstance(req, CompletionRequest) and req.echo,
        echo_only=echo_only(req),
        return_token_ids=bool(req.return_token_ids),
    )
    return sp, out
