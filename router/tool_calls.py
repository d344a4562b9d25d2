"""Tool calling at the HTTP edge: what a request's ``tools`` / ``tool_choice`` mean, and the
parsers that turn a choice's text into OpenAI ``tool_calls``, incrementally.

vLLM's semantics (``--enable-auto-tool-choice --tool-call-parser NAME``):

- ``tool_choice`` defaults to ``"auto"`` when ``tools`` are given, else ``"none"``;
- ``"none"``: the tools are rendered into the prompt, the output is plain content;
- ``"auto"``: needs the two flags; the model's own format is parsed (``hermes``: JSON objects
  between ``<tool_call>`` and ``</tool_call>``, text around them is content; ``llama3_json``: an
  output that is one or more JSON objects ``{"name": ..., "parameters": ...}`` separated by
  ``;``, after an optional ``<|python_tag|>``);
- ``"required"``: the output is constrained (xgrammar) to a JSON array of
  ``{"name": <one of the tools>, "parameters": <its schema>}`` objects, at least one (exactly one
  with ``parallel_tool_calls: false``), so it always parses;
- a named function: the output is constrained to that function's parameters schema and becomes
  its ``arguments``.

One :class:`ToolStream` per choice reads the text as it grows and yields content and tool-call
deltas in the OpenAI chunk shape; the non-streaming body runs the same machine over the whole
text, so a stream's deltas always add up to the non-streaming message. A call's ``arguments``
are the exact JSON text the model wrote for them. Whitespace-only content between or around
calls is dropped once any call was made.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.errors import InvalidRequestError

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
TOOL_CALL_PARSERS = (HERMES, LLAMA3_JSON)

_HERMES_OPEN = "<tool_call>"
_HERMES_CLOSE = "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_SCALAR_CHARS = frozenset("-+.0123456789eEtruefalsn")


@dataclass(frozen=True, slots=True)
class ToolSettings:
    """The router's tool flags (vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"--tool-call-parser {self.tool_call_parser!r}: choose from "
                + ", ".join(TOOL_CALL_PARSERS)
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


# ---- the request's plan -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools mean for its prompt, its constraint and its output."""

    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]] | None  # what the chat template renders (None: no tools)
    parser: str | None = None  # auto: the parser's name
    named: str | None = None  # named: the function
    schema: dict[str, Any] | None = None  # required / named: the output's JSON schema
    parallel: bool = True

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def stream(self) -> ToolStream:
        return ToolStream(self)


NO_TOOLS = ToolPlan("none", None)  # a request without tools


