"""``POST /v1/chat/completions``: messages -> chat template -> tokens -> OpenAI chat completion.

The template is the model's own (``router/chat_template.py``); the rendered prompt already
holds BOS, so it is encoded WITHOUT special tokens (unless ``add_special_tokens``). Message
content may be a string or a list of text parts (joined with newlines; a refusal part is text,
as vLLM's); other part types are refused. Streaming sends, per choice, a role chunk
(``{"role": "assistant", "content": ""}``) right before its first content, then content
deltas, the finish reason, an optional usage chunk with ``choices: []``, and ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from router.body import lone_surrogate
from router.chat_template import ChatTemplateError
from router.context import ServingContext
from router.errors import InvalidRequestError, OverloadedError
from router.generation import Generation
from router.logprobs import chat_logprobs, vllm_prompt_logprobs
from router.output import OutputParams, SampleDelta, TokenEntry
from router.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
)
from router.sampling import (
    check_json_depth,
    check_unsupported,
    structured_outputs,
    validate_common,
)
from router.serving import ChunkFrame, serve, stream_steps, truncate_prompt, warn_unknown_fields
from router.sse import json_str
from router.tool_calls import NO_TOOLS, ToolPlan, ToolStream, parse_all, plan_tools
from shared.daemon_pool import DaemonPool, PoolBusyError

# a part's text by its type: a refusal part (an earlier assistant answer's, as OpenAI returns
# it) is text for the template, as vLLM's chat_utils parses it
_TEXT_FIELDS = {"text": "text", "input_text": "text", "refusal": "refusal"}


def part_text(part: Any, kinds: dict[str, str] = _TEXT_FIELDS) -> str | None:
    """The text of a content part of one of ``kinds`` (type -> the field holding its text);
    None for any other part."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    field = kinds.get(kind) if isinstance(kind, str) else None
    text = part.get(field) if field is not None else None
    return text if isinstance(text, str) else None


def template_messages(
    messages: list[ChatMessage], max_json_depth: int = 64
) -> list[dict[str, Any]]:
    """Messages as the template sees them: text content flattened, tool-call args parsed."""
    out = []
    for i, m in enumerate(messages):
        check_json_depth(m.content, max_json_depth, f"messages.{i}.content")
        check_json_depth(m.tool_calls, max_json_depth, f"messages.{i}.tool_calls")
        check_json_depth(m.model_extra, max_json_depth, f"messages.{i}")
        d = m.model_dump(exclude_none=True)
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                text = part_text(part)
                if text is None:
                    kind = part.get("type") if isinstance(part, dict) else None
                    raise InvalidRequestError(
                        f"messages[{i}]: content parts of type {kind!r} are not supported "
                        "(text and refusal only)",
                        param=f"messages.{i}.content",
                    )
                texts.append(text)
            d["content"] = "\n".join(texts)
        for j, call in enumerate(d.get("tool_calls") or ()):
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    args = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    continue  # templates render the string as it is
                except RecursionError:
                    args = None
                param = f"messages.{i}.tool_calls.{j}.function.arguments"
                if args is None:
                    raise InvalidRequestError(f"{param} nests too deeply", param=param)
                check_json_depth(args, max_json_depth, param)
                # an escaped lone surrogate in the string is a real one once parsed
                if (where := lone_surrogate(args)) is not None:
                    raise InvalidRequestError(
                        f"{param}{'.' + where if where else ''} holds a lone UTF-16 surrogate, "
                        "which is not valid Unicode text",
                        param=param,
                    )
                fn["arguments"] = args
        out.append(d)
    return out


