"""Conversions between the gRPC messages (shared/proto) and engine types."""

from __future__ import annotations

from shared.proto import pdserve_pb2 as pb
from shared.request import Logprob
from shared.sampling_params import SamplingParams
from shared.scheduler import SampledToken


def sampling_from_proto(m: pb.SamplingParams) -> SamplingParams:
    """Raises ``SamplingParamsError`` for out-of-range values."""
    kw: dict = {"n": m.n or 1, "min_tokens": m.min_tokens, "ignore_eos": m.ignore_eos,
                "stop_token_ids": list(m.stop_token_ids)}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "seed", "max_tokens", "logprobs"):
        if m.HasField(name):
            kw[name] = getattr(m, name)
    if "max_tokens" not in kw:
        kw["max_tokens"] = None  # until max_model_len, as in the OpenAI server
    return SamplingParams(**kw)


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    m = pb.SamplingParams(n=p.n, min_tokens=p.min_tokens, ignore_eos=p.ignore_eos,
                          stop_token_ids=p.stop_token_ids, temperature=p.temperature,
                          top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                          repetition_penalty=p.repetition_penalty,
                          presence_penalty=p.presence_penalty,
                          frequency_penalty=p.frequency_penalty)
    if p.seed is not None:
        m.seed = p.seed
    if p.max_tokens is not None:
        m.max_tokens = p.max_tokens
    if p.logprobs is not None:
        m.logprobs = p.logprobs
    return m


def logprob_to_proto(lp: Logprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(logprob=lp.logprob, rank=lp.rank,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprob_from_proto(m: pb.TokenLogprob) -> Logprob:
    return Logprob(m.logprob, m.rank, [(t.token_id, t.logprob) for t in m.top])


def first_token_from_proto(m: pb.FirstToken) -> SampledToken:
    return SampledToken(m.token_id, logprob_from_proto(m.logprob) if m.HasField("logprob") else None)
