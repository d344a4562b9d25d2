"""OpenAI's ``logit_bias`` and vLLM's ``allowed_token_ids``, from the gRPC message to the sampler.

A +100 bias forces its token and a -100 bias removes the greedy one; an allow-list bounds every
token, greedy and seeded; both survive the wire (pb -> SamplingParams -> pb), clone and
``for_sample``; bad values are refused naming the parameter; speculation (n-gram and a draft
model) changes no biased greedy token; a prefill worker's first token and the decode worker's
continuation (and a failover resume) honour them; a grammar's mask and the allow-list both
apply. Logprobs stay the model's raw ones (see shared/engine/sampler.py).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from shared.config import EngineArgs
from shared.engine import LLM, EngineCore, InvalidRequestError
from shared.engine.connector import RemoteDecodeParams, RemotePrefillParams, connector_for_role
from shared.engine.sampler import Sampler
from shared.engine.sampling_params import (
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)
from shared.engine.scheduler_output import SampledToken, SampleSpec, SpecSample, position_spec
from shared.proto import pdserve_pb2 as pb
from shared.worker.wire import sampling_from_proto, sampling_to_proto
from tests.engine.fakes import fake_engine

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}


def _prompts(seed: int, n: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        base = [rng.randrange(3, 2048) for _ in range(rng.randint(5, 60))]
        out.append(base * (1 + i % 3))  # repeated text: n-gram drafts find matches
    return out


def _run(model: Path, prompts, params, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model), device="cpu", kv_cache_memory="64MiB", **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs], llm


def _wire(p: SamplingParams) -> SamplingParams:
    """What a worker gets from the router: through the gRPC message."""
    return sampling_from_proto(
        pb.SamplingParams.FromString(sampling_to_proto(p).SerializeToString())
    )


# ---- the sampler alone --------------------------------------------------------------------------


def _row(params: SamplingParams, pos: int = 0, eos: tuple[int, ...] = (2,)) -> SampleSpec:
    return SampleSpec("r", params, pos, eos)


@pytest.mark.unit
def test_the_sampler_applies_bias_and_allow_list_and_reports_raw_logprobs():
    v = 16
    sampler = Sampler(v, torch.device("cpu"), seed=0)
    logits = torch.randn(2, v, generator=torch.Generator().manual_seed(0))
    raw = torch.log_softmax(logits[0], -1)
    top = int(logits[0].argmax())
    low = int(logits[0].argmin())
    # greedy + bias: the biased token wins; a plain greedy row beside it keeps its argmax
    biased = SamplingParams(temperature=0, logit_bias={low: 100.0}, logprobs=1)
    plain = SamplingParams(temperature=0)
    out = sampler(logits, [_row(biased), _row(plain)])
    assert [o.token_id for o in out] == [low, int(logits[1].argmax())]
    # logprobs are the model's raw ones: the biased token's raw logprob and rank, the raw top
    lp = out[0].logprob
    assert lp is not None and math.isclose(lp.logprob, float(raw[low]), rel_tol=1e-5)
    assert lp.rank == v and lp.top[0][0] == top
    # -100 on the argmax: the runner-up
    second = int(logits[0].topk(2).indices[1])
    out = sampler(logits[:1], [_row(SamplingParams(temperature=0, logit_bias={top: -100.0}))])
    assert out[0].token_id == second
    # allow-list: greedy takes the best allowed token; seeded draws stay inside the list
    allowed = [low, 5, 11]
    want = max(allowed, key=lambda t: float(logits[0, t]))
    out = sampler(logits[:1], [_row(SamplingParams(temperature=0, allowed_token_ids=allowed))])
    assert out[0].token_id == want
    for seed in range(50):
        p = SamplingParams(temperature=2.0, seed=seed, allowed_token_ids=allowed)
        assert sampler(logits[:1], [_row(p, pos=seed)])[0].token_id in allowed
    # the distribution speculation uses (the draft model's q, rejection sampling) agrees
    p = SamplingParams(temperature=1.0, allowed_token_ids=allowed, logit_bias={5: 3.0})
    probs = sampler.processed_probs(logits[:1], [_row(p)])[0]
    assert set(torch.nonzero(probs).flatten().tolist()) == set(allowed)
    ref = torch.softmax(logits[0, allowed] + torch.tensor([0.0, 3.0, 0.0]), -1)
    assert torch.allclose(probs[allowed] / probs.sum(), ref, atol=1e-6)


@pytest.mark.unit
def test_an_allow_list_of_ends_only_wins_over_min_tokens():
    """min_tokens bans the ends, the allow-list holds nothing else: the allowed end is drawn
    (not an all -inf row and a NaN draw); with another allowed token, the ban holds."""
    v = 16
    sampler = Sampler(v, torch.device("cpu"), seed=0)
    logits = torch.randn(1, v, generator=torch.Generator().manual_seed(1))
    for temperature in (0.0, 1.0):
        p = SamplingParams(temperature=temperature, seed=3, min_tokens=4, allowed_token_ids=[2])
        assert sampler(logits, [_row(p, pos=1)])[0].token_id == 2
        p = SamplingParams(temperature=temperature, seed=3, min_tokens=4, allowed_token_ids=[2, 9])
        assert sampler(logits, [_row(p, pos=1)])[0].token_id == 9


@pytest.mark.unit
def test_min_tokens_bans_the_ends_with_ignore_eos_too():
    """vLLM bans EOS and the stop ids below min_tokens whatever ignore_eos says (its
    all_stop_token_ids always holds the EOS); pdserve let EOS through with ignore_eos. The
    allow-list of ends only still wins over the ban."""
    v = 16
    sampler = Sampler(v, torch.device("cpu"), seed=0)
    logits = torch.zeros(1, v)
    logits[0, 2], logits[0, 5], logits[0, 9] = 9.0, 8.0, 1.0  # EOS (2) first, stop id 5 second
    for ignore_eos in (False, True):
        for temperature in (0.0, 0.5):
            p = SamplingParams(
                temperature=temperature, seed=3, min_tokens=3, ignore_eos=ignore_eos,
                stop_token_ids=[5],
            )  # fmt: skip
            for pos in range(3):
                draws = [sampler(logits, [_row(p, pos=pos)])[0].token_id for _ in range(20)]
                assert 2 not in draws and 5 not in draws, (ignore_eos, temperature, pos)
            if temperature == 0.0:
                assert sampler(logits, [_row(p, pos=3)])[0].token_id == 2  # min_tokens reached
        p = SamplingParams(
            temperature=0, min_tokens=3, ignore_eos=ignore_eos, allowed_token_ids=[2]
        )
        assert sampler(logits, [_row(p, pos=0)])[0].token_id == 2


@pytest.mark.unit
def test_verification_sees_the_biased_logits():
    """n-gram (one-hot q) and draft-model (rejection) verification of a biased row: the drafts
    the bias forces are accepted, the ones it forbids are replaced by the biased draw."""
    v = 16
    sampler = Sampler(v, torch.device("cpu"), seed=0)
    logits = torch.randn(4, v, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=0, logit_bias={7: 100.0})
    spec = _row(p, pos=5)
    rows = [position_spec(spec, [7, 7, 7], j) for j in range(4)]
    out = sampler.verify(logits, rows, [7, 7, 7])
    assert isinstance(out, SpecSample) and [t.token_id for t in out.tokens] == [7] * 4
    out = sampler.verify(logits, rows, [3, 7, 7])
    assert isinstance(out, SpecSample) and out.num_accepted == 0
    assert [t.token_id for t in out.tokens] == [7]
    # rejection sampling against a draft distribution that ignores the allow-list
    allowed = [1, 4, 9]
    q = torch.softmax(torch.randn(3, v, generator=torch.Generator().manual_seed(3)), -1)
    for seed in range(40):
        p = SamplingParams(temperature=1.0, seed=seed, allowed_token_ids=allowed)
        spec = _row(p, pos=0)
        drafts = [int(q[j].argmax()) for j in range(3)]
        rows = [position_spec(spec, drafts, j) for j in range(4)]
        out = sampler.verify(logits, rows, drafts, q)
        assert isinstance(out, SpecSample)
        assert all(t.token_id in allowed for t in out.tokens), out


# ---- parameters and the wire ---------------------------------------------------------------------


@pytest.mark.unit
def test_the_wire_round_trip_keeps_both_fields():
    m = pb.SamplingParams(
        temperature=0.7,
        max_tokens=9,
        logit_bias={5: 1.5, 1999: -100.0, 0: 100.0},
        allowed_token_ids=[3, 5, 8, 5],
    )
    p = sampling_from_proto(m)
    assert p.logit_bias == {5: 1.5, 1999: -100.0, 0: 100.0}
    assert p.allowed_token_ids == [3, 5, 8, 5]
    back = sampling_to_proto(p)
    assert dict(back.logit_bias) == dict(m.logit_bias)
    assert list(back.allowed_token_ids) == list(m.allowed_token_ids)
    assert sampling_from_proto(back) == p
    # empty = none, both ways
    none = sampling_from_proto(pb.SamplingParams())
    assert none.logit_bias is None and none.allowed_token_ids is None
    m = sampling_to_proto(SamplingParams())
    assert not m.logit_bias and not m.allowed_token_ids


@pytest.mark.unit
def test_clone_shares_no_state():
    p = SamplingParams(n=2, seed=1, logit_bias={4: 2.0}, allowed_token_ids=[4, 6])
    p.sampler_cache["x"] = object()
    q = p.clone()
    assert q.logit_bias == p.logit_bias and q.allowed_token_ids == p.allowed_token_ids
    assert q.logit_bias is not p.logit_bias
    assert q.allowed_token_ids is not p.allowed_token_ids
    assert q.sampler_cache == {}
    q.logit_bias[9] = 1.0  # type: ignore[index]
    q.allowed_token_ids.append(9)  # type: ignore[union-attr]
    assert p.logit_bias == {4: 2.0} and p.allowed_token_ids == [4, 6]
    assert p == p.clone()  # the cache is not compared


@pytest.mark.unit
def test_the_samples_of_one_request_share_its_maps_validated_once(tmp_path, monkeypatch):
    """Each sample of an ``n > 1`` request copied and validated (twice) the whole
    ``logit_bias`` / ``allowed_token_ids`` on the engine thread: a whole-vocabulary bias at
    ``n=128`` stalled every other request for 17 s (review). They now share one validated
    copy, and the sampler's tensors of it."""
    calls = []
    validate = SamplingParams.validate

    def counted(self, *a, **k):
        calls.append(self)
        return validate(self, *a, **k)

    bias = {t: 0.5 for t in range(0, 97, 2)}
    p = SamplingParams(n=64, seed=1, temperature=1.0, logit_bias=bias, allowed_token_ids=[4, 6])
    monkeypatch.setattr(SamplingParams, "validate", counted)
    e = fake_engine(tmp_path)
    e.add_request("r", [5, 6, 7], p)
    assert len(calls) <= 2  # the engine checks the request as a whole, not per sample
    seqs = e.parents["r"]
    assert len(seqs) == 64 and [s.sampling_params.seed for s in seqs] == list(range(1, 65))
    assert all(s.sampling_params.n == 1 for s in seqs)
    assert all(s.sampling_params.logit_bias is seqs[0].sampling_params.logit_bias for s in seqs)
    cache = seqs[0].sampling_params.sampler_cache
    assert all(s.sampling_params.sampler_cache is cache for s in seqs)


