"""A request's own ``chat_template``: refused with vLLM's 400 unless the router runs with
``--trust-request-chat-template``; with it, the request's template renders the prompt (both
the ``chat_template`` field and ``chat_template_kwargs.chat_template``), and a template that
does not parse or fails while rendering is a 400 naming ``chat_template``.

Before these tests the router accepted the field as an unknown extra and silently rendered
the model's own template instead."""

from __future__ import annotations

import httpx
import pytest
from router_harness import MODEL_NAME, load_fake_worker_module, router_with_one_worker
from test_router_errors import assert_error

from router.tokenizer import RouterTokenizer

pytestmark = pytest.mark.integration
fw = load_fake_worker_module()
VOCAB = 2048

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
TEMPLATE = "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}{% endfor %}"
RENDERED = "<<system>>be brief<<user>>hi there"
UNTRUSTED = "--trust-request-chat-template is not set"


@pytest.fixture(scope="module")
def plain(tiny_model, redis_server):
    with router_with_one_worker(tiny_model, redis_server.url, "tplu") as router:
        yield router


@pytest.fixture(scope="module")
def trusting(tiny_model, redis_server):
    with router_with_one_worker(
        tiny_model, redis_server.url, "tplt", trust_request_chat_template=True
    ) as router:
        yield router


@pytest.fixture(scope="module")
def tok(tiny_model) -> RouterTokenizer:
    return RouterTokenizer.from_model_dir(tiny_model)


def post(r, path: str, **body) -> httpx.Response:
    return httpx.post(f"{r.url}{path}", json={"model": MODEL_NAME, **body}, timeout=20)


def chat(r, **body) -> httpx.Response:
    return post(r, "/v1/chat/completions", messages=MSGS, max_tokens=6, ignore_eos=True, **body)


def test_untrusted_router_refuses_a_request_template(plain):
    for body in (
        {"chat_template": TEMPLATE},
        {"chat_template_kwargs": {"chat_template": TEMPLATE}},
    ):
        assert_error(chat(plain, **body), 400, param="chat_template", contains=UNTRUSTED)
        assert_error(
            post(plain, "/tokenize", messages=MSGS, **body),
            400,
            param="chat_template",
            contains=UNTRUSTED,
        )
    # other template kwargs stay allowed, and the model's template still serves
    assert chat(plain, chat_template_kwargs={"enable_thinking": False}).status_code == 200


def test_trusted_request_template_renders_the_prompt(trusting, tok):
    want = tok.encode(RENDERED, False)
    r = post(trusting, "/tokenize", messages=MSGS, chat_template=TEMPLATE)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == want
    # the kwargs form, with the other kwargs still template variables
    r = post(
        trusting,
        "/tokenize",
        messages=MSGS,
        chat_template_kwargs={"chat_template": "{{ lead }}" + TEMPLATE, "lead": "##"},
    )
    assert r.json()["tokens"] == tok.encode("##" + RENDERED, False)
    # a completion's prompt is that rendering: the fake worker's output is a function of it
    r = chat(trusting, chat_template=TEMPLATE)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(want)
    toks, _ = fw.expected_output(want, max_tokens=6, vocab=VOCAB, ignore_eos=True)
    assert body["choices"][0]["message"]["content"] == tok.decode(toks)
    # without one, the model's template as before
    own = tok.encode(tok.apply_chat_template(MSGS, add_generation_prompt=True), False)
    assert chat(trusting).json()["usage"]["prompt_tokens"] == len(own) != len(want)


@pytest.mark.parametrize(
    ("template", "contains"),
    [
        ("{% for m in messages %}", "does not compile"),
        ("{{ raise_exception('no system role here') }}", "no system role here"),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "could not render"),
        ("{{ 1 // 0 }}", "could not render"),
    ],
)
def test_a_bad_request_template_is_a_400(trusting, template, contains):
    assert_error(
        chat(trusting, chat_template=template), 400, param="chat_template", contains=contains
    )
    assert_error(
        post(
            trusting,
            "/v1/chat/completions",
            messages=MSGS,
            chat_template_kwargs={"chat_template": 7},
        ),
        400,
        param="chat_template_kwargs",
    )
    assert chat(trusting).status_code == 200


def test_a_template_that_renders_too_long_is_a_400_on_a_daemon_thread(trusting, monkeypatch):
    """Jinja's sandbox bounds what a template touches, not how long it loops: a request's
    template is cut off after ``REQUEST_TEMPLATE_TIMEOUT_S`` (a 400 naming it), its render goes
    on in a daemon thread (neither asyncio's default executor nor the router's exit waits for
    it). Before, the request waited for the render however long it took."""
    import time

    from router import serving_chat

    monkeypatch.setattr(serving_chat, "REQUEST_TEMPLATE_TIMEOUT_S", 0.3)
    slow = "{% for i in range(6000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}x"
    r = chat(trusting, chat_template=slow)  # renders in ~2 s here: a 200 without the bound
    assert_error(r, 400, param="chat_template", contains="did not render within 0.3 s")
    pool = serving_chat._template_pool
    assert pool is not None and all(t.daemon for t in pool._threads)
    assert chat(trusting).status_code == 200  # the router serves meanwhile
    deadline = time.monotonic() + 60  # let the render end: it would slow the tests after
    while pool._idle < len(pool._threads):
        assert time.monotonic() < deadline
        time.sleep(0.05)
