"""OpenAI ``logprobs`` objects of completions and chat completions, from the router's per-token
entries (``router/output.py``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from router.context import ServingContext
from router.output import OutputParams, TokenEntry


def safe_logprob(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def token_text(ctx: ServingContext, params: OutputParams, token_id: int) -> str:
    if params.return_tokens_as_token_ids:
        return f"token_id:{token_id}"
    return ctx.tokenizer.token_str(token_id)


def completion_logprobs(
    ctx: ServingContext, params: OutputParams, entries: Sequence[TokenEntry], offset_base: int = 0
) -> dict[str, Any]:
    """OpenAI completions ``logprobs`` object for ``entries``."""
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for e in entries:
        tokens.append(token_text(ctx, params, e.token_id))
        offsets.append(offset_base + e.text_offset)
        lp = e.logprob
        if lp is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(safe_logprob(lp.logprob))
        top = {token_text(ctx, params, t.token_id): safe_logprob(t.logprob) for t in lp.top}
        top.setdefault(tokens[-1], safe_logprob(lp.logprob))  # the sampled token is always there
        tops.append(top)
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}


def chat_logprobs(
    ctx: ServingContext, params: OutputParams, entries: Sequence[TokenEntry]
) -> dict[str, Any]:
    """OpenAI chat ``logprobs`` object (``{"content": [...]}``) for ``entries``."""
    content = []
    for e in entries:
        lp = e.logprob
        tok = token_text(ctx, params, e.token_id)
        item = {
            "token": tok,
            "logprob": safe_logprob(lp.logprob) if lp is not None else -9999.0,
            "bytes": list(ctx.tokenizer.token_bytes(e.token_id)),
            "top_logprobs": [],
        }
        if lp is not None:
            item["top_logprobs"] = [
                {
                    "token": token_text(ctx, params, t.token_id),
                    "logprob": safe_logprob(t.logprob),
                    "bytes": list(ctx.tokenizer.token_bytes(t.token_id)),
                }
                for t in lp.top[: params.logprobs or 0]
            ]
        content.append(item)
    return {"content": content}
