"""API keys at the router's HTTP edge: where they come from (flags, files, environment), and
that every route but ``/health`` and ``/ping`` needs one, listed from the app so a route added
later is covered without touching this file.

The ``unit`` tests drive the ASGI app in-process (no lifespan, no worker: a request without a
valid key never gets past the middleware); the ``integration`` ones run a router with a fake
worker and check what an authorised request gets on each route.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import uuid
from dataclasses import replace

import httpx
import openai
import pytest
from router_harness import MODEL_NAME, ROOT, FakeWorker, RouterThread
from starlette.routing import Route

from router.config import RouterConfig, collect_api_keys, read_api_key_file
from router.server import _BROWSER_PATHS, _ApiKey, create_app

KEYS = ("key-alpha-0123456789", "key-beta-9876543210")
WRONG = "key-alpha-0123456788"  # same length, one character off
BROWSER = ("/dashboard", "/dashboard/data", "/docs", "/docs/oauth2-redirect", "/redoc")
MISSING_MSG = (
    "missing API key: send 'Authorization: Bearer KEY' (or HTTP Basic auth with the key as "
    "the password)"
)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def auth_error(message: str) -> dict:
    return {
        "error": {
            "message": message,
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }


def challenge(path: str, sent: bool) -> str:
    if any(path == p or path.startswith(p + "/") for p in BROWSER + ("/openapi.json",)):
        return 'Basic realm="pdserve"'
    return 'Bearer realm="pdserve"' + (', error="invalid_token"' if sent else "")


def assert_401(resp: httpx.Response, path: str, *, sent: bool) -> None:
    assert resp.status_code == 401, (path, resp.status_code, resp.text)
    assert resp.headers["www-authenticate"] == challenge(path, sent), path
    if resp.request.method != "HEAD":
        assert resp.json() == auth_error("invalid API key" if sent else MISSING_MSG), path


def app_routes(app) -> list[tuple[str, str]]:
    """(method, path) of every HTTP route of ``app``, HEAD included where Starlette adds it."""
    out = []
    for route in app.routes:
        if isinstance(route, Route):
            out += [(m, route.path) for m in sorted(route.methods or ())]
    assert len(out) >= 14, out  # the list is really read from the app
    return out


def make_config(**kw) -> RouterConfig:
    base = {"model": "unused", "served_model_name": MODEL_NAME, "decode_workers": ("h:1",)}
    return RouterConfig(**{**base, **kw})


def call(app, method: str, path: str, headers: dict[str, str] | None = None, **kw):
    """One request to ``app`` in-process (no lifespan, no socket)."""

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            return await c.request(method, path, headers=headers, **kw)

    return asyncio.run(go())


def errors_counted(app, status: int) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = app.state.metrics.render().decode()
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "pdserve:router_request_errors_total" and s.labels["status"] == str(status)
    )


# ---- where keys come from ---------------------------------------------------------------


def parse(*argv: str) -> RouterConfig:
    parser = argparse.ArgumentParser()
    RouterConfig.add_cli_args(parser)
    return RouterConfig.from_cli_args(
        parser.parse_args(["--model", "m", "--decode-workers", "h:1", *argv])
    )


@pytest.fixture
def no_key_env(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)


@pytest.mark.unit
def test_no_key_anywhere_means_no_key(no_key_env, monkeypatch):
    assert parse().api_key == ()
    monkeypatch.setenv("PDSERVE_API_KEY", "")  # docker-compose passes an unset one as ""
    monkeypatch.setenv("VLLM_API_KEY", " , ")
    assert parse().api_key == ()


@pytest.mark.unit
def test_api_key_flag_takes_several_keys_and_repeats(no_key_env):
    assert parse("--api-key", "k1").api_key == ("k1",)
    assert parse("--api-key", "k1", "k2", "--api-key", "k3", "k1").api_key == ("k1", "k2", "k3")


@pytest.mark.unit
def test_keys_from_flags_files_and_both_env_vars_are_merged(no_key_env, monkeypatch, tmp_path):
    f1, f2 = tmp_path / "a.keys", tmp_path / "b.keys"
    f1.write_text("file-1\nshared\n")
    f2.write_text("file-2\n")
    monkeypatch.setenv("PDSERVE_API_KEY", " env-1 , shared,,env-2 ")
    monkeypatch.setenv("VLLM_API_KEY", "vllm-1,env-1")
    cfg = parse("--api-key", "cli-1", "--api-key-file", str(f1), "--api-key-file", str(f2))
    assert cfg.api_key == ("cli-1", "file-1", "shared", "file-2", "env-1", "env-2", "vllm-1")
    monkeypatch.delenv("PDSERVE_API_KEY")
    assert parse().api_key == ("vllm-1", "env-1")


@pytest.mark.unit
def test_api_key_file_skips_blank_lines_and_comments(tmp_path):
    f = tmp_path / "keys"
    f.write_bytes(
        b"# keys for the router\r\n\r\n  key-one  \r\n   # an indented comment\n\t\n"
        b"key-two#not-a-comment\nkey-one\n"
    )
    assert read_api_key_file(str(f)) == ("key-one", "key-two#not-a-comment", "key-one")
    assert collect_api_keys(None, [str(f)], {}) == ("key-one", "key-two#not-a-comment")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "cannot read it: No such file or directory"),
        ("DIR", "cannot read it: Is a directory"),
        (b"", "no key in it (one key per line; blank lines and lines starting with # are ignored)"),
        (b"\n  \n# only a comment\n", "no key in it"),
        (b"\xff\xfe\x00k", "cannot read it: UnicodeDecodeError"),
        (b"good\nhas zqx in it\n", "line 2: an API key may hold only printable ASCII"),
        (b"zq\xc3\xa9-key\n", "line 1: an API key may hold only printable ASCII"),
    ],
)
def test_api_key_file_errors_are_clear_and_never_echo_a_key(tmp_path, content, expected):
    f = tmp_path / "keys"
    if content == "DIR":
        f.mkdir()
    elif content is not None:
        f.write_bytes(content)
    with pytest.raises(ValueError) as e:
        read_api_key_file(str(f))
    assert str(e.value).startswith(f"--api-key-file {f}")
    assert expected in str(e.value)
    for secret in ("zq", "good"):
        assert secret not in str(e.value).replace(str(f), "")


@pytest.mark.unit
def test_a_key_file_others_can_read_is_warned_about_without_the_key(tmp_path, caplog):
    f = tmp_path / "keys"
    f.write_text("s3cret-key-value\n")
    f.chmod(0o600)
    with caplog.at_level("WARNING", logger="router.config"):
        read_api_key_file(str(f))
    assert caplog.records == []
    f.chmod(0o644)
    with caplog.at_level("WARNING", logger="router.config"):
        read_api_key_file(str(f))
    assert [r.getMessage() for r in caplog.records] == [
        f"--api-key-file {f} can be read by other users (mode 644): chmod 600 it"
    ]
    assert "s3cret" not in caplog.text


@pytest.mark.unit
@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (("--api-key", ""), "--api-key: empty API key"),
        (("--api-key", "two words"), "--api-key: an API key may hold only printable ASCII"),
        ({"VLLM_API_KEY": "ok,bad\tkey"}, "$VLLM_API_KEY: an API key may hold only printable"),
    ],
)
def test_unusable_keys_are_refused(no_key_env, monkeypatch, source, expected):
    if isinstance(source, dict):
        for k, v in source.items():
            monkeypatch.setenv(k, v)
        source = ()
    with pytest.raises(ValueError) as e:
        parse(*source)
    assert str(e.value).startswith(expected)
    assert "words" not in str(e.value) and "bad" not in str(e.value)


@pytest.mark.unit
def test_keys_never_show_in_the_config_repr():
    cfg = make_config(api_key=KEYS)
    assert cfg.api_key == KEYS
    text = repr(cfg) + str(cfg)
    assert "api_key" not in text and "key-alpha" not in text and "key-beta" not in text
    assert "served_model_name='tiny'" in text  # the repr itself still works
    assert not next(f for f in dataclasses.fields(cfg) if f.name == "api_key").repr


@pytest.mark.unit
def test_config_takes_one_key_as_a_string_or_none():
    assert make_config(api_key="solo").api_key == ("solo",)
    assert make_config(api_key=None).api_key == ()
    assert replace(make_config(api_key=KEYS), api_key=None).api_key == ()
    assert make_config(api_key=["a", "b", "a"]).api_key == ("a", "b")
    with pytest.raises(ValueError, match="API key #2: empty API key"):
        make_config(api_key=("a", ""))
    with pytest.raises(ValueError, match="api_key must be a tuple of strings"):
        make_config(api_key=(b"bytes",))


def test_cli_key_errors_exit_2_before_anything_starts(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PDSERVE_API_KEY", "VLLM_API_KEY")}
    out = subprocess.run(
        [sys.executable, "-m", "shared.cli", "router", "--model", str(tmp_path / "none")]
        + ["--redis-url", "redis://127.0.0.1:1", "--api-key-file", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
        env=env,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"pdserve router: error: --api-key-file {tmp_path / 'missing'}: "
        "cannot read it: No such file or directory"
    )


# ---- the middleware on its own ----------------------------------------------------------


class _Inner:
    """An ASGI app that records what reached it and answers 200 with the path."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        self.paths.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": scope["path"].encode()})