def check_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> the function's parameters schema; 400 naming the bad tool (also what
    ``/tokenize`` checks before rendering tools)."""
    out: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        param = f"tools.{i}"
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise InvalidRequestError(
                f"{param}: only tools of type 'function' are supported", param=param
            )
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequestError(f"{param}: function.name is required", param=param)
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise InvalidRequestError(
                f"{param}: function.parameters must be a JSON schema object", param=param
            )
        if fn["name"] in out:
            raise InvalidRequestError(f"{param}: two tools are named {fn['name']!r}", param=param)
        out[fn["name"]] = params
    return out


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    settings: ToolSettings,
    *,
    constrained: bool,
) -> ToolPlan:
    """The plan for one request; 400 (naming the field) for what cannot be served.
    ``constrained``: the request already constrains its output (response_format, ...)."""
    parallel = parallel_tool_calls is not False
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError(
                "tool_choice needs tools (the request has none)", param="tool_choice"
            )
        return ToolPlan("none", None, parallel=parallel)
    schemas = check_tools(tools)
    choice = tool_choice if tool_choice is not None else "auto"
    if choice == "none":
        rendered = None if settings.exclude_tools_when_tool_choice_none else tools
        return ToolPlan("none", rendered, parallel=parallel)
    if choice == "auto":
        if not settings.enable_auto_tool_choice or settings.tool_call_parser is None:
            raise InvalidRequestError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set (or send tool_choice 'none', 'required' or a named function)",
                param="tool_choice",
            )
        return ToolPlan("auto", tools, parser=settings.tool_call_parser, parallel=parallel)
    if constrained:
        raise InvalidRequestError(
            "tool_choice 'required' or a named function constrains the output itself: do not "
            "also send response_format / structured_outputs / guided_*",
            param="tool_choice",
        )
    if choice == "required":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
            }
            for name, schema in schemas.items()
        ]
        array: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        }
        if not parallel:
            array["maxItems"] = 1
        return ToolPlan("required", tools, schema=array, parallel=parallel)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError(
                "tool_choice must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        if name not in schemas:
            raise InvalidRequestError(
                f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
            )
        return ToolPlan("named", tools, named=name, schema=schemas[name], parallel=parallel)
    raise InvalidRequestError(
        f"tool_choice {choice!r} is not one of 'none', 'auto', 'required' or a named function",
        param="tool_choice",
    )


# ---- incremental JSON scanning ----------------------------------------------------------


class _Malformed(Exception):
    """The text is not the JSON the framing expects."""


class _ValueScan:
    """Where one JSON value that starts at ``start`` ends, resumable as the text grows."""

    __slots__ = ("_depth", "_esc", "_in_str", "_kind", "pos", "start")

    def __init__(self, start: int) -> None:
        self.start = self.pos = start
        self._kind = ""
        self._depth = 0
        self._in_str = False
        self._esc = False

    def advance(self, text: str, final: bool) -> int | None:
        """The index after the value, or None while the text ends inside it (``final``: the
        text will not grow, so a number at its very end is complete)."""
        i, n = self.pos, len(text)
        if i >= n:
            return None
        if not self._kind:
            c = text[i]
            if c in "{[":
                self._kind, self._depth = "nest", 1
            elif c == '"':
                self._kind, self._in_str = "str", True
            elif c in _SCALAR_CHARS:
                self._kind = "scalar"
                i -= 1
            else:
                raise _Malformed(f"unexpected {c!r}")
            i += 1
        while i < n:
            c = text[i]
            i += 1
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
                    if self._kind == "str":
                        self.pos = i
                        return i
                continue
            if self._kind == "scalar":
                if c not in _SCALAR_CHARS:
                    self.pos = i - 1
                    return i - 1
                continue
            if c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.pos = i
                    return i
        self.pos = i
        if final and self._kind == "scalar":
            return i
        return None


@dataclass(slots=True)
class _CallScan:
    """One ``{"name": ..., <args key>: ...}`` object, scanned as the text grows."""

    start: int
    args_keys: tuple[str, ...]
    pos: int = 0
    phase: str = "open"
    key: str = ""
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    end: int | None = None
    _value: _ValueScan | None = None

    def __post_init__(self) -> None:
        self.pos = self.start

    @property
    def args_upto(self) -> int | None:
        """The end of the arguments text seen so far (None: they have not begun)."""
        if self.args_end is not None or self.args_start is None:
            return self.args_end
        v = self._value
        if self.phase == "value" and v is not None and v.start == self.args_start:
            return v.pos
        return self.args_start

    def advance(self, text: str, final: bool) -> None:
        """Scan on; raises :class:`_Malformed`. ``end`` is set once the object closed."""
        n = len(text)
        while self.pos < n and self.end is None:
            c = text[self.pos]
            if self.phase in ("key", "value"):
                assert self._value is not None
                vend = self._value.advance(text, final)
                if vend is None:
                    return
                raw = text[self._value.start : vend]
                if self.phase == "key":
                    self.key = json.loads(raw)
                    self.phase = "colon"
                else:
                    self._value_done(raw, vend)
                    self.phase = "next"
                self.pos = vend
                continue
            if c.isspace():
                self.pos += 1
                continue
            if self.phase == "open":
                if c != "{":
                    raise _Malformed("a tool call is a JSON object")
                self.phase = "first"
            elif self.phase in ("first", "key_open"):
                if c == "}" and self.phase == "first":
                    self.end = self.pos + 1
                elif c == '"':
                    self._value = _ValueScan(self.pos)
                    self.phase = "key"
                    continue
                else:
                    raise _Malformed("expected a key")
            elif self.phase == "colon":
                if c != ":":
                    raise _Malformed("expected ':'")
                self.phase = "value_open"
            elif self.phase == "value_open":
                self._value = _ValueScan(self.pos)
                if self.key in self.args_keys and self.args_start is None:
                    self.args_start = self.pos
                self.phase = "value"
                continue
            elif self.phase == "next":
                if c == ",":
                    self.phase = "key_open"
                elif c == "}":
                    self.end = self.pos + 1
                else:
                    raise _Malformed("expected ',' or '}'")
            self.pos += 1

    def _value_done(self, raw: str, vend: int) -> None:
        try:
            value = json.loads(raw)
        except (json.JSONDecodeError, RecursionError) as e:
            raise _Malformed(f"bad JSON value: {e}") from None
        if self.key == "name":
            if not isinstance(value, str) or not value:
                raise _Malformed("the name must be a non-empty string")
            self.name = value
        elif self.key in self.args_keys and self.args_end is None and self.args_start is not None:
            if not isinstance(value, dict):
                raise _Malformed("the arguments must be a JSON object")
            self.args_end = vend


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (a tag maybe being written)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


# ---- the per-choice machine -------------------------------------------------------------


@dataclass(slots=True)
class _Call:
    index: int
    id: str
    scan: _CallScan | None
    name: str | None = None
    sent_args: int = 0  # characters of the arguments sent
    header_sent: bool = False
    arguments: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ToolDeltas:
    """What one piece of text produced: content and tool-call deltas (OpenAI chunk shape)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolStream:
    """One choice's text -> content and tool calls, fed as it grows (see the module doc)."""

    def __init__(self, plan: ToolPlan, call_id: Callable[[], str] = new_call_id) -> None:
        self.plan = plan
        self._call_id = call_id
        self.text = ""
        self.pos = 0  # next character to look at
        self.calls: list[_Call] = []
        self.content: list[str] = []  # content sent
        self._calls_at: list[int] = []  # per content piece: how many calls were sent before it
        self._held = ""  # trailing whitespace of the content, sent only if content follows
        self._out = ToolDeltas()
        self._state = {
            "auto": "content" if plan.parser == HERMES else "detect",
            "required": "array_open",
            "named": "named",
        }.get(plan.mode, "passthrough")
        self._args_keys: tuple[str, ...] = (
            ("parameters",) if plan.mode == "required" else ("arguments",)
        )
        if plan.parser == LLAMA3_JSON:
            self._args_keys = ("parameters", "arguments")
        self._call_start = 0  # where the current call's text began (its tag, for hermes)

    # ---- public ---------------------------------------------------------------------
    @property
    def called(self) -> bool:
        return any(c.header_sent for c in self.calls)

    def feed(self, piece: str, last: bool = False) -> ToolDeltas:
        """The deltas ``piece`` completes; ``last``: the text ends with it (what was held
        back is flushed, as :meth:`finish` does)."""
        self.text += piece
        self._run(final=False)
        if last:
            self._flush()
        return self._take()

    def finish(self) -> ToolDeltas:
        """The text is complete: flush what was held back."""
        return self.feed("", last=True)

    def _flush(self) -> None:
        self._run(final=True)
        if self._state in ("detect", "content") and self.pos < len(self.text):
            self._content(self.text[self.pos :])
            self.pos = len(self.text)
        if self._held and not self.called:
            self._out.content += self._held
            self.content.append(self._held)
            self._calls_at.append(0)
        self._held = ""

    def message(self) -> tuple[str | None, list[dict[str, Any]]]:
        """The non-streaming message's content (None when empty) and tool calls."""
        content = "".join(self.content)
        calls = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": "".join(c.arguments)},
            }
            for c in self.calls
            if c.header_sent
        ]
        return (content or None), calls

    def items(self) -> list[tuple[str, Any]]:
        """The output in the order it was written, as a stream sends it: ``("text", str)``
        for each run of content between calls, ``("call", <call as in message()>)`` for each
        call (the Responses API's output items)."""
        _, calls = self.message()
        out: list[tuple[str, Any]] = []
        for k in range(len(calls) + 1):
            text = "".join(p for p, at in zip(self.content, self._calls_at, strict=True) if at == k)
            if text:
                out.append(("text", text))
            if k < len(calls):
                out.append(("call", calls[k]))
        return out

    # ---- the machine ----------------------------------------------------------------
    def _take(self) -> ToolDeltas:
        out, self._out = self._out, ToolDeltas()
        return out

    def _content(self, s: str) -> None:
        if not s:
            return
        s = self._held + s
        body = s.rstrip()
        self._held = s[len(body) :]
        if body:
            self._out.content += body
            self.content.append(body)
            self._calls_at.append(sum(1 for c in self.calls if c.header_sent))

    def _revert(self) -> None:
        """The current call was not one: its text goes out as content."""
        if self.plan.parser == HERMES:
            self._content(_HERMES_OPEN)
            self.pos = self._call_start + len(_HERMES_OPEN)
            self._state = "content"
        elif self.called or self.plan.mode == "required":
            # after a call the rest is dropped; and the output ``required`` constrains is
            # never content: cut short (max_tokens) before the first call's name, it is no
            # call and no text (vLLM's stream sends it as neither)
            self.pos = len(self.text)
            self._state = "ignore"
        else:  # llama3_json: the whole output is text
            self._content(self.text[self._call_start :])
            self.pos = len(self.text)
            self._state = "passthrough"

    def _run(self, final: bool) -> None:
        text = self.text
        while True:
            st = self._state
            if st == "passthrough":
                self._content(text[self.pos :])
                self.pos = len(text)
                return
            if st == "ignore":
                self.pos = len(text)
                return
            if st == "named":
                self._named()
                return
            if st == "content":
                rest = text[self.pos :]
                k = rest.find(_HERMES_OPEN)
                if k < 0:
                    keep = 0 if final else _partial_suffix(rest, _HERMES_OPEN)
                    self._content(rest[: len(rest) - keep])
                    self.pos = len(text) - keep
                    return
                self._content(rest[:k])
                self._call_start = self.pos + k
                self.pos += k + len(_HERMES_OPEN)
                self._open_call()
                continue
            if st == "detect":  # llama3_json: JSON (maybe after the python tag) or text
                rest = text[self.pos :].lstrip()
                if not rest:
                    return
                if rest.startswith(_PYTHON_TAG):
                    self._call_start = self.pos
                    self.pos = text.index(_PYTHON_TAG, self.pos) + len(_PYTHON_TAG)
                    self._state = "objects"
                    continue
                if _PYTHON_TAG.startswith(rest) and not final:
                    return
                if rest[0] == "{":
                    self._call_start = self.pos
                    self._state = "objects"
                    continue
                self._state = "passthrough"
                continue
            if st in ("objects", "array_item"):
                i = self._skip_ws(self.pos)
                if i >= len(text):
                    return
                self.pos = i
                self._open_call()
                continue
            if st == "call":
                if not self._advance_call(final):
                    return
                continue
            if st == "after_call":  # hermes: the closing tag
                i = self._skip_ws(self.pos)
                rest = text[i:]
                if rest.startswith(_HERMES_CLOSE):
                    self.pos = i + len(_HERMES_CLOSE)
                    self._state = "content" if self.plan.parallel else "ignore"
                    continue
                if not final and _HERMES_CLOSE.startswith(rest):
                    return
                self.pos = i
                self._state = "content" if self.plan.parallel else "ignore"
                continue
            if st == "separator":  # llama3_json ';' / required ',' or ']'
                i = self._skip_ws(self.pos)
                if i >= len(text):
                    return
                c = text[i]
                self.pos = i + 1
                sep = ";" if self.plan.parser == LLAMA3_JSON else ","
                if c == sep and self.plan.parallel:
                    self._state = "objects" if sep == ";" else "array_item"
                else:
                    self._state = "ignore"
                continue
            if st == "array_open":
                i = self._skip_ws(self.pos)
                if i >= len(text):
                    return
                if text[i] != "[":
                    self._state = "ignore"
                    continue
                self.pos = i + 1
                self._state = "array_item"
                continue
            raise AssertionError(st)

    def _skip_ws(self, i: int) -> int:
        text = self.text
        while i < len(text) and text[i].isspace():
            i += 1
        return i

    def _open_call(self) -> None:
        self.calls.append(
            _Call(len(self.calls), self._call_id(), _CallScan(self.pos, self._args_keys))
        )
        self._state = "call"

    def _advance_call(self, final: bool) -> bool:
        """Scan the current call on; True when it ended (the state moved on)."""
        call = self.calls[-1]
        scan = call.scan
        assert scan is not None
        try:
            scan.advance(self.text, final)
        except (_Malformed, json.JSONDecodeError):
            if scan.name is None:  # never a call (no header can have gone out)
                self.calls.pop()
                self._revert()
                return True
            # Its name was read: a stream may have sent its header (and part of its arguments)
            # already, so the call stands as far as its arguments were written, and the rest
            # of the text is dropped. The whole text gives the same message (module doc),
            # whatever pieces a stream had.
            self._send_call(call, scan)
            self._state = "ignore"
            return True
        self._send_call(call, scan)
        if scan.end is None:
            if not final:
                return False
            if call.header_sent:  # cut short (max_tokens): what was sent stands
                self._state = "ignore"
            else:
                self.calls.pop()
                self._revert()
            return True
        if not call.header_sent:  # a complete object without a name: not a call
            self.calls.pop()
            self._revert()
            return True
        if scan.args_start is None:
            self._args(call, "{}")
        self.pos = scan.end
        self._state = "after_call" if self.plan.parser == HERMES else "separator"
        return True

    def _send_call(self, call: _Call, scan: _CallScan) -> None:
        """The call's header once its name is known, then its arguments as far as scanned."""
        if scan.name is not None and not call.header_sent:
            call.name = scan.name
            call.header_sent = True
            self._held = ""  # whitespace before a call is not content
            call.index = sum(1 for c in self.calls if c.header_sent) - 1
            self._out.tool_calls.append(
                {
                    "index": call.index,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
            )
        upto = scan.args_upto
        if call.header_sent and scan.args_start is not None and upto is not None:
            piece = self.text[scan.args_start + call.sent_args : upto]
            if piece:
                self._args(call, piece)

    def _args(self, call: _Call, piece: str) -> None:
        call.sent_args += len(piece)
        call.arguments.append(piece)
        out = self._out.tool_calls
        if out and out[-1]["index"] == call.index:
            out[-1]["function"]["arguments"] += piece
        else:
            out.append({"index": call.index, "function": {"arguments": piece}})

    def _named(self) -> None:
        """The whole output is the named function's arguments."""
        if not self.calls:
            call = _Call(0, self._call_id(), None, name=self.plan.named, header_sent=True)
            self.calls.append(call)
            self._out.tool_calls.append(
                {
                    "index": 0,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
            )
        piece = self.text[self.pos :]
        self.pos = len(self.text)
        if piece:
            self._args(self.calls[0], piece)


def parse_all(plan: ToolPlan, texts: Sequence[str]) -> list[ToolStream]:
    """The non-streaming case: one finished machine per choice."""
    out = []
    for t in texts:
        s = plan.stream()
        s.feed(t, last=True)
        out.append(s)
    return out
