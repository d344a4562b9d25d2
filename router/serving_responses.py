"""``POST /v1/responses``: OpenAI's Responses API for text and function calls, on the chat path.

A request becomes a chat completion request: ``instructions`` the system message, ``input``
(a string, or items: messages with text parts, ``function_call`` and
``function_call_output``) the conversation, Responses-style ``tools`` (``{"type": "function",
"name", "parameters"}``) and ``tool_choice`` the chat forms, ``text.format`` the
``response_format``, ``max_output_tokens`` the completion budget. Generation, tool parsing
(``router/tool_calls.py``) and constrained decoding are the chat path's own. The output is a
list of items: a ``message`` with one ``output_text`` part for the content and one
``function_call`` per call. Streaming sends the Responses events (``response.created``,
``response.output_item.added``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ..., ``response.completed``), each with its
``sequence_number``.

Responses are not stored (``previous_response_id`` is refused with a 400); built-in tools
(web search, file search, ...), non-text inputs and reasoning items are refused naming the item.
The chat path's errors name the Responses request's parameters (``max_output_tokens``,
``text.format``, ``input.K``), not the chat form's.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, NamedTuple

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from router.context import ServingContext
from router.errors import InvalidRequestError, RouterError
from router.generation import Generation
from router.output import OutputParams, TokenEntry
from router.protocol import ChatCompletionRequest, ResponsesRequest
from router.serving import serve, warn_unknown_fields
from router.serving_chat import part_text, prepare_chat
from router.tool_calls import ToolPlan, ToolStream, parse_all

_SAMPLING_EXTRAS = ("top_k", "min_p", "repetition_penalty", "seed", "priority", "cache_salt")


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


# an input message's text parts; a refusal (an earlier answer's output item) is text, as the
# chat path's (router.serving_chat.part_text)
_TEXT_FIELDS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


def _text_of(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("content must be a string or a list of text parts", param)
    texts = []
    for j, part in enumerate(content):
        text = part_text(part, _TEXT_FIELDS)
        if text is None:
            kind = part.get("type") if isinstance(part, dict) else None
            raise _bad(
                f"content parts of type {kind!r} are not supported (text and refusal only)",
                f"{param}.{j}",
            )
        texts.append(text)
    return "\n".join(texts)


class _Origin(NamedTuple):
    """Where a chat message came from in the Responses request: errors name that."""

    item: str  # "instructions", "input" or "input.K"
    content: str  # the field holding its text
    calls: list[str]  # an assistant message's tool calls: their function_call items


def to_messages(req: ResponsesRequest) -> tuple[list[dict[str, Any]], list[_Origin]]:
    """``instructions`` + ``input`` as chat messages (consecutive function calls become one
    assistant message with several tool calls), and each message's origin."""
    messages: list[dict[str, Any]] = []
    origins: list[_Origin] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
        origins.append(_Origin("instructions", "instructions", []))
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        origins.append(_Origin("input", "input", []))
        return messages, origins
    for i, item in enumerate(req.input):
        param = f"input.{i}"
        if not isinstance(item, dict):
            raise _bad("input items must be objects", param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"role {role!r} is not supported", f"{param}.role")
            messages.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _text_of(item.get("content"), f"{param}.content"),
                }
            )
            origins.append(_Origin(param, f"{param}.content", []))
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "{}")
            call_id = item.get("call_id") or item.get("id")
            if (
                not isinstance(name, str)
                or not isinstance(args, str)
                or not isinstance(call_id, str)
            ):
                raise _bad(
                    "a function_call item needs call_id, name and arguments (strings)", param
                )
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
                origins[-1].calls.append(param)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(_Origin(param, param, [param]))
        elif kind == "function_call_output":
            output, call_id = item.get("output"), item.get("call_id")
            if not isinstance(call_id, str):
                raise _bad("a function_call_output item needs call_id", param)
            text = output if isinstance(output, str) else _text_of(output, f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
            origins.append(_Origin(param, f"{param}.output", []))
        else:
            raise _bad(f"input items of type {kind!r} are not supported", param)
    if not messages:
        raise _bad("input must not be empty", "input")
    return messages, origins


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"tools of type {kind!r} are not supported (function only)", f"tools.{i}")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise _bad(
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "name": ...}',
            "tool_choice",
        )
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {
            "type": "json_schema",
            "json_schema": {
                "name": fmt.get("name", "response"),
                "schema": fmt.get("schema"),
                "strict": fmt.get("strict"),
            },
        }
    raise _bad(f"text.format type {kind!r} is not supported", "text.format")


