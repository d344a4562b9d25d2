"""Speculative decoding (issue 15): n-gram and draft-model proposals, exact verification.

Greedy output with speculation is the same as without, token for token, on chunked prefill,
prefix hits and forced preemption; the rejection sampler reproduces the target distribution
(chi-square); seeded output is the same alone and in a batch; the randomized engine run keeps
every invariant with speculation on, leaks no block and never hashes a rejected token.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from shared.config import ConfigError, EngineArgs, SpeculativeConfig
from shared.engine import LLM, EngineCore
from shared.engine.sampler import Sampler
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler_output import SampleSpec, SpecSample, position_spec
from shared.engine.spec_decode import NgramIndex

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}

# ---- unit: proposals and config ---------------------------------------------------------------


@pytest.mark.unit
def test_ngram_index_proposes_the_continuation_of_the_latest_longest_match():
    idx = NgramIndex(1, 3)
    assert idx.propose([1, 2, 3, 4, 1, 2], 4) == [3, 4, 1, 2]  # "1 2" seen at 0
    assert idx.propose([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]  # incremental: "1 2 3" at 0
    idx = NgramIndex(1, 3)
    # "9" occurs twice; the latest earlier occurrence wins; the suffix never matches itself
    assert idx.propose([9, 5, 9, 6, 7, 9], 2) == [6, 7]
    assert NgramIndex(2, 3).propose([1, 2, 3, 4, 5], 3) == []  # no repeated bigram
    assert NgramIndex(1, 1).propose([7], 3) == []
    # the longest match is preferred over a later shorter one
    assert NgramIndex(1, 2).propose([4, 5, 8, 5, 9, 4, 5], 1) == [8]


@pytest.mark.unit
def test_speculative_config_uses_vllm_keys_and_refuses_the_rest():
    c = SpeculativeConfig.parse(json.dumps(NGRAM))
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (
        "ngram",
        4,
        1,
        3,
    )
    assert (
        SpeculativeConfig.parse(
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 5}'
        ).prompt_lookup_min
        == 5
    )
    assert SpeculativeConfig.parse(c.to_json()) == c
    assert SpeculativeConfig.parse(None) is None
    for bad, msg in [
        ("{", "not JSON"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "not supported"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "1..16"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "foo": 1}', "foo"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "model directory"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
            "prompt_lookup",
        ),
    ]:
        with pytest.raises(ConfigError, match=msg):
            SpeculativeConfig.parse(bad)
    args = EngineArgs(model="m", speculative_config=NGRAM)
    assert "--speculative-config" in args.to_cli_args()


@pytest.mark.unit
def test_position_specs_count_the_drafts_before_them():
    base = SampleSpec(
        "r", SamplingParams(temperature=1.0, frequency_penalty=0.5), 5, (2,), (), (7,)
    )
    s2 = position_spec(base, [11, 12, 13], 2)
    assert s2.num_output_tokens == 7 and tuple(s2.output_token_ids) == (7, 11, 12)
    assert position_spec(base, [11], 0) is base


# ---- the rejection sampler ----------------------------------------------------------------------


def _spec(i: int, params: SamplingParams, pos: int = 0) -> SampleSpec:
    return SampleSpec(f"r{i}", params, pos, ())


@pytest.mark.unit
def test_rejection_sampling_reproduces_the_target_distribution():
    """Chi-square over many seeded draws on an 8-token vocabulary: the first token out of
    ``verify`` (accepted draft or resample) follows the target's p, whatever q proposes."""
    torch.manual_seed(0)
    v = 8
    sampler = Sampler(v, torch.device("cpu"), seed=0)
    p_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]] * 2)
    p = torch.softmax(p_logits[0], -1)
    q = torch.softmax(torch.tensor([0.0, 2.0, 0.0, 1.0, 0.0, 3.0, -1.0, 0.0]), -1)
    n = 6000
    counts = Counter()
    accepted = 0
    g = torch.Generator().manual_seed(1)
    for i in range(n):
        params = SamplingParams(temperature=1.0, seed=1000 + i)
        draft = int(torch.multinomial(q, 1, generator=g))
        rows = [_spec(i, params, 0), _spec(i, params, 1)]
        out = sampler.verify(p_logits, rows, [draft], q.unsqueeze(0))
        assert isinstance(out, SpecSample)
        counts[out.tokens[0].token_id] += 1
        accepted += out.num_accepted
    expected = p * n
    chi2 = sum((counts[t] - float(expected[t])) ** 2 / float(expected[t]) for t in range(v))
    assert chi2 < 24.3, (chi2, counts)  # p = 0.001 critical value with 7 degrees of freedom
    # min(1, p/q) acceptance: sum(min(p, q)) in expectation
    rate = accepted / n
    assert abs(rate - float(torch.minimum(p, q).sum())) < 0.03, rate


