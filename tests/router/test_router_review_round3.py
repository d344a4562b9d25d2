"""Router findings of the third review, each failing before its fix: special tokens that only
``special_tokens_map.json`` names; named chat templates (``default`` / ``tool_use``) chosen as
``transformers`` chooses them; ``continue_final_message`` keeping the final message's trailing
whitespace; ``/tokenize`` rendering ``tools`` and ``documents``; ``/v1/responses`` errors naming
the Responses parameters; ``/detokenize`` naming ``tokens``; ``resp_`` response ids; ``/health``
keeping the registry's error text from unauthenticated callers."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_harness import MODEL_NAME, router_with_one_worker
from test_router_errors import assert_error

from router.chat_template import ChatTemplateError
from router.tokenizer import RouterTokenizer

transformers = pytest.importorskip("transformers")

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
DOCS = [{"title": "Notes", "text": "the sky is green"}]
DEFAULT_T = (
    "{{ bos_token }}{% if documents %}<docs>{{ documents | tojson }}</docs>{% endif %}"
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
TOOL_T = (
    "{{ bos_token }}<tools>{{ tools | tojson }}</tools>"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def make_tok_dir(
    src: Path,
    dst: Path,
    config: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    special_map: dict[str, Any] | None = None,
    files: dict[str, str] | None = None,
) -> Path:
    """A tokenizer directory: ``src``'s tokenizer.json and tokenizer_config.json, the config's
    ``drop`` keys removed and ``config`` merged in, plus ``special_map`` and ``files``."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    for k in drop:
        cfg.pop(k, None)
    cfg.update(config or {})
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    if special_map is not None:
        (dst / "special_tokens_map.json").write_text(json.dumps(special_map))
    for name, text in (files or {}).items():
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        (dst / name).write_text(text)
    return dst


def both(d: Path) -> tuple[RouterTokenizer, Any]:
    return RouterTokenizer.from_model_dir(d), transformers.AutoTokenizer.from_pretrained(str(d))


def hf_ids(hf: Any, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# ---- 1. special tokens only in special_tokens_map.json --------------------------------------

BOS_AS_DICT = {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False}


@pytest.mark.unit
@pytest.mark.parametrize(
    "config,special_map",
    [
        ({}, {"bos_token": "<s>", "eos_token": "</s>"}),  # only the map names them
        ({}, {"bos_token": BOS_AS_DICT, "eos_token": "</s>"}),  # AddedToken form
        ({"bos_token": "<pad>"}, {"bos_token": "<s>"}),  # the map wins over the config
        ({"bos_token": None}, {"bos_token": "<s>"}),
        # a config with added_tokens_decoder is the new format: the map is not read
        ({"bos_token": "<pad>", "added_tokens_decoder": {}}, {"bos_token": "<s>"}),
    ],
)
def test_special_tokens_map_is_read_as_transformers_reads_it(
    tiny_model, tmp_path, config, special_map
):
    d = make_tok_dir(
        tiny_model, tmp_path / "t", config, ("bos_token", "eos_token", "pad_token"), special_map
    )
    tok, hf = both(d)
    assert tok.special_tokens == hf.special_tokens_map
    assert tok.bos_token_id == hf.bos_token_id and tok.eos_token_id == hf.eos_token_id
    text = tok.apply_chat_template(MSGS, add_generation_prompt=True)
    assert text == hf.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    assert tok.encode(text, False) == hf_ids(hf, MSGS, add_generation_prompt=True)


@pytest.mark.unit
def test_bos_only_in_special_tokens_map_starts_the_chat_prompt(tiny_model, tmp_path):
    d = make_tok_dir(tiny_model, tmp_path / "t", {}, ("bos_token",), {"bos_token": "<s>"})
    tok, hf = both(d)
    ids = tok.encode(tok.apply_chat_template(MSGS, add_generation_prompt=True), False)
    assert ids[0] == hf.bos_token_id == tok.bos_token_id
    assert ids == hf_ids(hf, MSGS, add_generation_prompt=True)


# ---- 2. named chat templates ----------------------------------------------------------------

NAMED_LIST = [{"name": "default", "template": DEFAULT_T}, {"name": "tool_use", "template": TOOL_T}]


def named_dirs(src: Path, root: Path) -> dict[str, Path]:
    return {
        "config_list": make_tok_dir(src, root / "a", {"chat_template": NAMED_LIST}),
        "jinja_files": make_tok_dir(
            src,
            root / "b",
            drop=("chat_template",),
            files={
                "chat_template.jinja": DEFAULT_T,
                "additional_chat_templates/tool_use.jinja": TOOL_T,
            },
        ),
        # template files replace the config's templates, all of them
        "jinja_over_list": make_tok_dir(
            src, root / "c", {"chat_template": NAMED_LIST}, files={"chat_template.jinja": DEFAULT_T}
        ),
    }


@pytest.mark.unit
@pytest.mark.parametrize("layout", ["config_list", "jinja_files", "jinja_over_list"])
def test_named_templates_are_chosen_as_transformers_chooses(tiny_model, tmp_path, layout):
    tok, hf = both(named_dirs(tiny_model, tmp_path)[layout])
    cases: list[dict[str, Any]] = [
        {},
        {"tools": TOOLS},
        {"documents": DOCS},
    ]
    if layout != "jinja_over_list":
        cases.append({"chat_template": "tool_use"})  # a template's name, as transformers takes it
        cases.append({"chat_template": "default", "tools": TOOLS})
    for kw in cases:
        want = hf.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True, **kw)
        kw = dict(kw)
        template = kw.pop("chat_template", None)
        got = tok.apply_chat_template(MSGS, template, add_generation_prompt=True, **kw)
        assert got == want, kw
    with_tools = tok.apply_chat_template(MSGS, tools=TOOLS)
    assert ("<tools>" in with_tools) == (layout != "jinja_over_list")