@pytest.mark.unit
@pytest.mark.parametrize(
    "kw, param, text",
    [
        ({"logit_bias": {5: 100.5}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {5: -101}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias", "nan"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias", "finite"),
        ({"logit_bias": {5: True}}, "logit_bias", "finite numbers"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias", "non-negative"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias", "non-negative"),
        ({"logit_bias": [(5, 1.0)]}, "logit_bias", "a map"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
        ({"allowed_token_ids": [3, -2]}, "allowed_token_ids", "-2"),
        ({"allowed_token_ids": [3, 4.0]}, "allowed_token_ids", "4.0"),
        ({"allowed_token_ids": (3, 4)}, "allowed_token_ids", "list"),
    ],
)
def test_bad_values_are_refused_naming_the_param(kw, param, text):
    with pytest.raises(SamplingParamsError, match="^" + param) as e:
        SamplingParams(**kw)
    assert e.value.param == param and text in str(e.value)


@pytest.mark.unit
def test_the_wire_and_the_engine_refuse_bad_ids_and_values(tmp_path):
    from tests.engine.fakes import fake_engine

    with pytest.raises(SamplingParamsError) as e:  # a NaN through gRPC
        sampling_from_proto(pb.SamplingParams(logit_bias={3: float("nan")}))
    assert e.value.param == "logit_bias"
    e = fake_engine(tmp_path, vocab=97)
    for name, value in (("logit_bias", {3: 1.0, 97: 1.0}), ("allowed_token_ids", [3, 97])):
        with pytest.raises(InvalidRequestError, match=r"\[0, 97\), got 97") as err:
            e.add_request("a", [5, 6, 7], SamplingParams(**{name: value}))
        assert err.value.param == name
    e.add_request("ok", [5, 6, 7], SamplingParams(logit_bias={96: 1.0}, allowed_token_ids=[96]))
    # the engine validates its own copy too (a caller's object changed after construction)
    p = SamplingParams(temperature=0)
    p.logit_bias = {3: 1000.0}
    with pytest.raises(InvalidRequestError, match="logit_bias") as err:
        e.add_request("b", [5, 6, 7], p)
    assert err.value.param == "logit_bias"


# ---- the whole engine ----------------------------------------------------------------------------


@pytest.mark.integration
def test_a_large_bias_forces_a_token_and_a_negative_one_removes_it(tiny_llama):
    prompts = _prompts(1)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref, _ = _run(tiny_llama, prompts, sp)
    t = 777
    assert all(t not in r for r in ref), "pick a token the model does not choose"
    forced, _ = _run(
        tiny_llama,
        prompts,
        _wire(SamplingParams(temperature=0, max_tokens=12, logit_bias={t: 100})),
    )
    assert forced == [[t] * 12 for _ in prompts]  # until max_tokens (EOS is out-biased too)
    # -100 on each prompt's first greedy token: that position changes, the rest follows
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={r[0]: -100.0})
        for r in ref
    ]
    removed, _ = _run(tiny_llama, prompts, params)
    for r, got in zip(ref, removed):
        assert got[0] != r[0] and r[0] not in got and len(got) == 12


