"""OpenAI-compatible request and response models (pydantic, used only at the HTTP edge).

Requests accept what ``vllm serve`` accepts: OpenAI's fields plus vLLM's sampling extensions
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``, ...). Unknown
fields are kept (``extra="allow"``) and reported by the serving layer, as vLLM does. Range
checks live in ``router/sampling.py`` so their errors can name the parameter.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    model_validator,
)
from pydantic.functional_validators import WrapValidator


class OpenAIModel(BaseModel):
    # NaN / Infinity (which Python's JSON parser accepts) are refused with a 400 naming the
    # field; vLLM's users get a 400 for those too
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    # fields with a default that do not take None themselves (``n: int = 1``): an explicit
    # null means the default (set per class, below)
    _null_means_default: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        names = set()
        for name, f in cls.model_fields.items():
            if f.is_required() or f.annotation is None:
                continue
            try:
                TypeAdapter(f.annotation).validate_python(None)
            except ValidationError:
                names.add(name)
        cls._null_means_default = frozenset(names)

    @model_validator(mode="before")
    @classmethod
    def _nulls_take_defaults(cls, data: Any) -> Any:
        """OpenAI's optional parameters are nullable (``n``, ``stream``, chat's ``logprobs``,
        completions' ``echo``...: the SDK sends ``null`` for one passed as ``None``, and so do
        frameworks that forward every option); vLLM declares them ``Optional`` and takes the
        default. So does every field here that has a default: a null is as if not sent."""
        drop = cls._null_means_default
        if isinstance(data, dict) and drop and None in data.values():
            data = {k: v for k, v in data.items() if v is not None or k not in drop}
        return data

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class StreamOptions(OpenAIModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class SamplingFields(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool | None = None  # vLLM's: the prompt's and each choice's token ids
    use_beam_search: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: "right" keeps the first
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's structured outputs: one of json (a schema), regex, choice, grammar, json_object
    structured_outputs: dict[str, Any] | None = None
    priority: int = 0


_TOKEN_IDS = TypeAdapter(list[int])


def _token_ids_first(v: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A list of plain ints goes straight to ``list[int]``: the union's smart mode tries
    ``list[str]`` on it first, with an error per item (50 ms for the 135,000 ids that fit in
    1 MiB, on the event loop; this way 5 ms). Anything else takes the union as before."""
    if isinstance(v, list) and v and type(v[0]) is int:
        try:
            return _TOKEN_IDS.validate_python(v, strict=True)
        except ValueError:
            pass
    return handler(v)


class CompletionRequest(SamplingFields):
    prompt: Annotated[
        str | list[str] | list[int] | list[list[int]] | None, WrapValidator(_token_ids_first)
    ] = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None  # refused unless --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    # accepted, no effect on the output: completions are never stored
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None  # the served models do not reason


class ResponsesRequest(OpenAIModel):
    """``/v1/responses`` (router/serving_responses.py): text and function calls. vLLM's
    sampling extras (``top_k``, ``min_p``, ``repetition_penalty``, ``seed``) pass through."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    store: bool | None = None  # accepted; responses are never stored
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # accepted; the served models do not reason
    truncation: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    background: bool | None = None
    service_tier: str | None = None
    # vLLM's sampling extras on its Responses endpoint
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    priority: int = 0
    cache_salt: str | None = None


class TokenizeRequest(OpenAIModel):
    """``/tokenize``: either ``prompt`` or ``messages`` (vLLM's two forms)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # rendered by the template as the chat endpoint renders them (vLLM's /tokenize takes tools)
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None  # refused unless --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


# ---- responses ----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's: [None, {token id: {"logprob", "rank", "decoded_token"}}, ...] when asked for
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    # pdserve: the weight schemes the live workers advertise ([] = dense); one unless the pools
    # were started with different --quantization
    quantization: list[str] = []


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
