"""What every OpenAI request needs from the router: the served model, tokenizer, dispatcher,
limits, metrics and admission (:class:`ServingContext`), built once in the app's lifespan."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from router.dispatch import Dispatcher
from router.errors import InvalidRequestError, ModelNotFoundError, OverloadedError
from router.metrics import RouterMetrics
from router.sampling import Limits
from router.tokenizer import RouterTokenizer
from router.tool_calls import ToolSettings
from shared.directory import ROLE_DECODE

if TYPE_CHECKING:
    from router.generation import RequestObserver

_LONG_TEXT = 8192  # characters; longer prompts are tokenized off the event loop


@dataclass
class ServingContext:
    model_name: str
    tokenizer: RouterTokenizer
    dispatcher: Dispatcher
    limits: Limits
    metrics: RouterMetrics
    request_timeout_s: float
    max_inflight: int = 0  # 0 = unlimited
    inflight: int = 0
    live: RequestObserver | None = None  # the dashboard's sliding windows and recent requests
    tools: ToolSettings = field(default_factory=ToolSettings)  # tool calling (--tool-call-parser)
    trust_request_chat_template: bool = False  # vLLM's flag: a request may bring its own template

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(f"The model `{model}` does not exist.", param="model")

    def admit(self) -> Ticket:
        """Count one in-flight generation request; 429 beyond ``max_inflight``.
        The returned ticket's ``release()`` (idempotent) ends it."""
        if self.max_inflight and self.inflight >= self.max_inflight:
            raise OverloadedError(
                f"the router already has {self.inflight} requests in flight "
                f"(--max-inflight-requests {self.max_inflight}); retry later"
            )
        self.inflight += 1
        self.metrics.c_inflight.inc()
        return Ticket(self)

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) > _LONG_TEXT:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens)

    async def encode_many(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Encode several prompts in one batch, off the event loop once they are long
        together (``tokenizers`` releases the GIL, so the loop keeps serving meanwhile)."""
        if sum(map(len, texts)) > _LONG_TEXT:
            return await asyncio.to_thread(self.tokenizer.encode_many, texts, add_special_tokens)
        return self.tokenizer.encode_many(texts, add_special_tokens)

    def request_limits(self) -> Limits:
        """``limits``, with ``max_model_len`` lowered to the smallest one that the live decode
        workers advertise (workers may run with a shorter ``--max-model-len``)."""
        advertised = [
            r.info.max_model_len
            for r in self.dispatcher.pool.records(ROLE_DECODE)
            if r.info.max_model_len > 0
        ]
        if advertised and min(advertised) < self.limits.max_model_len:
            return replace(self.limits, max_model_len=min(advertised))
        return self.limits

    def quantization(self) -> list[str]:
        """The weight schemes the live workers advertise (sorted; [] when all are dense)."""
        return sorted({r.info.quantization for r in self.dispatcher.pool.records()} - {""})

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> None:
        """400 naming ``param`` (the field that carried ``ids``) for an id outside the vocabulary."""
        vocab = self.limits.vocab_size
        if not ids or (min(ids) >= 0 and max(ids) < vocab):  # C loops: 128 prompts of 1,500
            return  # ids took 30 ms on the event loop as a generator
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad} is outside the vocabulary [0, {vocab})", param=param
            )


class Ticket:
    """One admitted request; ``release()`` may be called any number of times."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx: ServingContext) -> None:
        self._ctx: ServingContext | None = ctx

    def release(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.inflight -= 1
            ctx.metrics.c_inflight.dec()