@pytest.mark.unit
def test_ngram_verification_draws_what_plain_decoding_draws():
    """One-hot q: the token at each position is the target's own draw with the position's
    noise, so a seeded request's output does not change with speculation."""
    v = 16
    sampler = Sampler(v, torch.device("cpu"), seed=0)
    logits = torch.randn(4, v, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.8, seed=42)
    rows = [_spec(0, params, 10 + j) for j in range(4)]
    plain = [sampler(logits[j : j + 1], [rows[j]])[0].token_id for j in range(4)]
    out = sampler.verify(logits, rows, plain[:3])  # drafts equal to the draws: all accepted
    assert [t.token_id for t in out.tokens] == plain and out.num_accepted == 3
    wrong = [(plain[0] + 1) % v, plain[1], plain[2]]
    out = sampler.verify(logits, rows, wrong)
    assert [t.token_id for t in out.tokens] == plain[:1] and out.num_accepted == 0


# ---- whole engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_dir(tiny_llama, tmp_path_factory) -> Path:
    from shared.cli.tiny_model import truncate_layers

    return truncate_layers(tiny_llama, tmp_path_factory.mktemp("draft") / "d1", 1)


def _prompts(seed: int, n: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        base = [rng.randrange(3, 2048) for _ in range(rng.randint(5, 120))]
        out.append(base * (1 + i % 3))  # repeated text: n-gram drafts find matches
    return out


def _run(model, prompts, params, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model), device="cpu", kv_cache_memory="64MiB", **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs], llm


def _spec_config(kind: str, draft_dir: Path) -> dict:
    if kind == "ngram":
        return NGRAM
    return {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_greedy_output_is_unchanged_and_matches_transformers(kind, tiny_llama, draft_dir):
    from tests.engine.helpers import hf_greedy, mismatches

    prompts = _prompts(1)
    rng = random.Random(9)  # later prompts share earlier ones' prefixes: prefix-cache hits
    prompts += [p[:48] + [rng.randrange(3, 2048) for _ in range(9)] for p in prompts if len(p) > 48]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    # chunked prefill (64-token steps), at most 4 running: the later prompts find the prefixes
    kw = {"max_num_batched_tokens": 64, "max_num_seqs": 4}
    got, llm = _run(tiny_llama, prompts, sp, speculative_config=_spec_config(kind, draft_dir), **kw)
    assert mismatches(got, hf_greedy(tiny_llama, prompts, 48)) == []
    st = llm.engine.stats()
    assert st.prefix_cache_hits > 0
    assert st.spec_num_drafts > 0 and st.spec_num_draft_tokens >= st.spec_num_drafts
    assert 0 < st.spec_num_accepted_tokens <= st.spec_num_draft_tokens
    llm.engine.check_integrity()


@pytest.mark.integration
def test_the_target_as_its_own_draft_accepts_every_draft(tiny_llama):
    prompts = _prompts(2, n=3)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref, _ = _run(tiny_llama, prompts, sp)
    cfg = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 4}
    got, llm = _run(tiny_llama, prompts, sp, speculative_config=cfg)
    assert got == ref
    st = llm.engine.stats()
    assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens > 0


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_unchanged_under_forced_preemption(kind, mode, tiny_llama, draft_dir):
    prompts = _prompts(3, n=8)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(num_gpu_blocks_override=40, max_model_len=400, preemption_mode=mode, swap_space=0.01)
    ref, base = _run(tiny_llama, prompts, sp, **kw)
    got, llm = _run(tiny_llama, prompts, sp, speculative_config=_spec_config(kind, draft_dir), **kw)
    assert got == ref
    assert llm.engine.stats().num_preemptions > 0, "the pool was sized to force preemption"


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_seeded_sampling_is_the_same_alone_and_in_a_batch(kind, tiny_llama, draft_dir):
    prompts = _prompts(4, n=5)
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=24, ignore_eos=True)
        for i in range(len(prompts))
    ]
    cfg = _spec_config(kind, draft_dir)
    llm = LLM(str(tiny_llama), device="cpu", kv_cache_memory="64MiB", speculative_config=cfg)
    batch = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    alone = [
        llm.generate([{"prompt_token_ids": p}], sp)[0].outputs[0].token_ids
        for p, sp in zip(prompts, params)
    ]
    assert batch == alone
    if kind == "ngram":  # a one-hot q: exactly plain decoding's seeded draws
        plain, _ = _run(tiny_llama, prompts, params)
        assert batch == plain


