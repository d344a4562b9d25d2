"""``/v1/responses``: the non-streaming body lists its output items in the order the model wrote
them, as the stream does (text after a call is a message item of its own). The body merged all
text into one message placed first (found by review, 2026-12-06)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from router.output import OutputParams, SampleDelta
from router.protocol import UsageInfo
from router.serving_responses import _body, _stream
from router.tool_calls import ToolSettings, plan_tools

pytestmark = pytest.mark.unit

TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]


class _Gen:
    """A generation whose one sample writes ``text`` a character at a time, or in the pieces
    given (one engine delta can carry several tokens: a decode worker merges queued outputs,
    speculative decoding accepts several per step)."""

    def __init__(self, text: str, pieces: list[str] | None = None) -> None:
        self.text = text
        self.pieces = pieces if pieces is not None else list(text)
        assert "".join(self.pieces) == text
        self.samples = [SimpleNamespace(index=0, text=text, finish_reason="stop", token_ids=[])]

    async def steps(self):
        for i, piece in enumerate(self.pieces):
            yield [SampleDelta(0, piece, (), "stop" if i == len(self.pieces) - 1 else None, None)]

    def usage(self) -> UsageInfo:
        return UsageInfo(prompt_tokens=1, completion_tokens=1, total_tokens=2)


def _items(output: list[dict]) -> list[tuple[str, str]]:
    return [
        ("message", i["content"][0]["text"]) if i["type"] == "message" else (i["type"], i["name"])
        for i in output
    ]


@pytest.mark.parametrize(
    "text, want",
    [
        (
            'Let me check.<tool_call>{"name": "get", "arguments": {"a": 1}}</tool_call>Done.',
            [("message", "Let me check."), ("function_call", "get"), ("message", "Done.")],
        ),
        (
            '<tool_call>{"name": "get", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "get", "arguments": {"b": 2}}</tool_call>',
            [("function_call", "get"), ("function_call", "get")],
        ),
        ("no call at all", [("message", "no call at all")]),
    ],
)
@pytest.mark.parametrize("split", ["chars", "whole", "two"])
def test_the_body_lists_the_items_as_the_stream_does(text, want, split):
    """Also with deltas of many characters: a delta spanning a call's end and the text after
    it raised KeyError mid-stream, or listed the text before the call (found by review)."""
    cut = text.find("}}") if "}}" in text else len(text) // 2
    pieces = {"chars": list(text), "whole": [text], "two": [text[:cut], text[cut:]]}[split]
    plan = plan_tools(TOOLS, "auto", None, ToolSettings(True, "hermes"), constrained=False)
    ctx = SimpleNamespace(model_name="m", metrics=SimpleNamespace(error=lambda status: None))
    body = json.loads(_body(ctx, plan, {}, _Gen(text), OutputParams(), {}, "r", 0).body)

    async def streamed() -> str:
        async def close() -> None:
            pass

        parts = []
        async for s in _stream(
            ctx, _Gen(text, pieces), OutputParams(), "r", 0, "", close, plan=plan, echo={}
        ):
            parts.append(s)
        return "".join(parts)

    raw = asyncio.run(streamed())
    final = [json.loads(ln[6:]) for ln in raw.splitlines() if ln.startswith("data: ")][-1]
    assert final["type"] == "response.completed"
    assert _items(final["response"]["output"]) == want
    assert _items(body["output"]) == want
