"""``/tokenize``, ``/detokenize`` and ``/v1/models`` (vLLM's shapes)."""

from __future__ import annotations

import time

from router.errors import InvalidRequestError
from router.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from router.serving import ServingContext
from router.serving_chat import render_chat_prompt


async def tokenize(ctx: ServingContext, req: TokenizeRequest) -> TokenizeResponse:
    ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    if req.prompt is not None:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await ctx.encode(req.prompt, add_special)
    else:
        ids = await render_chat_prompt(
            ctx, req.messages or [], add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            add_special_tokens=bool(req.add_special_tokens), kwargs=req.chat_template_kwargs)
    strs = [ctx.tokenizer.token_str(t) for t in ids] if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=ctx.limits.max_model_len, tokens=ids,
                            token_strs=strs)


async def detokenize(ctx: ServingContext, req: DetokenizeRequest) -> DetokenizeResponse:
    ctx.check_model(req.model)
    ctx.check_token_ids(req.tokens)
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(req.tokens, skip_special_tokens=False))


def models(ctx: ServingContext, root: str, created: int | None = None) -> ModelList:
    return ModelList(data=[ModelCard(id=ctx.model_name, created=created or int(time.time()),
                                     root=root, max_model_len=ctx.limits.max_model_len)])