async def render_chat_prompt(
    ctx: ServingContext,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    add_special_tokens: bool,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    kwargs: dict[str, Any] | None = None,
    chat_template: str | None = None,
) -> list[int]:
    if not messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    template, kwargs = request_chat_template(ctx, chat_template, kwargs)

    def render() -> str:
        return ctx.tokenizer.apply_chat_template(
            template_messages(messages, ctx.limits.max_json_depth),
            template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            kwargs=kwargs,
        )

    try:
        # flattening and rendering are Python (Jinja), per message: off the loop for long
        # conversations (the GIL still gives the loop its turns between bytecodes), and for
        # a request's own template, whose cost nobody here knows
        if template is not None:  # a request's own: its time is bounded, its thread a daemon
            text = await _render_request_template(render)
        elif (
            len(messages) > 64
            or sum(len(m.content) if isinstance(m.content, str) else 64 for m in messages) > 8192
        ):
            text = await asyncio.to_thread(render)
        else:
            text = render()
    except ChatTemplateError as e:
        param = "chat_template" if template is not None else "messages"
        raise InvalidRequestError(str(e), param=param) from e
    return await ctx.encode(text, add_special_tokens)


#: The longest a request's own chat template may render (``--trust-request-chat-template``):
#: Jinja's sandbox bounds what a template may touch, not how long it loops.
REQUEST_TEMPLATE_TIMEOUT_S = 10.0
_template_pool: DaemonPool | None = None


async def _render_request_template(render: Callable[[], str]) -> str:
    """``render()`` on a daemon thread, for at most ``REQUEST_TEMPLATE_TIMEOUT_S``: a render
    cannot be interrupted, and one that never ends must hold neither a thread asyncio's
    default executor needs (tokenizing, building responses) nor the router's exit."""
    global _template_pool
    if _template_pool is None:
        _template_pool = DaemonPool(2, "pdserve-template", max_queued=8)
    try:
        fut = asyncio.get_running_loop().run_in_executor(_template_pool, render)
    except PoolBusyError as e:  # both threads stuck in long renders, 8 more waiting
        raise OverloadedError(f"request chat templates at capacity ({e})") from None
    try:
        return await asyncio.wait_for(fut, REQUEST_TEMPLATE_TIMEOUT_S)
    except TimeoutError:
        raise InvalidRequestError(
            f"chat_template did not render within {REQUEST_TEMPLATE_TIMEOUT_S:g} s",
            param="chat_template",
        ) from None


def request_chat_template(
    ctx: ServingContext, chat_template: str | None, kwargs: dict[str, Any] | None
) -> tuple[str | None, dict[str, Any] | None]:
    """The request's own template (``chat_template``, or ``chat_template_kwargs``'s
    ``chat_template`` key as ``transformers`` takes it) and the kwargs left for the template.
    Refused unless the router trusts request templates (vLLM's rule and message)."""
    in_kwargs = kwargs.get("chat_template") if kwargs else None
    if chat_template is None and in_kwargs is None:
        return None, kwargs
    if not ctx.trust_request_chat_template:
        raise InvalidRequestError(
            "Chat template is passed with request, but --trust-request-chat-template is not "
            "set. Refused request with untrusted chat template.",
            param="chat_template",
        )
    template = chat_template if chat_template is not None else in_kwargs
    if not isinstance(template, str):
        raise InvalidRequestError(
            "chat_template_kwargs.chat_template must be a string", param="chat_template_kwargs"
        )
    rest = {k: v for k, v in (kwargs or {}).items() if k != "chat_template"}
    return template, rest


async def create_chat_completion(
    ctx: ServingContext, req: ChatCompletionRequest, raw: Request
) -> Response:
    arrival = time.monotonic()
    warn_unknown_fields(req)
    ctx.check_model(req.model)
    plan, prompts = await prepare_chat(ctx, req)
    role, echo = response_role(req), ""
    if req.echo and req.messages[-1].role == role:
        echo = message_text(req.messages[-1].content)
    return await serve(
        ctx,
        req,
        raw,
        prompts,
        arrival,
        "chatcmpl-",
        functools.partial(_stream, plan=plan, role=role, echo=echo),
        lambda *a: _body(ctx, plan, role, echo, *a),
    )