@pytest.mark.integration
def test_every_token_is_in_the_allow_list_greedy_and_seeded(tiny_llama):
    prompts = _prompts(2)
    rng = random.Random(5)
    allowed = sorted(rng.sample(range(3, 2048), 5))
    greedy, _ = _run(
        tiny_llama,
        prompts,
        _wire(SamplingParams(temperature=0, max_tokens=16, allowed_token_ids=allowed)),
    )
    sampled = SamplingParams(
        n=2, temperature=1.0, top_p=0.9, seed=11, max_tokens=16, allowed_token_ids=allowed
    )
    llm = LLM(str(tiny_llama), device="cpu", kv_cache_memory="64MiB")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _wire(sampled))
    draws = [c.token_ids for o in outs for c in o.outputs]
    for toks in greedy + draws:
        assert len(toks) == 16 and set(toks) <= set(allowed), toks
    assert len({t for toks in draws for t in toks}) > 1, "seeded draws use the whole list"
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], sampled)
    assert [c.token_ids for o in again for c in o.outputs] == draws  # seeded: reproducible


@pytest.fixture(scope="module")
def draft_dir(tiny_llama, tmp_path_factory) -> Path:
    from shared.cli.tiny_model import truncate_layers

    return truncate_layers(tiny_llama, tmp_path_factory.mktemp("draft") / "d1", 1)


