"""``/tokenize``, ``/detokenize`` and ``/v1/models`` (vLLM's shapes)."""

from __future__ import annotations

import asyncio
import time

from router.context import ServingContext
from router.errors import InvalidRequestError
from router.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from router.sampling import check_json_depth
from router.serving_chat import render_chat_prompt
from router.tool_calls import check_tools


async def tokenize(ctx: ServingContext, req: TokenizeRequest) -> TokenizeResponse:
    ctx.check_model(req.model)
    for name in ("tools", "documents", "chat_template_kwargs"):
        check_json_depth(getattr(req, name), ctx.limits.max_json_depth, name)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    if req.prompt is not None:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await ctx.encode(req.prompt, add_special)
    else:
        if req.tools:
            check_tools(req.tools)  # the chat endpoint's 400s for malformed tools
        ids = await render_chat_prompt(
            ctx,
            req.messages or [],
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            add_special_tokens=bool(req.add_special_tokens),
            tools=req.tools,
            documents=req.documents,
            kwargs=req.chat_template_kwargs,
            chat_template=req.chat_template,
        )
    strs = None
    if req.return_token_strs:
        if len(ids) > 8192:  # Python per token: in a thread, the loop keeps its turns
            strs = await asyncio.to_thread(lambda: [ctx.tokenizer.token_str(t) for t in ids])
        else:
            strs = [ctx.tokenizer.token_str(t) for t in ids]
    return TokenizeResponse(
        # the length admission enforces (the workers' smallest may be below --max-model-len)
        count=len(ids),
        max_model_len=ctx.request_limits().max_model_len,
        tokens=ids,
        token_strs=strs,
    )


async def detokenize(ctx: ServingContext, req: DetokenizeRequest) -> DetokenizeResponse:
    ctx.check_model(req.model)
    ctx.check_token_ids(req.tokens, "tokens")
    if len(req.tokens) > 8192:  # tokenizers releases the GIL: the loop keeps serving meanwhile
        text = await asyncio.to_thread(ctx.tokenizer.decode, req.tokens, False)
    else:
        text = ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)
    return DetokenizeResponse(prompt=text)


def models(ctx: ServingContext, root: str, created: int | None = None) -> ModelList:
    return ModelList(
        data=[
            ModelCard(
                id=ctx.model_name,
                created=created or int(time.time()),
                root=root,
                max_model_len=ctx.request_limits().max_model_len,  # what admission enforces
                quantization=ctx.quantization(),
            )
        ]
    )