def response_role(req: ChatCompletionRequest) -> str:
    """The answer's role, as vLLM names it: the assistant's after a generation prompt, else
    (the model continuing a message) the last message's."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


def message_text(content: str | list[dict[str, Any]] | None) -> str:
    """A message's text: its string, or its text parts joined by newlines (what ``echo``
    repeats; the parts were checked when the prompt was rendered)."""
    if isinstance(content, list):
        # text and refusal parts only (template_messages)
        return "\n".join(part_text(p) or "" for p in content)
    return content or ""


async def prepare_chat(
    ctx: ServingContext, req: ChatCompletionRequest
) -> tuple[ToolPlan, list[list[int]]]:
    """A chat request's checks, tool plan and rendered prompt (also the chat form of a
    ``/v1/responses`` request)."""
    check_unsupported(req)
    validate_common(req, ctx.limits)
    plan = chat_tool_plan(ctx, req)
    ids = await render_chat_prompt(
        ctx,
        req.messages,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        add_special_tokens=req.add_special_tokens,
        tools=plan.tools,
        documents=req.documents,
        kwargs=req.chat_template_kwargs,
        chat_template=req.chat_template,
    )
    return plan, [
        truncate_prompt(
            ids, req.truncate_prompt_tokens, ctx.limits.max_model_len, req.truncation_side
        )
    ]


def chat_tool_plan(ctx: ServingContext, req: ChatCompletionRequest) -> ToolPlan:
    """The request's tool plan; for ``required`` / a named function, the request's output
    constraint becomes the plan's JSON schema."""
    plan = plan_tools(
        req.tools,
        req.tool_choice,
        req.parallel_tool_calls,
        ctx.tools,
        constrained=structured_outputs(req) is not None,
    )
    if plan.schema is not None:
        req.structured_outputs = {"json": plan.schema}
        structured_outputs(req)  # the schema's size limit
    return plan


def tool_finish_reason(plan: ToolPlan, tools: ToolStream, finish_reason: str | None) -> str | None:
    """OpenAI's ``tool_calls`` for a choice that ended by calling tools (a named function's
    choice keeps ``stop``, as OpenAI's does)."""
    if finish_reason == "stop" and tools.called and plan.mode != "named":
        return "tool_calls"
    return finish_reason


def _body(
    ctx: ServingContext,
    plan: ToolPlan,
    role: str,
    echo: str,
    gen: Generation,
    params: OutputParams,
    entries: dict[int, list[TokenEntry]],
    request_id: str,
    created: int,
) -> JSONResponse:
    parsed = parse_all(plan, [s.text for s in gen.samples]) if plan.parses else None
    choices = []
    for s in gen.samples:
        message = ChatResponseMessage(role=role, content=echo + s.text)
        finish = s.finish_reason
        if parsed is not None:
            tools = parsed[s.index]
            content, calls = tools.message()
            if echo:
                content = echo + (content or "")
            message = ChatResponseMessage(role=role, content=content, tool_calls=calls)
            finish = tool_finish_reason(plan, tools, finish)
        choices.append(
            ChatChoice(
                index=s.index,
                message=message,
                finish_reason=finish,
                stop_reason=s.stop_reason,
                token_ids=s.token_ids if params.return_token_ids else None,
                logprobs=ChatChoiceLogprobs(**chat_logprobs(ctx, params, entries.get(s.index, [])))
                if params.logprobs is not None
                else None,
            )
        )
    body = ChatCompletionResponse(
        id=request_id,
        created=created,
        model=ctx.model_name,
        choices=choices,
        usage=gen.usage(),
        prompt_logprobs=vllm_prompt_logprobs(
            ctx, params, gen.prompts[0], gen.streams[0].prompt_logprobs
        )
        if params.prompt_logprobs is not None
        else None,
        prompt_token_ids=gen.prompts[0] if params.return_token_ids else None,
    )
    return JSONResponse(body.model_dump())