@pytest.mark.integration
def test_ngram_speculation_keeps_the_biased_greedy_tokens(tiny_llama):
    prompts = _prompts(3, n=6)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref, _ = _run(tiny_llama, prompts, sp)
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=30,
            ignore_eos=True,
            logit_bias={r[3]: -100.0, r[12]: 3.0, 5: 2.0},
        )
        for r in ref
    ]
    want, _ = _run(tiny_llama, prompts, params)
    got, llm = _run(tiny_llama, prompts, params, speculative_config=NGRAM)
    assert got == want and want != ref
    st = llm.engine.stats()
    assert st.spec_num_drafts > 0 and st.spec_num_accepted_tokens > 0
    # an allow-list too: the drafts outside it are rejected, the output is unchanged
    allowed = sorted({t for r in ref for t in r[:6]})
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, allowed_token_ids=allowed)
    ] * len(prompts)
    want, _ = _run(tiny_llama, prompts, params)
    got, _ = _run(tiny_llama, prompts, params, speculative_config=NGRAM)
    assert got == want and all(set(g) <= set(allowed) for g in got)


@pytest.mark.integration
def test_the_draft_model_proposes_from_the_biased_logits(tiny_llama, draft_dir):
    """Greedy: the draft takes the argmax after the bias, so a forced token is accepted at
    every draft (the raw draft argmax would be rejected); sampled: the allow-list holds."""
    prompts = _prompts(4, n=3)
    cfg = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logit_bias={777: 100.0})
    got, llm = _run(tiny_llama, prompts, sp, speculative_config=cfg)
    assert got == [[777] * 20] * len(prompts)
    st = llm.engine.stats()
    assert st.spec_num_draft_tokens > 0
    assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens
    allowed = [10, 20, 30, 40]
    sampled = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=20, allowed_token_ids=allowed)
        for i in range(len(prompts))
    ]
    got, llm = _run(tiny_llama, prompts, sampled, speculative_config=cfg)
    assert all(set(g) <= set(allowed) and len(g) == 20 for g in got)
    assert llm.engine.stats().spec_num_drafts > 0


def _engine(model: Path, role: str) -> EngineCore:
    args = EngineArgs(model=str(model), device="cpu", kv_cache_memory="64MiB")
    return EngineCore(args, connector=connector_for_role(role))


