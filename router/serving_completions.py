"""``POST /v1/completions``: prompt(s) -> tokens -> generation -> OpenAI text completion.

Prompts may be a string, a list of strings, a list of token ids or a list of token-id lists
(vLLM accepts all four); strings are encoded WITH special tokens (BOS) unless
``add_special_tokens`` is false. Choice ``index`` is ``prompt_index * n + sample``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import cast

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from router.context import ServingContext
from router.errors import InvalidRequestError
from router.generation import Generation
from router.logprobs import completion_logprobs
from router.output import OutputParams, SampleDelta, TokenEntry
from router.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from router.sampling import check_prompt_count, check_unsupported, validate_common
from router.serving import ChunkFrame, serve, stream_steps, truncate_prompt, warn_unknown_fields
from router.sse import json_str, sse


async def tokenize_prompts(ctx: ServingContext, req: CompletionRequest) -> list[list[int]]:
    p = req.prompt
    if p is None or (isinstance(p, list) and not p):
        raise InvalidRequestError("prompt is required", param="prompt")
    if isinstance(p, str):
        raw = [await ctx.encode(p, req.add_special_tokens)]
    # (mypy does not narrow a list's items through all(isinstance(...)): the casts do)
    elif all(isinstance(x, int) for x in p):
        raw = [list(cast("list[int]", p))]
    elif all(isinstance(x, str) for x in p):
        check_prompt_count(len(p), req.n, ctx.limits)
        raw = await ctx.encode_many(list(cast("list[str]", p)), req.add_special_tokens)
    else:
        raw = [list(cast("list[int]", x)) for x in p]
    check_prompt_count(len(raw), req.n, ctx.limits)
    out = []
    for ids in raw:
        ctx.check_token_ids(ids)
        out.append(truncate_prompt(ids, req.truncate_prompt_tokens, ctx.limits.max_model_len))
    return out


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    warn_unknown_fields(req)
    ctx.check_model(req.model)
    check_unsupported(req)
    validate_common(req, ctx.limits)
    prompts = await tokenize_prompts(ctx, req)
    return await serve(ctx, req, raw, prompts, arrival, "cmpl", _stream, lambda *a: _body(ctx, *a))


def _body(
    ctx: ServingContext,
    gen: Generation,
    params: OutputParams,
    entries: dict[int, list[TokenEntry]],
    request_id: str,
    created: int,
) -> JSONResponse:
    choices = [
        CompletionChoice(
            index=s.index,
            text=s.text,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
            logprobs=CompletionLogprobs(
                **completion_logprobs(ctx, params, entries.get(s.index, []))
            )
            if params.logprobs is not None
            else None,
        )
        for s in gen.samples
    ]
    body = CompletionResponse(
        id=request_id, created=created, model=ctx.model_name, choices=choices, usage=gen.usage()
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
) -> AsyncGenerator[str, None]:
    """SSE chunks (``usage_mode``: see :class:`router.serving.ChunkFrame`)."""
    head = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": ctx.model_name,
    }
    frame = ChunkFrame(gen, head, usage_mode)
    want_lp = params.logprobs is not None
    going_tail = ',"logprobs":null,"finish_reason":null,"stop_reason":null}' + frame.fixed_tail

    def event(d: SampleDelta) -> str | None:
        """The SSE event of one delta (None: nothing to send)."""
        if not want_lp:
            if not d.text and d.finish_reason is None:
                return None
            return (
                f'{frame.head}{d.index},"text":{json_str(d.text)},'
                f'"logprobs":null,"finish_reason":{json.dumps(d.finish_reason)},'
                f'"stop_reason":{json.dumps(d.stop_reason)}}}{frame.tail()}'
            )
        if not d.text and d.finish_reason is None and not d.tokens:
            return None
        choice = {
            "index": d.index,
            "text": d.text,
            "logprobs": completion_logprobs(ctx, params, d.tokens),
            "finish_reason": d.finish_reason,
            "stop_reason": d.stop_reason,
        }
        chunk = {**head, "choices": [choice]}
        if frame.include_usage:
            chunk["usage"] = gen.usage().model_dump() if frame.continuous else None
        return sse(chunk)

    plain = not want_lp and not frame.continuous

    def fast(deltas: list[SampleDelta]) -> str | None:
        """One sample's next text: the per-token chunk."""
        if not plain or len(deltas) != 1 or deltas[0].finish_reason is not None:
            return None
        d = deltas[0]
        return f'{frame.head}{d.index},"text":{json_str(d.text)}{going_tail}' if d.text else ""

    return stream_steps(ctx, gen, head, frame.include_usage, fast, event, close)
