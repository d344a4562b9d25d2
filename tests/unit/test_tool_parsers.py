"""The tool-call parsers (router/tool_calls.py): what each format yields, that a stream's
deltas add up to the one-shot message however the text is split, and the request plans."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.errors import InvalidRequestError
from router.tool_calls import HERMES, LLAMA3_JSON, ToolSettings, plan_tools

pytestmark = pytest.mark.unit

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "noop"}},
]
AUTO_HERMES = ToolSettings(True, HERMES)
AUTO_LLAMA = ToolSettings(True, LLAMA3_JSON)


def plan(choice="auto", settings=AUTO_HERMES, parallel=None):
    return plan_tools(TOOLS, choice, parallel, settings, constrained=False)


def one_shot(p, text):
    s = p.stream()
    s.feed(text)
    s.finish()
    content, calls = s.message()
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def streamed(p, pieces):
    """Content and (name, arguments) per call from the deltas alone."""
    s = p.stream()
    outs = [s.feed(x) for x in pieces] + [s.finish()]
    content = "".join(o.content for o in outs)
    calls: dict[int, list] = {}
    for o in outs:
        for tc in o.tool_calls:
            if "id" in tc:
                assert tc["index"] not in calls
                calls[tc["index"]] = [tc["function"]["name"], ""]
            calls[tc["index"]][1] += tc["function"]["arguments"]
    return content or None, [tuple(calls[i]) for i in sorted(calls)]


HERMES_TEXT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris \\"left\\" }", "n": [1, 2.5e3, null]}}'
    "\n</tool_call>\n<tool_call>\n"
    '{"arguments": {}, "name": "noop"}\n</tool_call>\n'
)
HERMES_CALLS = [
    ("get_weather", '{"city": "Paris \\"left\\" }", "n": [1, 2.5e3, null]}'),
    ("noop", "{}"),
]

CASES = [
    (plan(), HERMES_TEXT, ("Let me check.", HERMES_CALLS)),
    # no call: every character is content, trailing whitespace and a half-written tag included
    (plan(), "plain text, then <tool_ and  ", ("plain text, then <tool_ and  ", [])),
    # a block that is not a call stays text
    (
        plan(),
        "x <tool_call>{not json}</tool_call> y",
        ("x <tool_call>{not json}</tool_call> y", []),
    ),
    (
        plan(),
        '<tool_call>{"arguments": {}}</tool_call>',
        ('<tool_call>{"arguments": {}}</tool_call>', []),
    ),
    # cut short inside the arguments (max_tokens): what was written stands
    (plan(), '<tool_call>{"name": "noop", "arguments": {"a": [1', (None, [("noop", '{"a": [1')])),
    # no arguments key: {}
    (plan(), '<tool_call>{"name": "noop"}</tool_call>', (None, [("noop", "{}")])),
    (plan(parallel=False), HERMES_TEXT, ("Let me check.", HERMES_CALLS[:1])),
    (
        plan(settings=AUTO_LLAMA),
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "x"}}; {"name": "noop", '
        '"parameters": {}}',
        (None, [("get_weather", '{"city": "x"}'), ("noop", "{}")]),
    ),
    (
        plan(settings=AUTO_LLAMA),
        ' {"name": "noop", "arguments": {"k": "}"}}',
        (None, [("noop", '{"k": "}"}')]),
    ),
    (plan(settings=AUTO_LLAMA), 'The answer is {"a": 1}', ('The answer is {"a": 1}', [])),
    (
        plan(settings=AUTO_LLAMA),
        '{"name": 7, "parameters": {}}',
        ('{"name": 7, "parameters": {}}', []),
    ),
    (
        plan("required"),
        '[{"name": "get_weather", "parameters": {"q": 1}}, {"name": "noop", "parameters": {}}]',
        (None, [("get_weather", '{"q": 1}'), ("noop", "{}")]),
    ),
    # required, cut short (max_tokens) before the first call's name: neither a call nor the
    # constrained JSON as content (it was content: '[{"name": "get_w')
    (plan("required"), '[{"name": "get_w', (None, [])),
    (
        plan("required"),
        '[{"name": "noop", "parameters": {}}, {"na',
        (None, [("noop", "{}")]),
    ),
    (
        plan({"type": "function", "function": {"name": "get_weather"}}),
        '{"city": "Oslo"}',
        (None, [("get_weather", '{"city": "Oslo"}')]),
    ),
    (plan("none"), HERMES_TEXT, (HERMES_TEXT, [])),
    # A call that turns malformed after its name was read stands as far as its arguments were
    # written, the rest dropped: a stream has sent its header by then. The whole text used to
    # fall back to content instead (found by review, 2026-12-06).
    # - arguments written as a JSON string (a common model habit): its text, as written
    (
        plan(),
        '<tool_call>{"name": "get_weather", "arguments": "{\\"a\\": 1}"}</tool_call> after',
        (None, [("get_weather", '"{\\"a\\": 1}"')]),
    ),
    # - text after the arguments inside the object
    (
        plan(),
        'Hm.<tool_call>{"name": "get_weather", "arguments": {"a": 1} "x"}</tool_call>',
        ("Hm.", [("get_weather", '{"a": 1}')]),
    ),
    (
        plan(settings=AUTO_LLAMA),
        '{"name": "get_weather", "parameters": {"a": 1}, oops}',
        (None, [("get_weather", '{"a": 1}')]),
    ),
]


@pytest.mark.parametrize("p,text,want", CASES)
def test_parsers(p, text, want):
    if not p.parses:
        assert want == (text, [])
        return
    assert one_shot(p, text) == want
    assert streamed(p, list(text)) == want  # one character at a time


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_split_gives_the_same_message(data):
    p, text, want = data.draw(st.sampled_from([c for c in CASES if c[0].parses]))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert streamed(p, pieces) == want


def test_ids_and_headers_come_once_per_call():
    s = plan().stream()
    outs = [s.feed(c) for c in HERMES_TEXT] + [s.finish()]
    headers = [tc for o in outs for tc in o.tool_calls if "id" in tc]
    assert [h["index"] for h in headers] == [0, 1]
    assert len({h["id"] for h in headers}) == 2
    assert all(h["type"] == "function" for h in headers)
    # the arguments begin in the header when they came before the name
    assert [h["function"]["arguments"] for h in headers] == ["", "{}"]
    _, calls = s.message()
    assert [c["id"] for c in calls] == [h["id"] for h in headers]


def test_required_schema_lists_every_tool():
    p = plan("required", parallel=False)
    assert p.schema["maxItems"] == 1 and p.schema["minItems"] == 1
    names = [alt["properties"]["name"]["enum"] for alt in p.schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["noop"]]
    assert p.schema["items"]["anyOf"][1]["properties"]["parameters"] == {
        "type": "object",
        "properties": {},
    }
    named = plan({"type": "function", "function": {"name": "get_weather"}})
    assert named.schema == {"type": "object"} and named.named == "get_weather"
    json.dumps(p.schema)


@pytest.mark.parametrize(
    "tools,choice,settings,constrained,param",
    [
        (TOOLS, None, ToolSettings(), False, "tool_choice"),  # auto needs the flags
        (None, "required", AUTO_HERMES, False, "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "x"}}, AUTO_HERMES, False, "tool_choice"),
        (TOOLS, "required", AUTO_HERMES, True, "tool_choice"),
        ([{"type": "code_interpreter"}], "none", AUTO_HERMES, False, "tools.0"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            "none",
            AUTO_HERMES,
            False,
            "tools.0",
        ),
    ],
)
def test_plan_errors_name_the_field(tools, choice, settings, constrained, param):
    with pytest.raises(InvalidRequestError) as e:
        plan_tools(tools, choice, None, settings, constrained=constrained)
    assert e.value.param == param


def test_settings_check_the_flags():
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ToolSettings(True, None)
    with pytest.raises(ValueError, match="choose from"):
        ToolSettings(True, "mistral-ish")
    none = plan_tools(
        TOOLS,
        "none",
        None,
        ToolSettings(exclude_tools_when_tool_choice_none=True),
        constrained=False,
    )
    assert none.tools is None and not none.parses