def _drain(engine: EngineCore, outs=()) -> list[int]:
    toks = [t for o in outs for t in o.new_token_ids]
    while engine.has_unfinished_requests():
        for o in engine.step():
            toks.extend(o.new_token_ids)
    return toks


@pytest.mark.integration
def test_a_prefill_worker_and_a_decode_worker_both_honour_the_bias(tiny_llama):
    """P draws the first token, D continues after the KV handoff (both from the gRPC message,
    as the services build them): the same tokens as one local engine, inside the allow-list
    from the first token on; and a failover resume on a third engine goes on the same way."""
    prompt = _prompts(5, n=1)[0]
    plain = _engine(tiny_llama, "none")
    plain.add_request("u", prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    unbiased = _drain(plain)
    rng = random.Random(6)
    allowed = sorted(set(rng.sample(range(3, 2048), 6)) - {unbiased[0]})
    for sp in (
        SamplingParams(
            temperature=0,
            max_tokens=10,
            ignore_eos=True,
            allowed_token_ids=allowed,
            logit_bias={allowed[-1]: 1.5},
        ),
        SamplingParams(temperature=1.0, seed=9, max_tokens=10, allowed_token_ids=allowed),
    ):
        m = sampling_to_proto(sp)  # the router's message, sent to D and passed on to P
        local = _engine(tiny_llama, "none")
        local.add_request("r", prompt, sampling_from_proto(m))
        want = _drain(local)
        assert len(want) == 10 and set(want) <= set(allowed)
        d = _engine(tiny_llama, "decode")
        d.add_request("r", prompt, sampling_from_proto(m), kv_transfer=RemotePrefillParams())
        d.step()
        (job,) = d.take_remote_prefills()
        p = _engine(tiny_llama, "prefill")
        pp = sampling_from_proto(m)
        pp.max_tokens, pp.min_tokens = 1, 0  # as the prefill service does
        p.add_request("r", prompt, pp, kv_transfer=RemoteDecodeParams(job.first_block_index))
        ready: dict[int, int] = {}
        first: list[int] = []
        pin = None
        while p.has_unfinished_requests():
            for o in p.step():
                ready.update(o.kv_blocks_ready)
                pin = o.kv_pin_id if o.kv_pin_id is not None else pin
                first.extend(o.new_token_ids)
        assert first == want[:1], "the prefill worker's first token honours the bias"
        src = [ready[job.first_block_index + j] for j in range(len(job.block_ids))]
        d_kv, p_kv = d.runner.kv_cache.view(torch.uint8), p.runner.kv_cache.view(torch.uint8)
        d_kv[list(job.block_ids)] = p_kv[src]
        p.unpin(pin)
        outs = d.finish_remote_prefill("r", [SampledToken(first[0])])
        d.unpin(job.pin_id)
        assert _drain(d, outs) == want
        d.check_integrity()
        # failover: another decode worker resumes after 4 tokens, from the same message
        e = _engine(tiny_llama, "decode")
        e.add_request("r", prompt, sampling_from_proto(m), resume=[want[:4]])
        assert want[:4] + _drain(e) == want


@pytest.mark.integration
def test_a_grammar_and_an_allow_list_both_apply(tiny_llama):
    """choice ("yes", "no"): the allow-list picks the choice; a bias on the other choice's
    tokens does not break the grammar; the grammar still ends the output."""
    llm = LLM(str(tiny_llama), device="cpu", kv_cache_memory="64MiB")
    prompts = _prompts(7, n=4)
    so = StructuredOutputsParams(choice=("yes", "no"))
    eos = llm.engine.model_config.eos_token_ids
    ids = {w: llm.tokenizer.encode(w, add_special_tokens=False).ids for w in ("yes", "no")}

    def texts(params: SamplingParams) -> list[tuple[str, str | None]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [
            (llm.tokenizer.decode(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs
        ]

    for word, other in (("yes", "no"), ("no", "yes")):
        for allowed in (ids[word] + list(eos), ids[word]):  # EOS allowed or not: the grammar ends
            for temperature in (0.0, 1.0):
                sp = SamplingParams(
                    temperature=temperature,
                    seed=3,
                    max_tokens=10,
                    structured_outputs=so,
                    allowed_token_ids=allowed,
                    logit_bias={ids[other][0]: 100.0},  # the grammar masks it: no effect
                )
                assert texts(sp) == [(word, "stop")] * len(prompts)
    # a bias alone steers the choice inside the grammar
    sp = SamplingParams(temperature=0, max_tokens=10, structured_outputs=so)
    for word in ("yes", "no"):
        sp.logit_bias = {ids[word][0]: 100.0}
        assert texts(sp) == [(word, "stop")] * len(prompts)
