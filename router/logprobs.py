"""OpenAI ``logprobs`` objects of completions and chat completions, from the router's per-token
entries (``router/output.py``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from router.context import ServingContext
from router.output import OutputParams, TokenEntry
from shared.proto import pdserve_pb2 as pb


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


def vllm_prompt_logprobs(
    ctx: ServingContext,
    params: OutputParams,
    prompt: Sequence[int],
    lps: Sequence[pb.TokenLogprob] | None,
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` field: None for the first prompt token, then per token a map
    from token id to its logprob, 1-based rank and text: the prompt token first, then the
    top N."""
    if lps is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for tok, lp in zip(prompt[1:], lps):
        d = {
            str(tok): {
                "logprob": safe_logprob(lp.logprob),
                "rank": lp.rank,
                "decoded_token": token_text(ctx, params, tok),
            }
        }
        for rank, t in enumerate(lp.top, 1):
            d.setdefault(
                str(t.token_id),
                {
                    "logprob": safe_logprob(t.logprob),
                    "rank": rank,
                    "decoded_token": token_text(ctx, params, t.token_id),
                },
            )
        out.append(d)
    return out


def prompt_entries(
    ctx: ServingContext,
    params: OutputParams,
    prompt: Sequence[int],
    lps: Sequence[pb.TokenLogprob] | None,
) -> tuple[str, list[TokenEntry]]:
    """An echoed prompt's text and its tokens as logprob entries (the first without a
    logprob, as OpenAI's echo gives it; all without when ``lps`` is None)."""
    step = ctx.tokenizer.stepper(params.skip_special_tokens)
    text = ""
    entries = []
    for i, tok in enumerate(prompt):
        lp = lps[i - 1] if lps is not None and 0 < i <= len(lps) else None
        entries.append(TokenEntry(tok, len(text), lp))
        text += step(tok) or ""
    return text, entries
