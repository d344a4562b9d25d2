"""The router's tokenizer, chat templates and incremental detokenizer (no workers needed)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.chat_template import ChatTemplate, ChatTemplateError
from router.tokenizer import RouterTokenizer

# An original template exercising what real ones use: tools + tojson, raise_exception,
# loop controls, a {% generation %} block, bos/eos variables, trim_blocks/lstrip_blocks.
RICH_TEMPLATE = """{{ bos_token }}
{% if tools %}
<|im_start|>system
Tools: {{ tools | tojson }}<|im_end|>
{% endif %}
{% for m in messages %}
  {% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}
    {{ raise_exception('unknown role ' + m['role']) }}
  {% endif %}
  {% if loop.index0 > 50 %}{% break %}{% endif %}
<|im_start|>{{ m['role'] }}
{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}{{ eos_token }}
{% else %}{{ m['content'] }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

MESSAGES = [
    [{"role": "user", "content": "Say hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "héllo 日本語 😀"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "more\n\nlines  "},
    ],
]


@pytest.fixture(scope="module")
def tok(tiny_model) -> RouterTokenizer:
    return RouterTokenizer.from_model_dir(tiny_model)


@pytest.fixture(scope="module")
def hf_tok(tiny_model):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tiny_model))


def hf_ids(hf, messages, **kw) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


@pytest.mark.parametrize("messages", MESSAGES)
def test_chat_prompt_matches_transformers(tok, hf_tok, messages):
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == hf_ids(hf_tok, messages, add_generation_prompt=True)
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id  # BOS exactly once


def test_completion_prompt_gets_bos_like_transformers(tok, hf_tok):
    text = "def fibonacci(n):"
    assert tok.encode(text) == hf_tok(text)["input_ids"]
    assert tok.encode(text)[0] == tok.bos_token_id
    assert (
        tok.encode(text, add_special_tokens=False)
        == hf_tok(text, add_special_tokens=False)["input_ids"]
    )


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_rich_template_matches_transformers(tok, hf_tok, messages, gen_prompt):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Météo",
                "parameters": {"type": "object"},
            },
        }
    ]
    ours = ChatTemplate(RICH_TEMPLATE, tok.special_tokens).render(
        messages, add_generation_prompt=gen_prompt, tools=tools
    )
    theirs = hf_tok.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=gen_prompt,
        tools=tools,
        chat_template=RICH_TEMPLATE,
    )
    assert ours == theirs
    assert json.dumps(tools, ensure_ascii=False) in ours  # tojson keeps non-ASCII


def test_template_raise_exception_and_continue_final_message(tok, hf_tok):
    t = ChatTemplate(RICH_TEMPLATE, tok.special_tokens)
    with pytest.raises(ChatTemplateError, match="unknown role robot"):
        t.render([{"role": "robot", "content": "x"}])
    msgs = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one, two,"}]
    ours = tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    theirs = hf_tok.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    assert ours == theirs and ours.endswith("one, two,")
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% for x in %}", {})


def test_chat_template_override_and_missing(tiny_model, tmp_path):
    custom = tmp_path / "t.jinja"
    custom.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    tok = RouterTokenizer.from_model_dir(tiny_model, chat_template=str(custom))
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "[a]"
    d = tmp_path / "notemplate"
    d.mkdir()
    (d / "tokenizer.json").write_text((tiny_model / "tokenizer.json").read_text())
    bare = RouterTokenizer.from_model_dir(d)
    assert not bare.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "a"}])


def test_token_bytes_are_exact_for_split_characters(tok):
    text = "naïve 日本語 😀 café"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    # at least one token holds part of a character: decoding it alone shows U+FFFD
    assert any("\ufffd" in tok.token_str(i) for i in ids)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_incremental_detokenization_never_emits_replacement_chars(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    stream = tok.decode_stream()
    pieces = [tok.step(stream, i) for i in ids]
    assert "".join(pieces) == tok.decode(ids)
    if "\ufffd" not in text:
        assert all("\ufffd" not in p for p in pieces)