def _stream(
    ctx: ServingContext,
    gen: Generation,
    params: OutputParams,
    request_id: str,
    created: int,
    usage_mode: str,
    close: Callable[[], Awaitable[None]],
    *,
    plan: ToolPlan = NO_TOOLS,
    role: str = "assistant",
    echo: str = "",
) -> AsyncGenerator[str, None]:
    """SSE chunks (``usage_mode``: see :class:`router.serving.ChunkFrame`); with a tool plan,
    each choice's text goes through its :class:`ToolStream` (content and ``tool_calls``).
    ``echo`` (the request's last message, for ``echo``) follows each choice's role chunk."""
    head = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": ctx.model_name,
    }
    frame = ChunkFrame(gen, head, usage_mode)
    want_lp = params.logprobs is not None
    role_sent: set[int] = set()
    content_tail = '},"logprobs":null,"finish_reason":null,"stop_reason":null}' + frame.fixed_tail

    tool_streams = {i: plan.stream() for i in range(len(gen.samples))} if plan.parses else None

    ids = params.return_token_ids

    def chunk(
        index: int,
        delta: dict[str, Any],
        logprobs: dict[str, Any] | None = None,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
        token_ids: list[int] | None = None,
        prompt_token_ids: list[int] | None = None,
        completion_tokens: int | None = None,
    ) -> str:
        tail = frame.tail(index, completion_tokens)
        if prompt_token_ids is not None:  # a chunk-level field, after the choices
            tail = f'],"prompt_token_ids":{json.dumps(prompt_token_ids)}{tail[1:]}'
        extra = "" if token_ids is None else f',"token_ids":{json.dumps(token_ids)}'
        return (
            f'{frame.head}{index},"delta":{json.dumps(delta, ensure_ascii=False)},'
            f'"logprobs":{json.dumps(logprobs, ensure_ascii=False)},'
            f'"finish_reason":{json.dumps(finish_reason)},'
            f'"stop_reason":{json.dumps(stop_reason, ensure_ascii=False)}{extra}}}{tail}'
        )

    def event(d: SampleDelta) -> str | None:
        """The SSE event(s) of one delta: the role chunk first for a choice's first delta
        (None: nothing to send)."""
        if not d.text and d.finish_reason is None and not ((want_lp or ids) and d.tokens):
            return None
        finish = d.finish_reason
        delta: dict[str, Any]
        if tool_streams is not None:
            tools = tool_streams[d.index]
            out = tools.feed(d.text, last=finish is not None)
            if finish is not None:
                finish = tool_finish_reason(plan, tools, finish)
            if not out and finish is None and not ((want_lp or ids) and d.tokens):
                return None  # held back (a tag or a call being written)
            delta = {}
            if out.content or (finish is None and not out.tool_calls):
                delta["content"] = out.content
            if out.tool_calls:
                delta["tool_calls"] = out.tool_calls
        else:
            delta = {"content": d.text} if d.text or finish is None else {}
        first = ""
        if d.index not in role_sent:
            role_sent.add(d.index)
            # vLLM's return_token_ids: the prompt's ids with the stream's first chunk
            prompt_ids = gen.prompts[0] if ids and len(role_sent) == 1 else None
            # the role and echo chunks come before the choice's output: vLLM's continuous
            # usage counts none of its tokens there
            first = chunk(
                d.index,
                {"role": role, "content": ""},
                token_ids=[] if ids else None,
                prompt_token_ids=prompt_ids,
                completion_tokens=0,
            )
            if echo:
                first += chunk(
                    d.index, {"content": echo}, token_ids=[] if ids else None, completion_tokens=0
                )
        return first + chunk(
            d.index,
            delta,
            chat_logprobs(ctx, params, d.tokens) if want_lp else None,
            finish,
            d.stop_reason,
            [e.token_id for e in d.tokens] if ids else None,
        )

    plain = not want_lp and not frame.continuous and tool_streams is None and not ids

    def fast(deltas: list[SampleDelta]) -> str | None:
        """One sample's next text: the per-token chunk, the same bytes as
        chunk(d.index, {"content": d.text}). (The role chunk before a choice's first content
        goes the general way.)"""
        if not plain or len(deltas) != 1:
            return None
        d = deltas[0]
        if d.finish_reason is not None or d.index not in role_sent:
            return None
        if not d.text:
            return ""
        return f'{frame.head}{d.index},"delta":{{"content": {json_str(d.text)}{content_tail}'

    return stream_steps(ctx, gen, head, frame.include_usage, fast, event, close)