@pytest.mark.unit
def test_named_templates_without_a_default_need_a_name_or_tools(tiny_model, tmp_path):
    d = make_tok_dir(
        tiny_model,
        tmp_path / "t",
        {"chat_template": [{"name": "tool_use", "template": TOOL_T}]},
    )
    tok, hf = both(d)
    with pytest.raises(ValueError, match="no default"):
        hf.apply_chat_template(MSGS, tokenize=False)
    with pytest.raises(ChatTemplateError, match="no default"):
        tok.apply_chat_template(MSGS)
    assert tok.apply_chat_template(MSGS, tools=TOOLS) == hf.apply_chat_template(
        MSGS, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )


# ---- 3. continue_final_message keeps trailing whitespace -------------------------------------

TRIMMING_T = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>"
    "{% endfor %}"
)


@pytest.mark.unit
@pytest.mark.parametrize(
    "final,template",
    [
        (final, template)
        for final in ("one, two, ", "one,\n\n", "  one", "", "x\t ")
        for template in (None, TRIMMING_T)
        if final or template is None  # a trimmed empty message leaves nothing to find
    ],
)
def test_continue_final_message_matches_transformers(tiny_model, final, template):
    tok, hf = both(tiny_model)
    msgs = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": final}]
    want = hf.apply_chat_template(
        msgs, tokenize=False, continue_final_message=True, chat_template=template
    )
    got = tok.apply_chat_template(
        msgs, template, add_generation_prompt=False, continue_final_message=True
    )
    assert got == want
    if template is None:
        assert got.endswith("<|im_start|>assistant\n" + final)


# ---- 4 to 7: the HTTP endpoints -------------------------------------------------------------


@pytest.fixture(scope="module")
def named_tok_dir(tiny_model, tmp_path_factory) -> Path:
    """Named templates and a BOS that only special_tokens_map.json names."""
    return make_tok_dir(
        tiny_model,
        tmp_path_factory.mktemp("round3") / "tok",
        {"chat_template": NAMED_LIST},
        ("bos_token",),
        {"bos_token": "<s>"},
    )


@pytest.fixture(scope="module")
def router(tiny_model, named_tok_dir, redis_server):
    with router_with_one_worker(
        tiny_model,
        redis_server.url,
        "r3",
        tokenizer=str(named_tok_dir),
        trust_request_chat_template=True,
    ) as r:
        yield r


@pytest.fixture(scope="module")
def plain_router(tiny_model, redis_server):
    with router_with_one_worker(tiny_model, redis_server.url, "r3p") as r:
        yield r