@pytest.mark.integration
def test_stops_penalties_and_logprobs_with_several_tokens_per_step(tiny_llama):
    prompts = _prompts(5, n=4)
    sp = SamplingParams(
        temperature=0,
        max_tokens=30,
        ignore_eos=True,
        logprobs=2,
        frequency_penalty=0.4,
        min_tokens=5,
    )
    ref, _ = _run(tiny_llama, prompts, sp)
    got, llm = _run(tiny_llama, prompts, sp, speculative_config=NGRAM)
    assert got == ref and llm.engine.stats().spec_num_drafts > 0
    # a stop token id inside an accepted run ends the request there
    stop = ref[0][7]
    sp_stop = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop])
    ref_stop, _ = _run(tiny_llama, prompts[:1], sp_stop)
    got_stop, _ = _run(tiny_llama, prompts[:1], sp_stop, speculative_config=NGRAM)
    assert got_stop == ref_stop and got_stop[0][-1] == stop


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_randomized_steps_with_speculation_keep_integrity(kind, tiny_llama, draft_dir):
    rng = random.Random(11)
    engine = EngineCore(
        EngineArgs(
            model=str(tiny_llama),
            num_gpu_blocks_override=32,
            max_model_len=400,
            max_num_batched_tokens=96,
            max_num_seqs=8,
            speculative_config=_spec_config(kind, draft_dir),
        )
    )
    seen = []
    add = engine.scheduler.add

    def record(req):
        seen.append(req)
        seen.extend(req.siblings)
        add(req)

    engine.scheduler.add = record  # type: ignore[method-assign]
    prefixes = [[rng.randrange(3, 2048) for _ in range(40)] for _ in range(3)]
    live: set[str] = set()
    for i in range(300):
        if rng.random() < 0.3:
            base = rng.choice(prefixes)
            prompt = base + [rng.randrange(3, 2048) for _ in range(rng.randint(1, 60))] + base[:20]
            params = SamplingParams(
                n=rng.choice([1, 1, 2]),
                max_tokens=rng.randint(1, 40),
                temperature=rng.choice([0.0, 0.0, 0.8]),
                seed=rng.choice([None, 3]),
                ignore_eos=True,
            )
            engine.add_request(f"r{i}", prompt, params)
            live.add(f"r{i}")
        if live and rng.random() < 0.05:
            engine.abort_request([live.pop()])
        engine.step()
        engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    pool = engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks, "leaked blocks"
    assert engine.stats().num_preemptions > 0 and engine.stats().spec_num_drafts > 0
    # no rejected draft in the prefix cache: every cached hash is one of a real sequence's
    allowed = {h for r in seen for h in r.block_hashes}
    cached = {b.block_hash for b in pool.blocks if b.block_hash is not None}
    assert cached and cached <= allowed