def to_chat_request(req: ResponsesRequest) -> tuple[ChatCompletionRequest, list[_Origin]]:
    """The chat completion request this Responses request means, and its messages' origins;
    400 for what it cannot."""
    if req.previous_response_id is not None:
        raise _bad(
            "previous_response_id is not supported: this server does not store responses "
            "(send the whole conversation in input)",
            "previous_response_id",
        )
    if req.background:
        raise _bad("background responses are not supported", "background")
    if req.truncation not in (None, "disabled"):
        raise _bad("truncation 'auto' is not supported", "truncation")
    if req.top_logprobs:
        raise _bad("top_logprobs is not supported on /v1/responses", "top_logprobs")
    if req.include:
        raise _bad(f"include {req.include!r} is not supported", "include")
    messages, origins = to_messages(req)
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "tools": _chat_tools(req.tools),
        "tool_choice": _chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "response_format": _response_format(req.text),
        "user": req.user,
    }
    for k in _SAMPLING_EXTRAS:
        fields[k] = getattr(req, k)
    try:
        chat = ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        text_format = fields["response_format"] is not None
        raise _responses_error(_bad(f"{loc}: {err['msg']}", loc), origins, text_format) from None
    return chat, origins


# the chat form's names in its checks' errors -> the Responses request's own
_RENAMED = (
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format", "text.format"),
    ("json_schema.schema", "schema"),
    ("function.name", "name"),
    ("function.parameters", "parameters"),
)


def _responses_param(param: str, origins: list[_Origin], text_format: bool) -> str:
    """The Responses parameter a chat-form error's ``param`` stands for."""
    head, _, rest = param.partition(".")
    if head == "structured_outputs":  # text.format's schema, or the tool plan's (tool_choice)
        return "text.format" if text_format else "tools"
    if head == "tools":  # the function's fields sit at the tool's top level
        return param.replace(".function.", ".").removesuffix(".function")
    if head != "messages":
        return dict(_RENAMED).get(head, head) + (f".{rest}" if rest else "")
    index, _, field = rest.partition(".")
    if not index.isdigit() or int(index) >= len(origins):
        return "input"
    origin = origins[int(index)]
    if field.startswith("tool_calls."):
        call, _, tail = field.removeprefix("tool_calls.").partition(".")
        if not call.isdigit() or int(call) >= len(origin.calls):
            return origin.item
        return origin.calls[int(call)] + (".arguments" if "arguments" in tail else "")
    return origin.content if field.startswith("content") else origin.item


def _responses_error(
    e: InvalidRequestError, origins: list[_Origin], text_format: bool
) -> InvalidRequestError:
    """``e``, raised by the chat path's checks, naming the Responses request's parameters:
    a client of /v1/responses never sent max_completion_tokens or messages."""
    if e.param is None:
        return e
    param = _responses_param(e.param, origins, text_format)
    message = e.message.replace(e.param, param) if "." in e.param else e.message
    for chat_name, name in _RENAMED:
        message = message.replace(chat_name, name)
    return InvalidRequestError(message, param=param, code=e.code, headers=e.headers)


async def create_response(ctx: ServingContext, req: ResponsesRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    warn_unknown_fields(req)
    ctx.check_model(req.model)
    chat, origins = to_chat_request(req)
    echo = _echo(req)
    try:
        plan, prompts = await prepare_chat(ctx, chat)
        return await serve(
            ctx,
            chat,
            raw,
            prompts,
            arrival,
            "resp_",  # OpenAI's Responses ids: resp_…, as its items' msg_… and fc_…
            functools.partial(_stream, plan=plan, echo=echo),
            lambda *a: _body(ctx, plan, echo, *a),
        )
    except InvalidRequestError as e:
        raise _responses_error(e, origins, chat.response_format is not None) from None


def _echo(req: ResponsesRequest) -> dict[str, Any]:
    """The request's settings as a response object repeats them."""
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [],
        "text": req.text or {"format": {"type": "text"}},
        "truncation": "disabled",
        "store": False,
        "user": req.user,
    }


def _usage(gen: Generation) -> dict[str, Any]:
    u = gen.usage()
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
    }


def _response(
    ctx: ServingContext,
    echo: dict[str, Any],
    response_id: str,
    created: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    incomplete = status == "incomplete"
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "model": ctx.model_name,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": output,
        "usage": usage,
        **echo,
    }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": "fc_" + call["id"].removeprefix("call_"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _body(
    ctx: ServingContext,
    plan: ToolPlan,
    echo: dict[str, Any],
    gen: Generation,
    params: OutputParams,
    entries: dict[int, list[TokenEntry]],
    request_id: str,
    created: int,
) -> JSONResponse:
    sample = gen.samples[0]
    items: list[tuple[str, Any]] = (
        parse_all(plan, [sample.text])[0].items() if plan.parses else [("text", sample.text)]
    )
    status = _status(sample.finish_reason)
    kept = [(kind, x) for kind, x in items if x]
    # in the order written, as the stream's items are: text after a call is a message of its
    # own. The last one was being written when the output ended: "incomplete" with the
    # response when max_output_tokens cut it (OpenAI's item status), the others complete
    output: list[dict[str, Any]] = []
    for j, (kind, x) in enumerate(kept):
        item_status = status if j == len(kept) - 1 else "completed"
        output.append(
            _message_item(_new_id("msg"), x, item_status)
            if kind == "text"
            else _call_item(x, item_status)
        )
    body = _response(ctx, echo, request_id, created, status, output, _usage(gen))
    return JSONResponse(body)


