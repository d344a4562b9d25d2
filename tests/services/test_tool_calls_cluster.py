"""Tool calling through the whole cluster (router -> prefill -> UCX -> decode), router started
with ``--enable-auto-tool-choice --tool-call-parser hermes``, the test model's Hermes-style chat
template rendering the tools:

- ``tool_choice="required"`` and a named function are enforced by a grammar, so with random
  weights every call parses: names among the tools, arguments valid against each schema,
  greedy and sampled, ``parallel_tool_calls`` respected;
- ``"auto"``: the hermes parser reads ``<tool_call>`` blocks from the output (forced here with a
  regex, the weights being random), text around them is content;
- streamed ``tool_calls`` deltas (the ``openai`` SDK's accumulating stream) add up to the
  non-streaming message for the same seed;
- a conversation carrying the assistant's tool calls and the tool's results renders and runs.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.cluster_utils import make_cluster

pytestmark = pytest.mark.integration

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["paris", "oslo", "lima"]},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["query"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": f"the {n} tool", "parameters": s}}
    for n, s in SCHEMAS.items()
]
MESSAGES = [{"role": "user", "content": "What is the weather in the north?"}]


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    c = make_cluster(tiny_llama, tmp_path_factory.mktemp("tools"))
    c.start_redis()
    workers = [c.spawn_worker("prefill", 0), c.spawn_worker("decode", 0)]
    c.wait_ready(workers)
    url = c.start_router(
        [
            "--local-prefill-threshold",
            "0",  # every prompt through the prefill worker: the first token is sampled there
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
        ]
    )
    yield c, url
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    import openai

    c, url = cluster
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ask(cluster, client):
    """``chat.completions.create`` on the served model, with MESSAGES and TOOLS unless the
    test gives its own."""
    c, _ = cluster

    def create(**kw):
        return client.chat.completions.create(
            **{"model": c.served_model_name, "messages": MESSAGES, "tools": TOOLS, **kw}
        )

    return create


def _check_calls(calls, allowed=SCHEMAS) -> None:
    assert calls
    for call in calls:
        assert call.type == "function"
        assert call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name])


def _accumulate(stream):
    """The streamed message: content, tool calls by index, the finish reason."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or ():
                c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert c["id"] is None, "a call's id and name come once"
                    c["id"], c["name"] = tc.id, tc.function.name
                c["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_always_parses(ask, temperature):
    for seed in range(6):
        r = ask(
            tool_choice="required",
            temperature=temperature,
            seed=seed,
            max_tokens=200,
        )
        choice = r.choices[0]
        assert choice.message.content is None
        calls = choice.message.tool_calls
        if choice.finish_reason == "length":
            # random weights may repeat calls until max_tokens: every call but the one cut
            # short parses
            assert len(calls) >= 2, choice
            calls = calls[:-1]
        else:
            assert choice.finish_reason == "tool_calls", choice
        _check_calls(calls)


def test_required_single_call_without_parallel(ask):
    for seed in range(4):
        r = ask(
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1
        _check_calls(calls)


def test_named_function(ask):
    for seed in range(4):
        r = ask(
            tool_choice={"type": "function", "function": {"name": "search"}},
            temperature=1.0,
            seed=seed,
            max_tokens=120,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop"  # OpenAI's: a named choice ends with stop
        assert [t.function.name for t in choice.message.tool_calls] == ["search"]
        _check_calls(choice.message.tool_calls, {"search": SEARCH})


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_tool_calls_add_up_to_the_message(ask, tool_choice):
    for seed in range(3):
        args = dict(
            tool_choice=tool_choice,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        whole = ask(**args).choices[0]
        content, calls, finish = _accumulate(ask(stream=True, **args))
        assert content == (whole.message.content or "")
        assert finish == whole.finish_reason
        assert [(x["name"], x["arguments"]) for x in calls] == [
            (t.function.name, t.function.arguments) for t in whole.message.tool_calls
        ]
        assert all(x["id"].startswith("call_") for x in calls)


# the weights are random, so the model's own hermes format is forced with a regex; the parser
# is what reads it (no tool plan constrains "auto")
HERMES_REGEX = (
    r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "(paris|oslo|lima)", "unit": "[cf]"\}\}\n</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_hermes_tool_calls(ask, stream):
    args = dict(
        temperature=1.0,
        seed=3,
        max_tokens=120,
        extra_body={"structured_outputs": {"regex": HERMES_REGEX}},
    )
    if stream:
        content, calls, finish = _accumulate(ask(stream=True, **args))
        names_args = [(x["name"], x["arguments"]) for x in calls]
    else:
        choice = ask(**args).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        names_args = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls]
    assert content == "Checking."
    assert finish == "tool_calls"
    assert len(names_args) == 1 and names_args[0][0] == "get_weather"
    jsonschema.validate(json.loads(names_args[0][1]), WEATHER)


def test_auto_without_a_call_is_content(ask):
    r = ask(
        temperature=0.0,
        max_tokens=24,
        extra_body={"structured_outputs": {"regex": "no tools needed, (yes|no)"}},
    )
    choice = r.choices[0]
    assert choice.message.content.startswith("no tools needed, ")
    assert not choice.message.tool_calls
    assert choice.finish_reason == "stop"


def test_tool_results_round_trip(ask):
    """The assistant's tool calls and the tool's answer go back into the prompt."""
    first = ask(
        tool_choice="required",
        temperature=0.0,
        max_tokens=200,
    )
    msg = first.choices[0].message
    history = [
        *MESSAGES,
        msg.model_dump(exclude_none=True),
        *(
            {"role": "tool", "tool_call_id": t.id, "content": json.dumps({"ok": True})}
            for t in msg.tool_calls
        ),
    ]
    second = ask(
        messages=history,
        tool_choice="none",
        temperature=0.0,
        max_tokens=8,
    )
    assert second.choices[0].message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


# ---- the Responses API ------------------------------------------------------------------

RESPONSES_TOOLS = [
    {"type": "function", "name": n, "description": f"the {n} tool", "parameters": s}
    for n, s in SCHEMAS.items()
]


def test_responses_text_streamed_and_not(cluster, client):
    c, _ = cluster
    args = dict(
        model=c.served_model_name,
        instructions="Be brief.",
        input="Say something.",
        max_output_tokens=12,
        temperature=0.0,
    )
    r = client.responses.create(**args)
    assert r.object == "response" and r.status == "incomplete"  # hit max_output_tokens
    assert r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"]
    assert r.output_text and r.usage.output_tokens == 12
    events = list(client.responses.create(stream=True, **args))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        r.output_text
    )
    assert events[-1].response.output_text == r.output_text


def test_responses_function_calls_and_their_outputs(cluster, client):
    c, _ = cluster
    args = dict(
        model=c.served_model_name,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}],
        tools=RESPONSES_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        max_output_tokens=200,
        extra_body={"seed": 5},
    )
    r = client.responses.create(**args)
    assert r.status == "completed"
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name in SCHEMAS
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
    # streamed: the same call (same seed), argument deltas adding up
    events = list(client.responses.create(stream=True, **args))
    streamed = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert streamed == calls[0].arguments
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.name, i.arguments) for i in done] == [
        ("function_call", calls[0].name, calls[0].arguments)
    ]
    # the call and its output go back as input items
    follow = client.responses.create(
        model=c.served_model_name,
        input=[
            {"role": "user", "content": "Weather?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": calls[0].name,
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
        ],
        tools=RESPONSES_TOOLS,
        tool_choice="none",
        max_output_tokens=6,
    )
    assert follow.output_text
    assert follow.usage.input_tokens > r.usage.input_tokens


def test_responses_structured_text_format(cluster, client):
    from pydantic import BaseModel, Field

    class City(BaseModel):  # bounded: random weights would write a string forever
        city: str = Field(max_length=12)
        population: int = Field(ge=0, le=10**6)

    c, _ = cluster
    for seed in range(3):
        r = client.responses.parse(
            model=c.served_model_name,
            input="A city, as JSON.",
            text_format=City,
            temperature=1.0,
            max_output_tokens=200,
            extra_body={"seed": seed},
        )
        assert isinstance(r.output_parsed, City), r.output_text
        # the text itself has the schema's types (pydantic's lax mode would take "42" too)
        fields = json.loads(r.output_text)
        assert type(fields["population"]) is int and type(fields["city"]) is str, fields
        assert City(**fields) == r.output_parsed


def test_responses_refusals_name_the_field(cluster):
    import httpx

    c, url = cluster
    for body, param in (
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0"),
    ):
        r = httpx.post(f"{url}/v1/responses", json={"model": c.served_model_name, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


# ---- logit_bias and allowed_token_ids, first token on the prefill worker ----------------


def test_logit_bias_and_allowed_token_ids_reach_both_workers(cluster):
    import httpx

    c, url = cluster
    ids = httpx.post(f"{url}/tokenize", json={"prompt": " the cat", "add_special_tokens": False})
    the, cat = ids.json()["tokens"][:2]

    def tokens(**extra):
        r = httpx.post(
            f"{url}/v1/completions",
            json={
                "model": c.served_model_name,
                "prompt": "Once upon a time",
                "max_tokens": 8,
                "ignore_eos": True,
                "temperature": 1.0,
                "seed": 1,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
                **extra,
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        return [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]

    plain = tokens()
    assert tokens(logit_bias={str(cat): 100}) == [cat] * 8
    assert set(tokens(allowed_token_ids=[the, cat])) <= {the, cat}
    banned = tokens(logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]


def test_a_grammar_left_without_tokens_ends_the_choice_on_either_worker(cluster):
    """tool_choice required with allowed_token_ids that cannot start the call: the first token
    (sampled on the prefill worker) is a forced end, and the decode worker ends the choice
    there too, under ignore_eos as well: a 200, not a 500 (the fuzzer's case)."""
    import httpx

    c, url = cluster
    word = httpx.post(f"{url}/tokenize", json={"prompt": "the", "add_special_tokens": False})
    for ignore_eos in (False, True):
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": c.served_model_name,
                "messages": MESSAGES,
                "tools": TOOLS,
                "tool_choice": "required",
                "allowed_token_ids": word.json()["tokens"][:1],
                "ignore_eos": ignore_eos,
                "max_tokens": 8,
            },
            timeout=60,
        )
        assert r.status_code == 200, (ignore_eos, r.text)
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["message"]["tool_calls"] == []
        assert r.json()["usage"]["completion_tokens"] == 1
