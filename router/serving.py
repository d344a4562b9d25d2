"""What ``/v1/completions`` and ``/v1/chat/completions`` share: request ids and labels, prompt
preparation, and :func:`serve`, the one request skeleton (admit, generate, stream or collect,
release) each endpoint fills with its own prompt rendering, chunk format and response body.

The pieces live in their own modules: ``context.py`` (what a request needs), ``generation.py``
(fan-in of the prompts' streams), ``sse.py`` (the streaming response), ``logprobs.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from router.context import ServingContext
from router.errors import InvalidRequestError, RouterError
from router.generation import Generation, run_generation
from router.output import OutputParams, SampleDelta, TokenEntry
from router.protocol import OpenAIModel
from router.sampling import SamplingRequest, build_params, resolve_max_tokens
from router.sse import SSE_DONE, SSE_HEADERS, DisconnectWatch, SSEResponse, sse, until_disconnected
from shared.proto import pdserve_pb2 as pb

logger = logging.getLogger(__name__)
_MAX_LABEL = 128  # characters of a client's X-Request-Id kept as a label


def base_request_id(raw: Request) -> str:
    """The request's id on the workers: always the router's own, so two clients that send the
    same ``X-Request-Id`` never collide (the client's value is only a label, see
    :func:`client_label`)."""
    return uuid.uuid4().hex


def client_label(raw: Request) -> str | None:
    """The client's ``X-Request-Id`` (at most 128 printable ASCII characters), echoed back in
    the response header and written in the logs; never used as an id."""
    label = raw.headers.get("x-request-id")
    if not label:
        return None
    label = label[:_MAX_LABEL]
    return label if label.isascii() and label.isprintable() else None


def response_headers(raw: Request, request_id: str) -> dict[str, str]:
    label = client_label(raw)
    if label is not None and label != request_id:
        logger.debug("request %s carries client label %r", request_id, label)
    return {"x-request-id": label or request_id}


def warn_unknown_fields(req: OpenAIModel) -> None:
    extra = req.unknown_fields()
    if extra:
        # the client's names, quoted and cut: a name holding a newline forged log lines
        shown = ", ".join(repr(k[:64]) for k in extra[:20])
        more = f" and {len(extra) - 20} more" if len(extra) > 20 else ""
        logger.warning("ignoring unknown request fields: %s%s", shown, more)


def truncate_prompt(
    ids: list[int], k: int | None, max_model_len: int, side: str | None = None
) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep the last ``k`` tokens (-1 = max_model_len), or
    the first ``k`` with ``truncation_side`` "right"."""
    if k is None:
        return ids
    if k == -1:
        k = max_model_len
    if k < 1:
        raise InvalidRequestError(
            "truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens"
        )
    return ids[:k] if side == "right" else ids[-k:]


async def prepare_prompt_runs(
    ctx: ServingContext,
    req: SamplingRequest,
    prompts: list[list[int]],
) -> tuple[list[pb.SamplingParams], OutputParams]:
    """Per-prompt engine params (the max_tokens default depends on each prompt's length)."""
    samplings: list[pb.SamplingParams] = []
    params: OutputParams | None = None
    limits = ctx.request_limits()
    for p in prompts:
        if not p:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        max_tokens = resolve_max_tokens(req, len(p), limits)
        sp, params = build_params(req, max_tokens, limits)
        samplings.append(sp)
    assert params is not None
    return samplings, params


StreamFn = Callable[
    [ServingContext, Generation, OutputParams, str, int, str, Callable[[], Awaitable[None]]],
    AsyncGenerator[str, None],
]
BodyFn = Callable[[Generation, OutputParams, dict[int, list[TokenEntry]], str, int], JSONResponse]


