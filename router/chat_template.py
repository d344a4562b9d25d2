"""Render a Hugging Face ``chat_template`` the way ``transformers`` does, without transformers.

Same Jinja environment as ``PreTrainedTokenizerBase.apply_chat_template``: an immutable
sandbox with ``trim_blocks`` / ``lstrip_blocks`` and loop controls, the ``tojson`` filter that
keeps non-ASCII, the ``raise_exception`` and ``strftime_now`` globals, the special-token
variables (``bos_token``, ``eos_token``, ...), ``add_generation_prompt``, ``tools``,
``documents`` and caller kwargs; ``{% generation %}`` blocks render their body.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker, the same text


class ChatTemplateError(ValueError):
    """The template failed to render (bad messages, or the template raised)."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker): render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template plus the special-token variables it may use."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e
        self.source = source
        self.special_tokens = dict(special_tokens)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text. ``continue_final_message`` cuts it right after the last message's
        content, its trailing whitespace kept where the template keeps it: the content is
        rendered with ``transformers``' tag after it, and the prompt ends where the tag starts
        (stripped when the template trimmed the space after the tag, as transformers does)."""
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        final = messages[-1].get("content") if messages else None
        if continue_final_message:
            if not isinstance(final, str):
                raise ChatTemplateError("continue_final_message needs a final message with text")
            messages = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_TAG}]
        variables = {**self.special_tokens, **(kwargs or {})}
        try:
            text = self._template.render(
                messages=list(messages),
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except (
            TypeError,
            KeyError,
            AttributeError,
            ValueError,
            IndexError,
            ArithmeticError,
            RecursionError,
        ) as e:
            raise ChatTemplateError(f"chat template could not render these messages: {e!r}") from e
        if continue_final_message and isinstance(final, str):  # a str: checked above
            tag = _CONTINUE_TAG.strip()
            if final.strip() not in text or tag not in text:
                raise ChatTemplateError(
                    "continue_final_message: the final message does not appear in the rendered chat"
                )
            at = text.rindex(tag)
            text = text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()
        return text
