"""``POST /v1/completions``: prompt(s) -> tokens -> generation -> OpenAI text completion.

Prompts may be a string, a list of strings, a list of token ids or a list of token-id lists
(vLLM accepts all four); strings are encoded WITH special tokens (BOS) unless
``add_special_tokens`` is false. Choice ``index`` is ``prompt_index * n + sample``.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, cast

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from router.context import ServingContext
from router.errors import InvalidRequestError
from router.generation import Generation
from router.logprobs import completion_logprobs, prompt_entries, vllm_prompt_logprobs
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
        out.append(
            truncate_prompt(
                ids, req.truncate_prompt_tokens, ctx.limits.max_model_len, req.truncation_side
            )
        )
    return out


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    warn_unknown_fields(req)
    ctx.check_model(req.model)
    check_unsupported(req)
    validate_common(req, ctx.limits)
    prompts = await tokenize_prompts(ctx, req)
    texts = _prompt_texts(req, len(prompts))
    return await serve(
        ctx,
        req,
        raw,
        prompts,
        arrival,
        "cmpl-",
        functools.partial(_stream, texts=texts),
        lambda *a: _body(ctx, texts, *a),
    )


def _prompt_texts(req: CompletionRequest, count: int) -> list[str | None]:
    """The prompts' own text where the client sent text (what ``echo`` repeats); None where
    it sent token ids or the prompt was truncated (the tokens' text then)."""
    p = req.prompt
    if req.truncate_prompt_tokens is None:
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            return list(cast("list[str]", p))
    return [None] * count


class _Echo:
    """Each prompt's echo (text and logprob entries), built once for its n choices."""

    def __init__(
        self,
        ctx: ServingContext,
        gen: Generation,
        params: OutputParams,
        texts: list[str | None],
    ) -> None:
        self.ctx, self.gen, self.params, self.texts = ctx, gen, params, texts
        self._done: dict[int, tuple[str, list[TokenEntry]]] = {}

    def of(self, choice: int) -> tuple[str, list[TokenEntry]]:
        i = choice // self.params.n
        if i not in self._done:
            lps = self.gen.streams[i].prompt_logprobs if self.params.logprobs is not None else None
            text, entries = prompt_entries(self.ctx, self.params, self.gen.prompts[i], lps)
            given = self.texts[i]
            self._done[i] = (text if given is None else given, entries)
        return self._done[i]


def _joined_logprobs(
    ctx: ServingContext,
    params: OutputParams,
    echoed: Sequence[TokenEntry],
    base: int,
    entries: Sequence[TokenEntry],
) -> dict[str, Any]:
    """The logprobs object of an echoed prompt's entries then the output's (offsets after
    the echoed text, ``base`` characters)."""
    a = completion_logprobs(ctx, params, echoed)
    b = completion_logprobs(ctx, params, entries, offset_base=base)
    return {k: a[k] + b[k] for k in a}


def _body(
    ctx: ServingContext,
    texts: list[str | None],
    gen: Generation,
    params: OutputParams,
    entries: dict[int, list[TokenEntry]],
    request_id: str,
    created: int,
) -> JSONResponse:
    echo = _Echo(ctx, gen, params, texts)
    prompt_logprobs = (  # per prompt, shared by its n choices
        [
            vllm_prompt_logprobs(ctx, params, p, stream.prompt_logprobs)
            for p, stream in zip(gen.prompts, gen.streams, strict=True)
        ]
        if params.prompt_logprobs is not None
        else None
    )
    choices = []
    for s in gen.samples:
        i = s.index // params.n
        text, out_entries = s.text, entries.get(s.index, [])
        if params.echo_only:
            text, out_entries = "", []
        echo_text, echo_entries = echo.of(s.index) if params.echo else ("", [])
        choices.append(
            CompletionChoice(
                index=s.index,
                text=echo_text + text,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=CompletionLogprobs(
                    **_joined_logprobs(ctx, params, echo_entries, len(echo_text), out_entries)
                )
                if params.logprobs is not None
                else None,
                prompt_logprobs=None if prompt_logprobs is None else prompt_logprobs[i],
                prompt_token_ids=gen.prompts[i] if params.return_token_ids else None,
                token_ids=s.token_ids if params.return_token_ids else None,
            )
        )
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
    *,
    texts: list[str | None] | None = None,
) -> AsyncGenerator[str, None]:
    """SSE chunks (``usage_mode``: see :class:`router.serving.ChunkFrame`). With ``echo``, a
    choice's first chunk starts with its prompt (text, and logprobs when asked for)."""
    head = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": ctx.model_name,
    }
    frame = ChunkFrame(gen, head, usage_mode)
    want_lp = params.logprobs is not None
    going_tail = ',"logprobs":null,"finish_reason":null,"stop_reason":null}' + frame.fixed_tail

    given: list[str | None] = texts if texts is not None else [None] * len(gen.prompts)
    echo = _Echo(ctx, gen, params, given) if params.echo else None
    bases: dict[int, int] = {}  # with echo: each choice's echoed characters (logprob offsets)
    ids = params.return_token_ids
    ids_sent: set[int] = set()

    def event(d: SampleDelta) -> str | None:
        """The SSE event of one delta (None: nothing to send)."""
        text, tokens = d.text, d.tokens
        echoed: Sequence[TokenEntry] = ()
        if echo is not None:
            if params.echo_only:
                text, tokens = "", ()
            if d.index not in bases:
                echo_text, echoed = echo.of(d.index)
                bases[d.index] = len(echo_text)
                text = echo_text + text
        if not want_lp and not ids:
            if not text and d.finish_reason is None:
                return None
            return (
                f'{frame.head}{d.index},"text":{json_str(text)},'
                f'"logprobs":null,"finish_reason":{json.dumps(d.finish_reason)},'
                f'"stop_reason":{json.dumps(d.stop_reason)}}}{frame.tail(d.index)}'
            )
        if not text and d.finish_reason is None and not tokens and not echoed:
            return None
        choice: dict[str, Any] = {
            "index": d.index,
            "text": text,
            "logprobs": _joined_logprobs(ctx, params, echoed, bases.get(d.index, 0), tokens)
            if want_lp
            else None,
            "finish_reason": d.finish_reason,
            "stop_reason": d.stop_reason,
        }
        if ids:  # vLLM's: the prompt's ids in each choice's first chunk, then the new ones
            if d.index not in ids_sent:
                ids_sent.add(d.index)
                choice["prompt_token_ids"] = gen.prompts[d.index // params.n]
            choice["token_ids"] = [e.token_id for e in tokens]
        chunk = {**head, "choices": [choice]}
        if frame.include_usage:
            chunk["usage"] = gen.choice_usage(d.index).model_dump() if frame.continuous else None
        return sse(chunk)

    plain = not want_lp and not frame.continuous and echo is None and not ids

    def fast(deltas: list[SampleDelta]) -> str | None:
        """One sample's next text: the per-token chunk."""
        if not plain or len(deltas) != 1 or deltas[0].finish_reason is not None:
            return None
        d = deltas[0]
        return f'{frame.head}{d.index},"text":{json_str(d.text)}{going_tail}' if d.text else ""

    return stream_steps(ctx, gen, head, frame.include_usage, fast, event, close)