@pytest.mark.unit
def test_a_request_whose_drafts_fail_pauses_then_probes():
    from shared.engine.spec_decode import MIN_ACCEPTANCE, PAUSE_STEPS, SpecDecoder

    spec = SpecDecoder(SpeculativeConfig.parse(json.dumps(NGRAM)), max_model_len=4096)
    steps = 0
    while spec.allow("r"):  # every draft rejected: the average falls below the floor
        spec.observe("r", 4, 0)
        steps += 1
        assert steps < 20
    assert steps == 4 and MIN_ACCEPTANCE > 0
    paused = 1 + sum(1 for _ in range(PAUSE_STEPS * 2) if not spec.allow("r"))
    assert paused == PAUSE_STEPS  # then one probe step
    spec.observe("r", 4, 4)  # a good probe: speculating again
    assert all(spec.allow("r") for _ in range(5))
    spec.forget("r")
    assert spec.allow("other") and "r" not in spec._accept


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_a_resumed_stream_speculates_to_the_same_tokens(kind, tiny_llama, draft_dir):
    """Mid-stream failover: the router resends the prompt with the tokens already streamed to
    another decode worker (``resume``); with speculation on there, the rest is unchanged."""
    prompts = _prompts(6, n=3)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref, _ = _run(tiny_llama, prompts, sp)
    engine = EngineCore(
        EngineArgs(
            model=str(tiny_llama),
            kv_cache_memory="64MiB",
            speculative_config=_spec_config(kind, draft_dir),
        )
    )
    for i, (p, full) in enumerate(zip(prompts, ref)):
        engine.add_request(f"r{i}", p, sp, resume=[list(full[: 7 + 5 * i])])
    rest: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            rest.setdefault(o.request_id, []).extend(o.new_token_ids)
    for i, full in enumerate(ref):
        assert list(full[: 7 + 5 * i]) + rest[f"r{i}"] == list(full)
    assert engine.stats().spec_num_drafts > 0


# ---- speculation under a grammar (structured outputs) ----------------------------------------

# an array of same-shaped objects: its keys repeat, so n-gram drafts find matches in the output
REPEATING_SCHEMA = {
    "type": "array",
    "minItems": 6,
    "maxItems": 6,
    "items": {
        "type": "object",
        "properties": {
            "kind": {"enum": ["alpha", "beta"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
            "ok": {"type": "boolean"},
        },
        "required": ["kind", "n", "ok"],
        "additionalProperties": False,
    },
}


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_constrained_output_speculates_to_the_same_tokens(kind, tiny_llama, draft_dir):
    """Each verified position is drawn under the mask plain decoding would have applied (the
    matcher walks the drafts and rolls back), and the matcher advances by every token kept:
    greedy and n-gram seeded output equal the output without speculation, every output
    parses, and drafts were accepted (several tokens per step under the grammar)."""
    from shared.engine.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(json=json.dumps(REPEATING_SCHEMA))
    prompts = _prompts(11, n=4)
    params = [SamplingParams(temperature=0, max_tokens=200, structured_outputs=so)] * 2 + [
        SamplingParams(temperature=1.0, seed=7 + i, max_tokens=200, structured_outputs=so)
        for i in range(2)
    ]
    ref, _ = _run(tiny_llama, prompts, params)
    got, llm = _run(tiny_llama, prompts, params, speculative_config=_spec_config(kind, draft_dir))
    tok = llm.tokenizer
    for ids in got:
        out = json.loads(tok.decode(ids))
        assert len(out) == 6 and all(set(o) == {"kind", "n", "ok"} for o in out)
    if kind == "ngram":
        assert got == ref  # a one-hot q: plain decoding's draws, greedy and seeded
    else:
        assert got[:2] == ref[:2]  # greedy; sampled rows follow the rejection sampler
    st = llm.engine.stats()
    assert st.spec_num_accepted_tokens > 0, "no draft was accepted under the grammar"
    llm.engine.check_integrity()