def raw_call(app, path: str, headers: list[tuple[bytes, bytes]], method: str = "POST"):
    """An ASGI call by hand: (status, headers, body, how often the body was read)."""
    reads = 0
    sent: list[dict] = []

    async def receive():
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": b"x" * 10, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "scheme": "http",
        "query_string": b"",
        "headers": [(b"content-length", b"10"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"], reads


def middleware(open_paths=("/health",)):
    from router.metrics import RouterMetrics

    inner = _Inner()
    app = _ApiKey(
        inner, api_keys=KEYS, metrics=RouterMetrics("m"), open_paths=frozenset(open_paths)
    )
    return inner, app


@pytest.mark.unit
@pytest.mark.parametrize(
    "header",
    [
        None,
        b"Bearer",
        b"Bearer ",
        b"Bearer " + WRONG.encode(),
        b"Bearer " + KEYS[0].encode() + b"x",
        b"Bearer " + KEYS[0][:-1].encode(),
        b"Bearer " + f"{KEYS[0]},{KEYS[1]}".encode(),
        b"Token " + KEYS[0].encode(),
        KEYS[0].encode(),
        b"Basic " + base64.b64encode(KEYS[0].encode()),  # no "user:" part
        b"Basic " + base64.b64encode(f"{KEYS[0]}:".encode()),  # the key as the user name
        b"Basic " + base64.b64encode(f"u:{WRONG}".encode()),
        b"Basic not*base64",
        b"Basic " + base64.b64encode(b"u:"),
    ],
)
def test_middleware_rejects_without_reading_the_body(header):
    inner, app = middleware()
    headers = [] if header is None else [(b"authorization", header)]
    status, resp_headers, body, reads = raw_call(app, "/v1/completions", headers)
    assert (status, reads, inner.paths) == (401, 0, [])
    sent = header is not None
    assert resp_headers[b"www-authenticate"] == challenge("/v1/completions", sent).encode()
    assert json.loads(body) == auth_error("invalid API key" if sent else MISSING_MSG)


@pytest.mark.unit
@pytest.mark.parametrize(
    "header",
    [
        b"Bearer " + KEYS[0].encode(),
        b"Bearer " + KEYS[1].encode(),
        b"bearer " + KEYS[0].encode(),  # the scheme is case-insensitive (RFC 9110)
        b"BEARER   " + KEYS[1].encode() + b" ",
        b"Basic " + base64.b64encode(f"anyone:{KEYS[0]}".encode()),
        b"Basic " + base64.b64encode(f":{KEYS[1]}".encode()),  # empty user name
        b"basic " + base64.b64encode(f"user:{KEYS[0]}".encode()),
    ],
)
def test_middleware_lets_any_configured_key_through(header):
    inner, app = middleware()
    status, _, body, _ = raw_call(app, "/v1/completions", [(b"authorization", header)])
    assert (status, body, inner.paths) == (200, b"/v1/completions", ["/v1/completions"])


@pytest.mark.unit
def test_two_authorization_headers_are_refused_even_if_one_is_right():
    inner, app = middleware()
    good = (b"authorization", b"Bearer " + KEYS[0].encode())
    bad = (b"authorization", b"Bearer " + WRONG.encode())
    for headers in ([good, bad], [bad, good], [good, good]):
        status, _, body, _ = raw_call(app, "/v1/models", headers, method="GET")
        assert (status, json.loads(body)["error"]["message"]) == (401, "invalid API key")
    assert inner.paths == []


@pytest.mark.unit
def test_middleware_compares_digests_of_every_key(monkeypatch):
    """Each check compares sha256 digests (fixed length: a key's length does not show) with
    every configured key, also after a match."""
    import router.server as server

    compared: list[tuple[bytes, bytes]] = []
    real = server.hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(server.hmac, "compare_digest", spy)
    _, app = middleware()
    raw_call(app, "/v1/models", [(b"authorization", b"Bearer " + KEYS[0].encode())], "GET")
    got = hashlib.sha256(KEYS[0].encode()).digest()
    assert compared == [(got, hashlib.sha256(k.encode()).digest()) for k in KEYS]


@pytest.mark.unit
def test_middleware_needs_a_key():
    with pytest.raises(ValueError):
        _ApiKey(_Inner(), api_keys=(), metrics=None, open_paths=frozenset())


# ---- the app: every route -----------------------------------------------------------------


@pytest.fixture(scope="module")
def app():
    return create_app(make_config(api_key=KEYS))


def _unknown_paths() -> list[tuple[str, str]]:
    return [
        ("GET", "/"),
        ("GET", "/nope"),
        ("POST", "/v1/nope"),
        ("GET", "/health/"),  # only /health itself is open (no redirect before auth)
        ("GET", "/healthz"),
        ("GET", "/v1/models/"),
        ("DELETE", "/v1/models"),  # a known path, a method it does not have
        ("OPTIONS", "/v1/chat/completions"),  # no CORS middleware: no preflight to let by
        ("GET", "/metrics/x"),
        ("GET", "/dashboard/nope"),
    ]


@pytest.mark.unit
def test_without_a_key_every_route_but_health_is_401(app):
    before = errors_counted(app, 401)
    counted = 0
    for method, path in app_routes(app) + _unknown_paths():
        if path in ("/health", "/ping"):  # the readiness probes
            continue
        assert_401(call(app, method, path), path, sent=False)
        for headers in (bearer(WRONG), basic("admin", WRONG), {"Authorization": "Basic"}):
            assert_401(call(app, method, path, headers), path, sent=True)
        # every 401 is counted but a browser path's challenge to a request without
        # credentials (a browser asks that way first: opening the dashboard is no error)
        browser = any(path == p or path.startswith(p + "/") for p in _BROWSER_PATHS)
        counted += 3 if browser else 4
    assert errors_counted(app, 401) - before == counted


@pytest.mark.unit
def test_an_unauthenticated_oversized_body_gets_401_not_413(app):
    resp = call(app, "POST", "/v1/completions", {"Content-Length": str(1 << 40)}, content=b"{}")
    assert_401(resp, "/v1/completions", sent=False)


@pytest.mark.unit
def test_browser_pages_ask_for_basic_auth(app):
    for path in BROWSER + ("/openapi.json",):
        resp = call(app, "GET", path)
        assert resp.headers["www-authenticate"] == 'Basic realm="pdserve"', path
    for path in ("/v1/models", "/metrics", "/version", "/dashboardx"):
        assert call(app, "GET", path).headers["www-authenticate"] == 'Bearer realm="pdserve"'


@pytest.mark.unit
def test_no_key_configured_means_no_auth_middleware():
    plain = create_app(make_config())
    assert not any(m.cls is _ApiKey for m in plain.user_middleware)
    assert call(plain, "GET", "/nope").status_code == 404
    keyed = create_app(make_config(api_key=KEYS))
    assert keyed.user_middleware[0].cls is _ApiKey  # outermost


# ---- a running router: what an authorised request gets ----------------------------------

# the request each non-GET route gets, and what a right answer looks like; a new route
# fails test_with_a_key_every_route_serves until it is added here
POSTS = {
    "/v1/completions": (
        {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
        lambda b: b["object"] == "text_completion" and b["usage"]["completion_tokens"] == 2,
    ),
    "/v1/chat/completions": (
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        lambda b: b["object"] == "chat.completion" and b["usage"]["completion_tokens"] == 2,
    ),
    "/v1/responses": (
        {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2},
        lambda b: b["object"] == "response" and b["usage"]["output_tokens"] == 2,
    ),
    "/tokenize": ({"model": MODEL_NAME, "prompt": "hi"}, lambda b: b["count"] == len(b["tokens"])),
    "/detokenize": (
        {"model": MODEL_NAME, "tokens": [1, 2]},
        lambda b: isinstance(b["prompt"], str),
    ),
    "/ping": ({}, lambda b: b["status"] == "ok"),  # SageMaker's probe: GET or POST
}
GETS = {  # GET routes whose body is checked beyond the status
    "/v1/models": lambda r: r.json()["data"][0]["id"] == MODEL_NAME,
    "/health": lambda r: r.json()["status"] == "ok",
    "/ping": lambda r: r.json()["status"] == "ok",
    "/metrics": lambda r: "pdserve:router_request_errors_total" in r.text,
    "/dashboard": lambda r: r.text.startswith("<!doctype html>"),
    "/dashboard/data": lambda r: r.json()["workers"][0]["id"] == "auth-d0",
    "/version": lambda r: set(r.json()) == {"version"},
    "/openapi.json": lambda r: "/v1/chat/completions" in r.json()["paths"],
}


@pytest.fixture(scope="module")
def cluster(tiny_model, redis_server):
    prefix = f"auth{uuid.uuid4().hex[:6]}:"
    worker = FakeWorker(redis_server.url, prefix, "auth-d0")
    routers: list[RouterThread] = []
    try:
        cfg = RouterConfig(
            model=str(tiny_model),
            served_model_name=MODEL_NAME,
            redis_url=redis_server.url,
            directory_prefix=prefix,
            worker_refresh_interval_s=0.1,
            request_timeout_s=30,
            api_key=KEYS,
        )
        routers.append(RouterThread(cfg))
        routers.append(RouterThread(replace(cfg, disable_metrics_auth=True)))
        for r in routers:
            r.wait_workers(1)
        yield routers
    finally:
        for r in routers:
            r.stop()
        worker.stop()


@pytest.mark.integration
def test_with_a_key_every_route_serves(cluster):
    r = cluster[0]
    for key in KEYS:
        for method, path in app_routes(r.app):
            if method in ("GET", "HEAD"):
                resp = httpx.request(method, f"{r.url}{path}", headers=bearer(key), timeout=10)
                assert resp.status_code == 200, (method, path, resp.text)
                if method == "GET" and path in GETS:
                    assert GETS[path](resp), (path, resp.text[:300])
            else:
                assert (method, path in POSTS) == ("POST", True), f"add {method} {path} to POSTS"
                body, ok = POSTS[path]
                resp = httpx.post(f"{r.url}{path}", json=body, headers=bearer(key), timeout=10)
                assert resp.status_code == 200, (path, resp.text)
                assert ok(resp.json()), (path, resp.text)


@pytest.mark.integration
def test_with_a_key_an_unknown_path_is_404(cluster):
    resp = httpx.get(f"{cluster[0].url}/nope", headers=bearer(KEYS[1]), timeout=10)
    assert resp.status_code == 404
    assert resp.json()["error"] == {
        "message": "no such endpoint: GET /nope",
        "type": "invalid_request_error",
        "param": None,
        "code": "not_found",
    }


@pytest.mark.integration
def test_health_is_open_and_everything_else_is_not(cluster):
    r = cluster[0]
    resp = httpx.get(f"{r.url}/health", timeout=10)
    assert (resp.status_code, resp.json()["status"]) == (200, "ok")
    for method in ("GET", "POST"):  # /ping (SageMaker's probe, vLLM's): open as /health
        resp = httpx.request(method, f"{r.url}/ping", timeout=10)
        assert (resp.status_code, resp.json()["status"]) == (200, "ok"), method
    for path in ("/metrics", "/v1/models", "/dashboard/data", "/docs"):
        assert_401(httpx.get(f"{r.url}{path}", timeout=10), path, sent=False)
    resp = httpx.post(f"{r.url}/v1/completions", json=POSTS["/v1/completions"][0], timeout=10)
    assert_401(resp, "/v1/completions", sent=False)


@pytest.mark.integration
def test_the_dashboard_works_with_basic_auth(cluster):
    r = cluster[0]
    for user in ("admin", "", "someone else"):
        with httpx.Client(base_url=r.url, auth=(user, KEYS[1]), timeout=10) as browser:
            page = browser.get("/dashboard")
            assert page.status_code == 200 and page.text.startswith("<!doctype html>")
            data = browser.get("/dashboard/data")
            assert data.status_code == 200 and data.json()["workers"][0]["id"] == "auth-d0"
            # the same credentials serve the API too (e.g. the /docs page's "try it out")
            assert browser.get("/v1/models").json()["data"][0]["id"] == MODEL_NAME
    with httpx.Client(base_url=r.url, auth=("admin", WRONG), timeout=10) as browser:
        assert_401(browser.get("/dashboard"), "/dashboard", sent=True)
        assert_401(browser.get("/dashboard/data"), "/dashboard/data", sent=True)


@pytest.mark.integration
def test_the_openai_sdk_with_each_key_and_a_wrong_one(cluster):
    r = cluster[0]
    for key in KEYS:
        assert [m.id for m in r.openai(api_key=key).models.list()] == [MODEL_NAME]
    with pytest.raises(openai.AuthenticationError) as e:
        r.openai(api_key=WRONG).chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    assert e.value.status_code == 401
    assert e.value.body == auth_error("invalid API key")["error"]


@pytest.mark.integration
def test_rejections_show_in_the_metrics(cluster):
    r = cluster[0]

    def count() -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{r.url}/metrics", headers=bearer(KEYS[0]), timeout=10).text
        return sum(
            s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == "pdserve:router_request_errors_total" and s.labels["status"] == "401"
        )

    before = count()
    for _ in range(3):
        assert httpx.get(f"{r.url}/v1/models", headers=bearer(WRONG), timeout=10).status_code == 401
    assert count() - before == 3
    # a browser opening the dashboard asks without credentials first: that challenge is the
    # Basic handshake, not an error (the dashboard's own error figure counted every page load)
    for path in ("/dashboard", "/dashboard/data"):
        assert httpx.get(f"{r.url}{path}", timeout=10).status_code == 401
    assert count() - before == 3
    auth = httpx.BasicAuth("", WRONG)
    assert httpx.get(f"{r.url}/dashboard", auth=auth, timeout=10).status_code == 401
    assert count() - before == 4


@pytest.mark.integration
def test_metrics_are_open_only_with_disable_metrics_auth(cluster):
    keyed, open_metrics = cluster
    assert_401(httpx.get(f"{keyed.url}/metrics", timeout=10), "/metrics", sent=False)
    resp = httpx.get(f"{open_metrics.url}/metrics", timeout=10)
    assert resp.status_code == 200 and "pdserve:router_requests_total" in resp.text
    # only /metrics: the rest still needs a key
    for path in ("/dashboard/data", "/v1/models", "/metrics/", "/version"):
        assert_401(httpx.get(f"{open_metrics.url}{path}", timeout=10), path, sent=False)
    ok = httpx.get(f"{open_metrics.url}/v1/models", headers=bearer(KEYS[0]), timeout=10)
    assert ok.status_code == 200