async def serve(
    ctx: ServingContext,
    req: SamplingRequest,
    raw: Request,
    prompts: list[list[int]],
    arrival: float,
    id_prefix: str,
    stream: StreamFn,
    body: BodyFn,
) -> Response:
    """The request skeleton the endpoints share. ``id_prefix`` starts the response id, its
    separator included (``chatcmpl-`` and ``cmpl-`` as vLLM's, ``resp_`` as OpenAI's).
    ``stream(ctx, gen, params, request_id, created, usage_mode, close)`` yields the SSE
    events (its per-token path is the endpoint's own); ``body(gen, params, entries,
    request_id, created)`` builds the non-streaming response (off the event loop when the
    output is large)."""
    samplings, params = await prepare_prompt_runs(ctx, req, prompts)
    request_id = f"{id_prefix}{base_request_id(raw)}"
    created = int(time.time())
    ticket = ctx.admit()
    ctx.metrics.c_prompt.inc(sum(map(len, prompts)))  # admitted: a refused request adds none
    gen = Generation(ctx, request_id, prompts, samplings, params, req.cache_salt or "", arrival)
    headers = response_headers(raw, request_id)

    async def close() -> None:
        await gen.aclose()
        ticket.release()

    if req.stream:
        # one watcher for routing and the stream; a client that leaves cancels the gRPC calls
        watch = DisconnectWatch(raw.receive, on_gone=gen.client_left)
        try:
            await watch.guard(gen.start())
        except BaseException:
            watch.stop()
            await close()
            raise
        opts = req.stream_options
        usage_mode = (
            "continuous"
            if opts and opts.include_usage and opts.continuous_usage_stats
            else "final"
            if opts and opts.include_usage
            else ""
        )
        return SSEResponse(
            stream(ctx, gen, params, request_id, created, usage_mode, close),
            close,
            headers={**SSE_HEADERS, **headers},
            watch=watch,
        )
    entries: dict[int, list[TokenEntry]] = {}

    def collect(deltas: list[SampleDelta]) -> None:
        for d in deltas:
            entries.setdefault(d.index, []).extend(d.tokens)

    try:
        await until_disconnected(raw, run_generation(ctx, gen, collect), on_gone=gen.client_left)
    finally:
        await close()
    # building the body is Python per output token: off the loop when the output is large
    big = gen.completion_tokens * (1 + (params.logprobs or 0)) > 16384
    resp = (
        await asyncio.to_thread(body, gen, params, entries, request_id, created)
        if big
        else body(gen, params, entries, request_id, created)
    )
    resp.headers.update(headers)
    return resp


class ChunkFrame:
    """What every SSE chunk of one stream shares, pre-formatted: chunks are formatted by hand
    around JSON-encoded values (this runs once per token), the same bytes as ``json.dumps``
    of the whole chunk would give. ``usage_mode``: "" (no usage), "final" (a last chunk with
    ``choices: []``) or "continuous" (also the chunk's choice's running usage in every chunk,
    vLLM's continuous_usage_stats)."""

    def __init__(self, gen: Generation, head: dict[str, Any], usage_mode: str) -> None:
        self.gen = gen
        self.include_usage = bool(usage_mode)
        self.continuous = usage_mode == "continuous"
        #: up to the first choice's index
        self.head = "data: " + json.dumps(head, ensure_ascii=False)[:-1] + ',"choices":[{"index":'
        #: after the first choice when the usage is not continuous
        self.fixed_tail = "]" + (',"usage":null' if self.include_usage else "") + "}\n\n"

    def tail(self, index: int, completion_tokens: int | None = None) -> str:
        """After choice ``index``: when continuous, that choice's own running usage (vLLM's:
        a chunk counts its choice's tokens, not the request's; ``completion_tokens`` 0 for
        the chunks before its output, see :meth:`Generation.choice_usage`)."""
        if self.continuous:
            usage = self.gen.choice_usage(index, completion_tokens)
            return '],"usage":' + usage.model_dump_json() + "}\n\n"
        return self.fixed_tail


async def stream_steps(
    ctx: ServingContext,
    gen: Generation,
    head: dict[str, Any],
    include_usage: bool,
    fast: Callable[[list[SampleDelta]], str | None],
    event: Callable[[SampleDelta], str | None],
    close: Callable[[], Awaitable[None]],
) -> AsyncGenerator[str, None]:
    """The SSE writes of a stream: per worker message, ``fast(deltas)`` (a str, "" for
    nothing, None when the message needs the general path) or else the ``event`` of each
    delta in one write; then the usage chunk and ``[DONE]``, or the error event; ``close``
    always."""
    try:
        async for deltas in gen.steps():
            quick = fast(deltas)
            if quick is not None:
                if quick:
                    yield quick
                continue
            events = [e for d in deltas if (e := event(d)) is not None]
            if events:
                yield "".join(events)
        yield stream_end(gen, head, include_usage)  # usage chunk and end marker: one write
    except RouterError as e:
        yield stream_error(ctx, e)
    finally:
        await close()


def stream_end(gen: Generation, head: dict[str, Any], include_usage: bool) -> str:
    """The last write of a stream: the usage chunk (``choices: []``) when asked, then
    ``data: [DONE]``."""
    if include_usage:
        return sse({**head, "choices": [], "usage": gen.usage().model_dump()}) + SSE_DONE
    return SSE_DONE


def stream_error(ctx: ServingContext, e: RouterError) -> str:
    """The error event that ends a stream which failed after its headers were sent."""
    ctx.metrics.error(e.status)
    return sse(e.to_dict()) + SSE_DONE
