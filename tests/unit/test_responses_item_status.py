"""``/v1/responses`` cut by ``max_output_tokens``: the response is "incomplete", and so is the
output item that was being written (OpenAI's item status); the items finished before it stay
"completed". The router marked every item "completed" (found by review, 2026-12-06)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from router.output import OutputParams, SampleDelta
from router.serving_responses import _body, _stream
from router.tool_calls import ToolSettings, plan_tools
from tests.unit.test_responses_output_order import TOOLS, _Gen

pytestmark = pytest.mark.unit


class _CutGen(_Gen):
    """The sample's output ends with finish reason ``length`` (max_output_tokens)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.samples[0].finish_reason = "length"

    async def steps(self):
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield [SampleDelta(0, piece, (), "length" if last else None, None)]


@pytest.mark.parametrize(
    "text, want",
    [
        (  # the call's arguments cut short
            'Let me check.<tool_call>{"name": "get", "arguments": {"a": 1',
            [("message", "completed"), ("function_call", "incomplete")],
        ),
        (  # text after a finished call
            'Let me check.<tool_call>{"name": "get", "arguments": {}}</tool_call>Do',
            [("message", "completed"), ("function_call", "completed"), ("message", "incomplete")],
        ),
        ("just text, cut", [("message", "incomplete")]),
    ],
)
def test_the_item_cut_by_max_output_tokens_is_incomplete(text, want):
    plan = plan_tools(TOOLS, "auto", None, ToolSettings(True, "hermes"), constrained=False)
    ctx = SimpleNamespace(model_name="m", metrics=SimpleNamespace(error=lambda status: None))
    body = json.loads(_body(ctx, plan, {}, _CutGen(text), OutputParams(), {}, "r", 0).body)
    assert body["status"] == "incomplete"
    assert [(i["type"], i["status"]) for i in body["output"]] == want

    async def streamed() -> str:
        async def close() -> None:
            pass

        gen = _CutGen(text)
        parts = [
            s
            async for s in _stream(ctx, gen, OutputParams(), "r", 0, "", close, plan=plan, echo={})
        ]
        return "".join(parts)

    events = [
        json.loads(ln[6:]) for ln in asyncio.run(streamed()).splitlines() if ln.startswith("data: ")
    ]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["status"]) for i in done] == want
    assert events[-1]["type"] == "response.incomplete"
    assert [(i["type"], i["status"]) for i in events[-1]["response"]["output"]] == want
