"""The served model's tokenizer, loaded from a local Hugging Face directory without torch.

The bench client needs the tokenizer for three things: building prompts that the server will
see as exactly N tokens, counting output tokens when the server sends no usage, and rendering
the chat template to count chat prompts. ``tokenizer.json`` is read with ``tokenizers`` (a core
dependency); only a directory without one falls back to ``transformers`` if it is installed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any


class TokenizerError(ValueError):
    """The model directory has no usable tokenizer."""


_WORDLIKE = re.compile(r"^ ?[A-Za-z]{2,}$")


class BenchTokenizer:
    """Encode/decode with the model's own rules, including the special tokens it adds.

    ``encode(text)`` adds special tokens (BOS) exactly as the server's tokenizer would for a
    completions prompt; ``encode(text, add_special_tokens=False)`` does not.
    """

    def __init__(self, backend: Any, kind: str, config: dict[str, Any], chat_template: str | None):
        self._backend = backend
        self._kind = kind  # "tokenizers" or "transformers"
        self._config = config
        self.chat_template = chat_template
        self.special_ids: frozenset[int] = frozenset(self._find_special_ids())
        self.vocab_size: int = self._vocab_size()
        self.num_special_tokens_to_add: int = len(self.encode("")) - len(
            self.encode("", add_special_tokens=False)
        )
        self._template = None
        self._vocab_texts: list[str] | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> BenchTokenizer:
        """Load from ``path`` (a model or tokenizer directory); raise TokenizerError if unusable."""
        d = Path(path)
        if not d.is_dir():
            raise TokenizerError(
                f"tokenizer path {str(d)!r} is not a directory (pass a local "
                "Hugging Face model directory with --model or --tokenizer)"
            )
        cfg_path = d / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = d / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        if (d / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            return cls(
                Tokenizer.from_file(str(d / "tokenizer.json")), "tokenizers", config, template
            )
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise TokenizerError(
                f"{d} has no tokenizer.json and transformers is not installed"
            ) from e
        try:
            tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        except Exception as e:  # transformers raises many types; all mean "cannot load"
            raise TokenizerError(f"cannot load a tokenizer from {d}: {e}") from e
        return cls(tok, "transformers", config, template or getattr(tok, "chat_template", None))

    def _find_special_ids(self) -> set[int]:
        if self._kind == "tokenizers":
            return {i for i, t in self._backend.get_added_tokens_decoder().items() if t.special}
        return set(self._backend.all_special_ids)

    def _vocab_size(self) -> int:
        if self._kind == "tokenizers":
            return self._backend.get_vocab_size(with_added_tokens=True)
        return len(self._backend)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._kind == "tokenizers":
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens)

    def count(self, text: str, add_special_tokens: bool = True) -> int:
        return len(self.encode(text, add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        if self._kind == "tokenizers":
            return self._backend.decode(ids, skip_special_tokens=False)
        return self._backend.decode(ids, skip_special_tokens=False)

    def token_pool(self, wordlike: bool) -> list[int]:
        """Token ids to draw random prompts from: every non-special id, or only word-like ones.

        Word-like tokens (two or more letters, optionally after one space) make text that
        reads like words; with fewer than 256 of them, every non-special id is used.
        """
        texts = self._decoded_vocab()
        # Tokens that decode to a replacement character (lone bytes of a multi-byte character)
        # are left out: the text they make re-encodes to other tokens.
        ids = [i for i, t in enumerate(texts) if i not in self.special_ids and "\ufffd" not in t]
        if not wordlike:
            return ids
        words = [i for i in ids if _WORDLIKE.match(texts[i])]
        return words if len(words) >= 256 else ids

    def _decoded_vocab(self) -> list[str]:
        if self._vocab_texts is None:
            self._vocab_texts = [self.decode([i]) for i in range(self.vocab_size)]
        return self._vocab_texts

    def render_chat(self, messages: list[dict[str, str]]) -> str | None:
        """The prompt text the chat template makes (with the generation prompt), or None when
        there is no template or it cannot be rendered here."""
        if not self.chat_template:
            return None
        from jinja2 import TemplateError

        try:
            if self._template is None:
                self._template = _compile_template(self.chat_template)
            return self._template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=_token_str(self._config.get("bos_token")),
                eos_token=_token_str(self._config.get("eos_token")),
            )
        except (TemplateError, TokenizerError):
            return None

    def count_chat(self, messages: list[dict[str, str]]) -> int | None:
        """Prompt tokens the server sees for ``messages``, or None if the template is missing
        or cannot be rendered (the caller keeps its own estimate)."""
        text = self.render_chat(messages)
        # The template already holds BOS, so (as HF's apply_chat_template) add no specials.
        return None if text is None else self.count(text, add_special_tokens=False)


def _compile_template(source: str) -> Any:
    import time

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TokenizerError(f"chat template error: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)  # used by Llama 3 templates
    return env.from_string(source)


def _token_str(tok: Any) -> str:
    if isinstance(tok, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        return str(tok.get("content", ""))
    return "" if tok is None else str(tok)
