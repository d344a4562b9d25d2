"""Structured outputs (issue 16, the constrained-decoding part) through xgrammar.

With a random-weight model every constrained output must still parse and validate: hundreds of
seeded samples over schemas with nesting, enums, arrays and required keys, greedy and sampled,
plus regex, choice, EBNF grammar and "any JSON object"; under forced preemption; and a prefill
worker's first token continued by a decode worker (the matcher rebuilt from the tokens so far).
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from shared.engine import LLM, InvalidRequestError
from shared.engine.sampling_params import (
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        },
        "required": ["color", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "role": {"enum": ["admin", "guest"]},
                },
                "required": ["id", "role"],
                "additionalProperties": False,
            },
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["user", "scores"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no"]},
            "why": {"type": "string", "maxLength": 10},
        },
        "required": ["answer"],
        "additionalProperties": False,
    },
]


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(rng.randint(2, 60))] for _ in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), device="cpu", kv_cache_memory="64MiB")


def _texts(llm, prompts, params) -> list[tuple[str, str]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [
        (
            llm.tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True),
            o.outputs[0].finish_reason,
        )
        for o in outs
    ]


@pytest.mark.unit
def test_structured_outputs_params_need_exactly_one_kind():
    assert StructuredOutputsParams(regex="a+").kind() == ("regex", "a+")
    for bad in (
        StructuredOutputsParams(),
        StructuredOutputsParams(regex="a", json="{}"),
        StructuredOutputsParams(choice=()),
        StructuredOutputsParams(grammar="x" * (300 * 1024)),
    ):
        with pytest.raises(SamplingParamsError):
            SamplingParams(structured_outputs=bad)


@pytest.mark.integration
def test_every_json_output_parses_and_validates(llm):
    """200 requests: 4 schemas x 50 seeded samples (half greedy, half sampled at T=1)."""
    bad = []
    total = 0
    for k, schema in enumerate(SCHEMAS):
        so = StructuredOutputsParams(json=json.dumps(schema))
        prompts = _prompts(50, seed=k)
        params = [
            SamplingParams(
                temperature=0.0 if i % 2 else 1.0,
                seed=1000 * k + i,
                max_tokens=256,
                structured_outputs=so,
            )
            for i in range(50)
        ]
        for text, finish in _texts(llm, prompts, params):
            total += 1
            try:
                jsonschema.validate(json.loads(text), schema)
                assert finish == "stop"  # the grammar ends the output with EOS
            except Exception as e:  # noqa: BLE001 - collect every failure
                bad.append((k, text[:80], finish, repr(e)[:80]))
    assert total == 200 and bad == []


@pytest.mark.integration
def test_regex_choice_grammar_and_json_object(llm):
    import re

    prompts = _prompts(12, seed=9)
    cases = [
        (
            StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
            lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t),
        ),
        (
            StructuredOutputsParams(choice=("yes", "no", "maybe")),
            lambda t: t in ("yes", "no", "maybe"),
        ),
        (
            StructuredOutputsParams(grammar='root ::= "(" [a-c]+ ")" | "none"'),
            lambda t: re.fullmatch(r"\([a-c]+\)|none", t),
        ),
    ]
    for so, ok in cases:
        params = [
            SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=so)
            for i in range(12)
        ]
        for text, finish in _texts(llm, prompts, params):
            if finish == "stop":
                assert ok(text), (so, text)
            else:  # a long [a-c]+ may run out of tokens: still a prefix of the language
                assert finish == "length" and so.grammar is not None and text.startswith("(")
    so = StructuredOutputsParams(json_object=True)
    params = [SamplingParams(temperature=0.0, max_tokens=400, structured_outputs=so)] * 6
    for text, finish in _texts(llm, prompts[:6], params):
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert text.startswith("{")


@pytest.mark.unit
def test_different_choice_lists_never_share_a_cache_key():
    # the key was "\x00".join(choice): ["yes", "no"] and ["yes\x00no"] shared one compiled
    # grammar, so whichever came first decided the other's constraint
    lists = [("yes", "no"), ("yes\x00no",), ("yes", "", "no"), ('yes", "no',), ("a\\", "b")]
    keys = {StructuredOutputsParams(choice=c).kind() for c in lists if all(c)}
    assert len(keys) == len([c for c in lists if all(c)])
    # the size limit counts the strings' characters, not the key's escapes
    nul = StructuredOutputsParams(choice=("\x00" * (200 * 1024),))
    SamplingParams(structured_outputs=nul)
    with pytest.raises(SamplingParamsError, match="characters"):
        SamplingParams(structured_outputs=StructuredOutputsParams(choice=("x" * 200_000,) * 2))


@pytest.mark.integration
def test_a_choice_holding_nul_gets_its_own_grammar(llm):
    prompt = [{"prompt_token_ids": [5, 6, 7, 8, 9]}]
    for choices in [("yes", "no"), ("yes\x00no",)] * 2:
        sp = SamplingParams(
            temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=choices)
        )
        out = llm.generate(prompt, sp)[0].outputs[0]
        assert llm.tokenizer.decode(out.token_ids, skip_special_tokens=True) in choices


@pytest.mark.integration
def test_constraints_hold_under_forced_preemption(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", num_gpu_blocks_override=24, max_model_len=300)
    so = StructuredOutputsParams(json=json.dumps(SCHEMAS[2]))
    prompts = _prompts(16, seed=21)
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured_outputs=so)
        for i in range(16)
    ]
    for text, _ in _texts(llm, [p + p + p for p in prompts], params):
        jsonschema.validate(json.loads(text), SCHEMAS[2])
    assert llm.engine.stats().num_preemptions > 0


@pytest.mark.integration
def test_a_bad_schema_is_refused_with_the_field_named(llm):
    so = StructuredOutputsParams(
        json='{"type": "object", "properties": {"a": {"type": "nonsense"}}}'
    )
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(structured_outputs=so))
    with pytest.raises(InvalidRequestError, match="not JSON|structured_outputs"):
        llm.generate(
            [{"prompt_token_ids": [5, 6]}],
            SamplingParams(structured_outputs=StructuredOutputsParams(json="{nope")),
        )


@pytest.mark.integration
def test_the_matcher_is_rebuilt_from_tokens_already_produced(tiny_llama, llm):
    """A decode worker continues a prefill worker's first token, a failover target the tokens
    sent so far: resuming a constrained request mid-output gives the same valid text."""
    so = StructuredOutputsParams(json=json.dumps(SCHEMAS[0]))
    prompt = _prompts(1, seed=33)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=so)
    full = llm.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0].token_ids
    cut = len(full) // 2
    llm.engine.add_request("resumed", prompt, sp, resume=[list(full[:cut])])
    rest: list[int] = []
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            rest += o.new_token_ids
    assert list(full[:cut]) + rest == list(full)
    jsonschema.validate(
        json.loads(llm.tokenizer.decode(full, skip_special_tokens=True)), SCHEMAS[0]
    )


@pytest.mark.integration
def test_a_request_past_its_grammar_end_resumes(llm):
    """With ignore_eos a finished grammar is followed by ends until max_tokens; a failover
    target rebuilding the matcher from those tokens stops feeding it at the grammar's end (it
    fed the second end to the finished matcher, which refused it: the request failed)."""
    prompt = [5, 6, 7, 8]
    sp = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True,
        structured_outputs=StructuredOutputsParams(regex="[0-9]{2}"),
    )  # fmt: skip
    full = list(llm.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0].token_ids)
    eos = set(llm.engine.model_config.eos_token_ids)
    assert len(full) == 8 and sum(t in eos for t in full) >= 3, full
    for cut in range(1, 8):
        llm.engine.add_request(f"past-end-{cut}", prompt, sp, resume=[full[:cut]])
        rest: list[int] = []
        finish = None
        while llm.engine.has_unfinished_requests():
            for o in llm.engine.step():
                rest += o.new_token_ids
                finish = o.finish_reason or finish
        assert (full[:cut] + rest, finish) == (full, "length"), cut


@pytest.mark.integration
def test_the_grammar_end_wins_over_min_tokens(llm):
    """A grammar that is complete allows only EOS; min_tokens bans EOS. The request ends at the
    grammar's end (not an all -inf row, a NaN draw and a failed request)."""
    prompts = _prompts(6, seed=40)
    for temperature in (0.0, 1.0):
        params = [
            SamplingParams(
                temperature=temperature,
                seed=i,
                max_tokens=20,
                min_tokens=10,
                structured_outputs=StructuredOutputsParams(choice=("yes", "no")),
            )
            for i in range(6)
        ]
        for text, finish in _texts(llm, prompts, params):
            assert text in ("yes", "no") and finish == "stop"
    # and with ignore_eos the output stays the grammar's text followed by ends only
    sp = SamplingParams(
        temperature=1.0, seed=1, max_tokens=8, ignore_eos=True,
        structured_outputs=StructuredOutputsParams(regex="[0-9]{2}"),
    )  # fmt: skip
    out = llm.generate([{"prompt_token_ids": prompts[0]}], sp)[0].outputs[0]
    assert len(out.token_ids) == 8
    assert llm.tokenizer.decode(out.token_ids, skip_special_tokens=True).isdigit()