class _Events:
    """Formats the Responses stream's events, numbering them."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(
    ctx: ServingContext,
    gen: Generation,
    params: OutputParams,
    request_id: str,
    created: int,
    usage_mode: str,
    close: Callable[[], Awaitable[None]],
    *,
    plan: ToolPlan,
    echo: dict[str, Any],
) -> AsyncGenerator[str, None]:
    ev = _Events()
    tools: ToolStream | None = plan.stream() if plan.parses else None
    output: list[dict[str, Any]] = []  # finished items
    text_item: dict[str, Any] | None = None  # the message item being written
    call_items: dict[int, dict[str, Any]] = {}  # tool-call index -> its item (being written)

    def response(status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return _response(ctx, echo, request_id, created, status, list(output), usage)

    # an item is closed "completed" when the next one starts; the one still open at the end
    # takes the response's status ("incomplete": max_output_tokens cut it, as OpenAI's)
    def close_text(status: str = "completed") -> str:
        nonlocal text_item
        if text_item is None:
            return ""
        item, text_item = text_item, None
        idx, text = item["index"], item["text"]
        done = _message_item(item["id"], text, status)
        part = done["content"][0]
        output.append(done)
        return (
            ev("response.output_text.done", item_id=item["id"], output_index=idx,
               content_index=0, text=text, logprobs=[])
            + ev("response.content_part.done", item_id=item["id"], output_index=idx,
                 content_index=0, part=part)
            + ev("response.output_item.done", output_index=idx, item=done)
        )  # fmt: skip

    def close_calls(status: str = "completed") -> str:
        out = []
        for i in sorted(call_items):
            item = call_items.pop(i)
            idx = item.pop("output_index")
            item["status"] = status
            output.append(item)
            out.append(
                ev("response.function_call_arguments.done", item_id=item["id"],
                   output_index=idx, name=item["name"], arguments=item["arguments"])
                + ev("response.output_item.done", output_index=idx, item=item)
            )  # fmt: skip
        return "".join(out)

    def text_delta(piece: str) -> str:
        nonlocal text_item
        if not piece:
            return ""
        head = ""
        if text_item is None:
            head = close_calls()
            idx = len(output)
            text_item = {"id": _new_id("msg"), "index": idx, "text": ""}
            head += ev(
                "response.output_item.added",
                output_index=idx,
                item={**_message_item(text_item["id"], "", "in_progress"), "content": []},
            ) + ev(
                "response.content_part.added",
                item_id=text_item["id"],
                output_index=idx,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            )
        text_item["text"] += piece
        return head + ev(
            "response.output_text.delta",
            item_id=text_item["id"],
            output_index=text_item["index"],
            content_index=0,
            delta=piece,
            logprobs=[],
        )

    def call_deltas(deltas: list[dict[str, Any]]) -> str:
        out = []
        for d in deltas:
            if "id" in d:
                out.append(close_text() + close_calls())
                call = {"id": d["id"], "function": {"name": d["function"]["name"], "arguments": ""}}
                item = {**_call_item(call, "in_progress"), "output_index": len(output)}
                call_items[d["index"]] = item
                added = {k: v for k, v in item.items() if k != "output_index"}
                out.append(ev("response.output_item.added", output_index=len(output), item=added))
            piece = d["function"].get("arguments", "")
            if piece:
                item = call_items[d["index"]]
                item["arguments"] += piece
                out.append(
                    ev("response.function_call_arguments.delta", item_id=item["id"],
                       output_index=item["output_index"], delta=piece)
                )  # fmt: skip
        return "".join(out)

    try:
        yield ev("response.created", response=response("in_progress")) + ev(
            "response.in_progress", response=response("in_progress")
        )
        finish: str | None = None
        async for deltas in gen.steps():
            parts = []
            for d in deltas:
                if tools is None:
                    parts.append(text_delta(d.text))
                else:
                    # a character at a time: one feed's result holds its content and its call
                    # deltas apart, so a delta of several tokens spanning a call's end and the
                    # text after it lost their order (items out of order, or arguments sent to
                    # a call already closed: KeyError mid-stream); a character's result is in
                    # written order
                    text, end = d.text, d.finish_reason is not None
                    for i in range(max(1, len(text))):
                        out = tools.feed(text[i : i + 1], last=end and i >= len(text) - 1)
                        parts.append(text_delta(out.content) + call_deltas(out.tool_calls))
                if d.finish_reason is not None:
                    finish = d.finish_reason
            if chunk := "".join(parts):
                yield chunk
        status = _status(finish)
        tail = close_text(status) + close_calls(status)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        yield tail + ev(kind, response=response(status, _usage(gen)))
    except RouterError as e:
        ctx.metrics.error(e.status)
        err = e.to_dict()["error"]
        yield ev("error", code=err["code"], message=err["message"], param=err["param"])
    finally:
        await close()