def post(r, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{r.url}{path}", json={"model": MODEL_NAME, **body}, timeout=30)


@pytest.mark.integration
def test_chat_and_tokenize_render_what_transformers_renders(router, named_tok_dir):
    """/tokenize and /v1/chat/completions: BOS from special_tokens_map.json, the tool_use
    template with tools, the documents; /tokenize passes tools and documents as chat does."""
    hf = transformers.AutoTokenizer.from_pretrained(str(named_tok_dir))
    for kw in ({}, {"tools": TOOLS}, {"documents": DOCS}, {"chat_template": "tool_use"}):
        want = hf_ids(hf, MSGS, add_generation_prompt=True, **kw)
        assert want[0] == hf.bos_token_id
        r = post(router, "/tokenize", messages=MSGS, **kw)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == want, kw
        chat = post(
            router,
            "/v1/chat/completions",
            messages=MSGS,
            max_tokens=2,
            ignore_eos=True,
            return_token_ids=True,
            **({"tool_choice": "none"} if "tools" in kw else {}),
            **kw,
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["prompt_token_ids"] == want, kw


@pytest.mark.integration
def test_tokenize_refuses_malformed_tools(plain_router):
    r = post(plain_router, "/tokenize", messages=MSGS, tools=[{"type": "retrieval"}])
    assert_error(r, 400, param="tools.0")


@pytest.mark.integration
def test_tokenize_with_tools_matches_the_chat_prompt(plain_router, tiny_model):
    tok = RouterTokenizer.from_model_dir(tiny_model)
    want = tok.encode(tok.apply_chat_template(MSGS, tools=TOOLS), False)
    assert want != tok.encode(tok.apply_chat_template(MSGS), False)
    r = post(plain_router, "/tokenize", messages=MSGS, tools=TOOLS)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == want


@pytest.mark.integration
@pytest.mark.parametrize(
    "body,param,named",
    [
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
        ({"max_output_tokens": 10**7}, "max_output_tokens", "max_output_tokens"),
        ({"max_output_tokens": "many"}, "max_output_tokens", None),
        (
            {"text": {"format": {"type": "json_schema", "name": "x"}}},
            "text.format",
            "text.format",
        ),
        (
            {
                "text": {
                    "format": {"type": "json_schema", "name": "x", "schema": {"a": "b" * 300000}}
                }
            },
            "text.format",
            None,
        ),
        (
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                    {
                        "type": "function_call",
                        "call_id": "c2",
                        "name": "f",
                        "arguments": '{"a": "\\ud800"}',
                    },
                ],
                "instructions": "be brief",
            },
            "input.2.arguments",
            None,
        ),
        ({"input": "word " * 6000}, "input", None),  # longer than the context window
        ({"tools": [{"type": "function"}], "tool_choice": "none"}, "tools.0", None),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": []}], "tool_choice": "none"},
            "tools.0",
            None,
        ),
    ],
)
def test_responses_errors_name_the_responses_parameters(plain_router, body, param, named):
    req = {"input": "hi", **body}
    err = assert_error(post(plain_router, "/v1/responses", **req), 400, param=param)
    for chat_name in ("max_completion_tokens", "response_format", "messages", "function."):
        assert chat_name not in err["message"], err
    if named is not None:
        assert named in err["message"]


@pytest.mark.integration
def test_detokenize_names_tokens(plain_router):
    assert_error(post(plain_router, "/detokenize", tokens=[1, 10**9]), 400, param="tokens")


@pytest.mark.integration
def test_response_ids_use_openais_underscore_form(plain_router):
    body = post(plain_router, "/v1/responses", input="hi", max_output_tokens=3).json()
    assert body["id"].startswith("resp_") and "-" not in body["id"], body["id"]
    assert all(item["id"].startswith(("msg_", "fc_")) for item in body["output"])
    with httpx.stream(
        "POST",
        f"{plain_router.url}/v1/responses",
        json={"model": MODEL_NAME, "input": "hi", "max_output_tokens": 3, "stream": True},
        timeout=30,
    ) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
    assert events[0]["response"]["id"].startswith("resp_")
    assert "-" not in events[0]["response"]["id"]
    assert r.headers["x-request-id"] == events[0]["response"]["id"]


# ---- 8. /health hides the registry's error from unauthenticated callers ---------------------

KEY = "key-round3-0123456789"
DETAIL = "registry unavailable: ConnectionError('Error 111 connecting to 10.1.2.3:6380.')"


class _Pool:
    last_error = DETAIL

    def healthy(self, role: str) -> list[str]:
        return ["w0"] if role == "decode" else []


def _health(app, headers: dict[str, str] | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            return await c.get("/health", headers=headers)

    return asyncio.run(go())


@pytest.mark.unit
@pytest.mark.parametrize("api_key", [(KEY,), ()])
def test_health_hides_the_registry_error_unless_authenticated(api_key):
    from router.config import RouterConfig
    from router.server import create_app

    app = create_app(
        RouterConfig(
            model="unused", served_model_name=MODEL_NAME, decode_workers=("h:1",), api_key=api_key
        )
    )
    app.state.pool = _Pool()
    for headers in (None, {"Authorization": "Bearer wrong-key-000000"}):
        r = _health(app, headers)
        assert r.status_code == 200
        assert r.json()["registry"] == "unavailable"
        assert "10.1.2.3" not in r.text and "6380" not in r.text
    if api_key:
        r = _health(app, {"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["registry"] == DETAIL
    app.state.pool.last_error = None
    assert _health(app).json()["registry"] == "ok"