# ---- the compile cache under concurrent requests -------------------------------------------


@pytest.mark.unit
def test_a_cold_compile_blocks_neither_cache_hits_nor_other_specs():
    """A schema that takes long to compile (seconds, for a large one) must not stall other
    requests' cache hits or compiles on the worker's other gRPC threads; two requests for the
    spec being compiled share the one compile."""
    import threading

    from shared.engine.structured_output import GrammarCompiler

    gc = GrammarCompiler("unused", 100, (2,))
    entered, release = threading.Event(), threading.Event()
    builds: list[str] = []

    def build(key, so):
        builds.append(key[1])
        if key[1] == "slow":
            entered.set()
            assert release.wait(10)
        return f"compiled {key[1]}"

    gc._build = build  # the xgrammar part: not what this test is about
    slow = StructuredOutputsParams(regex="slow")
    results: list[object] = []
    first = threading.Thread(target=lambda: results.append(gc.compile(slow)))
    second = threading.Thread(target=lambda: results.append(gc.compile(slow)))
    first.start()
    assert entered.wait(10)
    second.start()  # waits for the same compile
    done = threading.Event()

    def others():
        gc.compile(StructuredOutputsParams(regex="fast"))  # cold, another spec
        gc.compile(StructuredOutputsParams(regex="fast"))  # a hit
        done.set()

    threading.Thread(target=others).start()
    try:
        assert done.wait(10), "another spec waited behind the cold compile"
    finally:
        release.set()
    first.join(10)
    second.join(10)
    assert results == ["compiled slow", "compiled slow"]
    assert sorted(builds) == ["fast", "slow"]  # one build per spec


