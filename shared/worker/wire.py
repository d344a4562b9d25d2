"""Conversions between the gRPC messages (shared/proto) and engine types, and the checks every
worker applies to what arrives over gRPC (the workers' API is a boundary like the router's:
anyone on the network path can call it, so nothing here trusts the router's validation).

Failures between processes travel as gRPC status codes plus the ``pdserve-failure`` trailing
metadata of :mod:`shared.proto.failure`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from shared.engine.request import Logprob
from shared.engine.sampling_params import (
    MAX_N,
    MAX_TOKEN_ID_SET,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)
from shared.engine.scheduler import SampledToken
from shared.proto import pdserve_pb2 as pb
from shared.proto.failure import (  # noqa: F401 - re-exported for the two roles
    FAILURE_DRAINING,
    FAILURE_ENGINE,
    FAILURE_KEY,
    FAILURE_REQUEST,
    failure_metadata,
)

MAX_ID_CHARS = 256  # request_id, transfer_id, worker ids
MAX_CACHE_SALT_CHARS = 1024
MAX_ADDRESS_BYTES = 4096  # a UCX worker address is a few hundred bytes


class WireError(ValueError):
    """A gRPC message field is malformed; ``param`` names it (-> INVALID_ARGUMENT)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_text(value: str, name: str, max_chars: int, required: bool = False) -> str:
    if required and not value:
        raise WireError(f"{name} is empty", name)
    if len(value) > max_chars:
        raise WireError(f"{name} has {len(value)} characters; at most {max_chars} allowed", name)
    return value


def check_deadline(value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise WireError(f"deadline_s must be a finite number >= 0, got {value!r}", "deadline_s")
    return value


def sampling_from_proto(m: pb.SamplingParams, max_logprobs: int | None = None) -> SamplingParams:
    """Raises ``SamplingParamsError`` for out-of-range values (NaN / infinite floats included).
    An empty ``logit_bias`` / ``allowed_token_ids`` is none (proto3 cannot tell them apart)."""
    if m.n > MAX_N:  # before anything is built from it
        raise SamplingParamsError(f"n must be an integer in [1, {MAX_N}], got {m.n}", param="n")
    for name in ("logit_bias", "allowed_token_ids"):
        if len(getattr(m, name)) > MAX_TOKEN_ID_SET:
            raise SamplingParamsError(
                f"{name} has {len(getattr(m, name))} entries; at most {MAX_TOKEN_ID_SET} allowed",
                param=name,
            )
    kw: dict = {
        "n": m.n or 1,
        "min_tokens": m.min_tokens,
        "ignore_eos": m.ignore_eos,
        "stop_token_ids": list(m.stop_token_ids),
    }
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "max_tokens",
        "logprobs",
        "prompt_logprobs",
    ):
        if m.HasField(name):
            kw[name] = getattr(m, name)
    if "max_tokens" not in kw:
        kw["max_tokens"] = None  # until max_model_len, as in the OpenAI server
    if m.HasField("structured_outputs"):
        kw["structured_outputs"] = structured_from_proto(m.structured_outputs)
    if m.logit_bias:
        kw["logit_bias"] = dict(m.logit_bias)
    if m.allowed_token_ids:
        kw["allowed_token_ids"] = list(m.allowed_token_ids)
    params = SamplingParams(**kw)
    if max_logprobs is not None:
        params.validate(max_logprobs)
    return params


def resume_from_proto(
    resume: Sequence[pb.ResumeTokens], n: int
) -> tuple[list[list[int]] | None, frozenset[int]]:
    """Per-sample resume tokens (``None`` when there are none; one entry per index < n), and
    the samples that already finished (not to continue)."""
    if not resume:
        return None, frozenset()
    if len(resume) > n:
        raise WireError(f"resume has {len(resume)} entries for n={n}", "resume")
    by_index: dict[int, list[int]] = {}
    for r in resume:
        if r.index >= n:
            raise WireError(f"resume index {r.index} is not below n={n}", "resume")
        if r.index in by_index:
            raise WireError(f"resume index {r.index} appears twice", "resume")
        by_index[r.index] = list(r.token_ids)
    finished = frozenset(r.index for r in resume if r.finished)
    if len(finished) == n:
        raise WireError("resume marks every sample finished: nothing to generate", "resume")
    out = [by_index.get(i, []) for i in range(n)]
    return (out, finished) if any(out) else (None, frozenset())


def structured_from_proto(m: pb.StructuredOutputs) -> StructuredOutputsParams:
    kind = m.WhichOneof("kind")
    if kind is None:
        raise SamplingParamsError(
            "structured_outputs is set but names no kind", param="structured_outputs"
        )
    if kind == "choice":
        return StructuredOutputsParams(choice=tuple(m.choice.items))
    if kind == "json_object":
        return StructuredOutputsParams(json_object=m.json_object)
    return StructuredOutputsParams(**{kind: getattr(m, kind)})


def structured_to_proto(so: StructuredOutputsParams) -> pb.StructuredOutputs:
    if so.choice is not None:
        return pb.StructuredOutputs(choice=pb.ChoiceList(items=list(so.choice)))
    if so.json_object:
        return pb.StructuredOutputs(json_object=True)
    kind, spec = so.kind()
    return pb.StructuredOutputs(**{kind: spec})


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    m = pb.SamplingParams(
        n=p.n,
        min_tokens=p.min_tokens,
        ignore_eos=p.ignore_eos,
        stop_token_ids=p.stop_token_ids,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
    )
    if p.seed is not None:
        m.seed = p.seed
    if p.max_tokens is not None:
        m.max_tokens = p.max_tokens
    if p.logprobs is not None:
        m.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        m.prompt_logprobs = p.prompt_logprobs
    if p.structured_outputs is not None:
        m.structured_outputs.CopyFrom(structured_to_proto(p.structured_outputs))
    if p.logit_bias:
        m.logit_bias.update(p.logit_bias)
    if p.allowed_token_ids:
        m.allowed_token_ids.extend(p.allowed_token_ids)
    return m


def logprob_to_proto(lp: Logprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        logprob=lp.logprob,
        rank=lp.rank,
        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def logprob_from_proto(m: pb.TokenLogprob) -> Logprob:
    return Logprob(m.logprob, m.rank, [(t.token_id, t.logprob) for t in m.top])


def first_token_from_proto(m: pb.FirstToken) -> SampledToken:
    return SampledToken(
        m.token_id, logprob_from_proto(m.logprob) if m.HasField("logprob") else None, m.end
    )