@pytest.mark.unit
def test_a_failed_compile_fails_its_waiters_and_is_retried():
    from shared.engine.structured_output import GrammarCompiler, StructuredOutputError

    gc = GrammarCompiler("unused", 100, (2,))
    calls = []

    def build(key, so):
        calls.append(key)
        raise StructuredOutputError("bad", param="structured_outputs")

    gc._build = build
    so = StructuredOutputsParams(regex="x")
    for _ in range(2):  # not cached: each request gets the error from its own compile
        with pytest.raises(StructuredOutputError):
            gc.compile(so)
    assert len(calls) == 2 and not gc._pending


@pytest.mark.integration
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_grammar_no_allowed_token_satisfies_ends_the_sequence(tiny_llama, ignore_eos):
    """allowed_token_ids (or logit_bias) that leave the grammar no token: the sequence ends
    there ("stop"), alone, instead of failing with a grammar violation (found by the fuzzer:
    a 500 from the decode worker); under ignore_eos too."""
    llm = LLM(str(tiny_llama), device="cpu", kv_cache_memory="64MiB")
    tok = llm.tokenizer
    word = tok.encode("the", add_special_tokens=False).ids[0]  # cannot start a JSON value
    so = StructuredOutputsParams(json=json.dumps({"type": "object"}))
    params = (
        [
            SamplingParams(
                temperature=t,
                seed=1,
                max_tokens=8,
                structured_outputs=so,
                ignore_eos=ignore_eos,
                allowed_token_ids=[word],
            )
            for t in (0.0, 0.8)
        ]
        + [
            # what a prefill worker runs: one token; the forced end must still read "stop" (the
            # decode worker learns from it that the row ended)
            SamplingParams(
                temperature=0.0,
                max_tokens=1,
                structured_outputs=so,
                ignore_eos=ignore_eos,
                allowed_token_ids=[word],
            )
        ]
        + [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    )  # undisturbed
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}] * len(params), params)
    for o in outs[:3]:
        assert o.outputs[0].finish_reason == "stop"
        assert len(o.outputs[0].token_ids) == 1  # the forced end
    assert len(outs[3].outputs[0].token_ids) == 8
