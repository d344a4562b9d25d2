"""The router's HTTP server: ``create_app(config)`` and the ``pdserve router`` entry point.

Routes are thin; the logic lives in ``router/serving*.py``. Everything stateful (tokenizer,
Redis client, worker pool with its gRPC channels, dispatcher, metrics) is built in the app's
lifespan and closed in ``finally``. This module must never import torch (``pdserve router``
runs in images without it).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterable
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as pkg_version
from pathlib import Path
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.body import BodyError, JSONBodyRoute
from router.config import RouterConfig, check_tls_files
from router.context import ServingContext
from router.dashboard import Dashboard, LiveStats, add_dashboard_routes
from router.dispatch import DispatchConfig, Dispatcher
from router.errors import (
    AuthenticationError,
    InvalidRequestError,
    NotFoundError,
    RequestTimeoutError,
    RequestTooLargeError,
    RouterError,
)
from router.metrics import RouterMetrics
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from router.sampling import Limits
from router.serving_chat import create_chat_completion
from router.serving_completions import create_completion
from router.serving_responses import create_response
from router.serving_tokens import detokenize, models, tokenize
from router.sse import RAW_SEND, ClientDisconnected
from router.tokenizer import RouterTokenizer
from router.workers import WorkerPool
from shared.config import ConfigError, EngineArgs, ModelConfig
from shared.directory import (
    ROLE_DECODE,
    ROLE_PREFILL,
    DirectoryKeys,
    DirectoryReader,
    connect_async,
    make_member,
)
from shared.directory.mirror import DirectoryMirror
from shared.prom import freeze_startup_heap

logger = logging.getLogger(__name__)
_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# open without a key: the readiness probes, /health and /ping (SageMaker's, as vLLM serves
# it), and /metrics with --disable-metrics-auth
_OPEN_PATHS = ("/health", "/ping")
AUTHENTICATED = "api_key_valid"  # request.state flag: the request carried a valid API key
# pages a person opens in a browser: their 401 asks for HTTP Basic auth, so the browser
# prompts once and then sends the credentials itself, also with the page's own requests
_BROWSER_PATHS = ("/dashboard", "/docs", "/redoc", "/openapi.json")
_REALM = 'realm="pdserve"'
_MIRROR_BLOCK_S = 1.0  # longest wait of the directory mirror's XREAD
_CLEANUP_TIMEOUT_S = 5.0  # the lifespan clean-up after uvicorn stopped serving


def load_model_files(
    config: RouterConfig,
) -> tuple[RouterTokenizer, ModelConfig, dict[str, float]]:
    """Tokenizer, model config and sampling defaults; raises ConfigError/ValueError if unusable."""
    model_cfg = EngineArgs(
        model=config.model, served_model_name=config.name, max_model_len=config.max_model_len
    ).create_model_config()
    tok = RouterTokenizer.from_model_dir(config.model, config.tokenizer, config.chat_template)
    gen_file = Path(config.model) / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    defaults = {k: gen[k] for k in _GENERATION_KEYS if isinstance(gen.get(k), (int, float))}
    return tok, model_cfg, defaults


#: The longest a client may pause while sending its request body (nginx's
#: ``client_body_timeout``); past it the request ends 408. uvicorn has no such bound: a client
#: that sent its headers and part of a body held the request's task and connection for ever.
BODY_IDLE_TIMEOUT_S = 60.0


class _BodyStalled(Exception):
    """The client sent nothing of its request body for ``BODY_IDLE_TIMEOUT_S``."""


class _BodyLimit:
    """ASGI middleware: 413 for bodies over ``max_bytes`` (declared or streamed), 408 for a
    body whose next part does not come within ``idle_timeout_s``."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, idle_timeout_s: float = BODY_IDLE_TIMEOUT_S
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.idle_timeout_s = idle_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(scope, send)
        stalled = False
        bounded = self._bounded(receive)

        async def body_receive() -> Message:
            nonlocal stalled
            try:
                return await bounded()
            except _BodyStalled:
                stalled = True
                raise

        async def guarded_send(message: Message) -> None:
            if not stalled:  # else the app's answer to the stall (FastAPI: a 400): ours goes
                await send(message)

        if declared is not None:
            try:
                await self.app(scope, body_receive, guarded_send)
            except Exception:
                if not stalled:
                    raise
            if stalled:
                await self._stalled(scope, send)
            return None
        body: list[Message] = []
        more = True  # chunked: buffer up to the limit, then replay
        size = 0
        while more:
            try:
                message = await bounded()
            except _BodyStalled:
                return await self._stalled(scope, send)
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message]), send)
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._reject(scope, send)
            body.append(message)
            more = message.get("more_body", False)
        return await self.app(scope, _replay(body, receive), send)

    def _bounded(self, receive: Receive) -> Receive:
        """``receive`` whose waits for the body's next part are bounded; once the body is
        complete (or the client left) it waits as long as the app likes (a stream's
        disconnect watch)."""
        complete = False

        async def bounded() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.idle_timeout_s)
            except TimeoutError:
                raise _BodyStalled from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                complete = True
            return message

        return bounded

    async def _stalled(self, scope: Scope, send: Send) -> None:
        err = RequestTimeoutError(
            f"the request body stalled: nothing arrived for {self.idle_timeout_s:g} s"
        )
        headers = {"Connection": "close"}  # what is left of the body would read as a request
        response = JSONResponse(err.to_dict(), status_code=err.status, headers=headers)
        await response(scope, _replay([]), send)

    async def _reject(self, scope: Scope, send: Send) -> None:
        err = RequestTooLargeError(f"request body exceeds {self.max_bytes} bytes")
        await JSONResponse(err.to_dict(), status_code=err.status)(scope, _replay([]), send)


def _replay(messages: Iterable[Message], then: Receive | None = None) -> Receive:
    queue = list(messages)

    # Any, not Message: the last branch never returns (waits forever), which mypy cannot see
    async def receive() -> Any:
        if queue:
            return queue.pop(0)
        if then is not None:
            return await then()
        await asyncio.Event().wait()  # never returns: nothing more will come

    return receive


class _RouterApp(FastAPI):
    """FastAPI that also puts the server's own ``send`` into every HTTP scope (under
    ``RAW_SEND``), for :class:`router.sse.SSEResponse`'s per-token body chunks."""

    def build_middleware_stack(self) -> ASGIApp:
        stack = super().build_middleware_stack()

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                scope[RAW_SEND] = send
            await stack(scope, receive, send)

        return app


def create_app(config: RouterConfig) -> FastAPI:
    """A new router app; nothing is shared between apps."""
    metrics = RouterMetrics(config.name)
    live = LiveStats()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tok, model_cfg, defaults = await asyncio.to_thread(load_model_files, config)
        redis_client = connect_async(config.redis_url) if config.redis_url else None
        reader = (
            DirectoryReader(redis_client, DirectoryKeys(config.directory_prefix))
            if redis_client is not None
            else None
        )
        # the router's own copy of the directory, on a connection of its own (XREAD blocks)
        mirror = (
            DirectoryMirror(
                connect_async(config.redis_url, timeout_s=_MIRROR_BLOCK_S + 1, max_connections=2),
                DirectoryKeys(config.directory_prefix),
                config.name,
                block_ms=int(_MIRROR_BLOCK_S * 1000),
            )
            if config.redis_url and config.directory_lookup == "mirror"
            else None
        )
        pool = WorkerPool(
            model=config.name,
            reader=reader,
            static_decode=config.decode_workers,
            static_prefill=config.prefill_workers,
            static_block_size=config.block_size,
            refresh_interval_s=config.worker_refresh_interval_s,
            cooldown_s=config.worker_cooldown_s,
            security=config.security,
            mux_stall_timeout_s=config.worker_stall_timeout_s,
        )
        dispatcher = Dispatcher(
            pool,
            reader,
            config.name,
            DispatchConfig(
                max_retries=config.max_retries,
                stall_timeout_s=config.stall_timeout_s,
                mux=config.decode_stream == "mux",
                directory_timeout_s=config.directory_timeout_s,
                max_waiting_per_worker=config.max_waiting_per_worker,
                policy=config.policy,
            ),
            metrics,
            mirror=mirror,
        )
        mirror_task = None
        if mirror is not None:
            mirror.live_members = lambda: {
                make_member(r.worker_id, r.generation) for r in pool.records() if r.generation
            }
            metrics.watch_mirror(mirror)
            mirror_task = asyncio.create_task(mirror.run(), name="directory-mirror")
        eos = set(model_cfg.eos_token_ids)
        if tok.eos_token_id is not None:
            eos.add(tok.eos_token_id)
        limits = Limits(
            max_model_len=model_cfg.max_model_len,
            # the ids a worker accepts: its embedding's rows
            vocab_size=model_cfg.vocab_size,
            max_logprobs=config.max_logprobs,
            eos_token_ids=frozenset(eos),
            generation_defaults=defaults,
            max_n=config.max_n,
            max_prompts=config.max_prompts_per_request,
            max_choices=config.max_choices_per_request,
            max_stop_strings=config.max_stop_strings,
            max_stop_chars=config.max_stop_chars,
            max_cache_salt_chars=config.max_cache_salt_length,
            max_json_depth=config.max_json_depth,
        )
        sweeper = None
        app.state.dashboard = Dashboard(pool, metrics.registry, live, config.name)
        try:
            await pool.start()
            if reader is not None and config.directory_sweep_interval_s > 0:
                sweeper = asyncio.create_task(_sweep(reader, config))
            app.state.ctx = ServingContext(
                config.name,
                tok,
                dispatcher,
                limits,
                metrics,
                config.request_timeout_s,
                config.max_inflight_requests,
                live=live,
                tools=config.tools,
                trust_request_chat_template=config.trust_request_chat_template,
            )
            app.state.pool = pool
            # Everything built so far lives as long as the router: move it out of the GC's
            # generations, so a full collection (triggered by a large request's objects)
            # scans only request objects and stays short (vLLM's API server does the same)
            freeze_startup_heap()
            logger.info(
                "router for %r: max_model_len %d, %d decode / %d prefill workers known",
                config.name,
                limits.max_model_len,
                len(pool.records(ROLE_DECODE)),
                len(pool.records(ROLE_PREFILL)),
            )
            yield
        finally:
            try:  # bounded: a stuck connection must not keep the process alive after SIGTERM
                async with asyncio.timeout(_CLEANUP_TIMEOUT_S):
                    for task in (sweeper, mirror_task):
                        if task is not None:
                            task.cancel()
                            await asyncio.gather(task, return_exceptions=True)
                    if mirror is not None:
                        await mirror.client.aclose()
                    await dispatcher.close()
                    await app.state.dashboard.close()
                    await pool.close()
                    if redis_client is not None:
                        await redis_client.aclose()
            except TimeoutError:
                logger.warning(
                    "router clean-up took over %.0f s; exiting without it", _CLEANUP_TIMEOUT_S
                )

    app = _RouterApp(title="pdserve router", lifespan=lifespan)
    app.router.route_class = JSONBodyRoute
    app.state.config = config
    app.state.metrics = metrics
    app.state.live = live
    _install_error_handlers(app, metrics)
    app.add_middleware(
        _BodyLimit, max_bytes=config.max_request_body_bytes, idle_timeout_s=BODY_IDLE_TIMEOUT_S
    )
    if config.api_key:  # outermost: unauthenticated bodies are not even read
        open_paths = _OPEN_PATHS + (("/metrics",) if config.disable_metrics_auth else ())
        app.add_middleware(
            _ApiKey, api_keys=config.api_key, metrics=metrics, open_paths=frozenset(open_paths)
        )
    _add_routes(app, config)
    return app


def _add_routes(app: FastAPI, config: RouterConfig) -> None:
    started = int(time.time())

    def ctx(request: Request) -> ServingContext:
        return cast(ServingContext, request.app.state.ctx)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx(request), body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx(request), body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(ctx(request), body, request)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        return JSONResponse(models(ctx(request), config.model, started).model_dump())

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest, request: Request) -> Response:
        return JSONResponse((await tokenize(ctx(request), body)).model_dump())

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest, request: Request) -> Response:
        return JSONResponse((await detokenize(ctx(request), body)).model_dump())

    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 when at least one decode worker is routable, else 503 (readiness). The route
        is open: the registry's error (Redis's host and port) shows only to a caller with an
        API key, anyone else reads "unavailable" (the pool logs the error)."""
        pool: WorkerPool = request.app.state.pool
        decode, prefill = pool.healthy(ROLE_DECODE), pool.healthy(ROLE_PREFILL)
        registry = "ok"
        if pool.last_error is not None:
            detail = getattr(request.state, AUTHENTICATED, False)
            registry = pool.last_error if detail else "unavailable"
        body = {
            "status": "ok" if decode else "no_decode_workers",
            "decode_workers": len(decode),
            "prefill_workers": len(prefill),
            "registry": registry,
        }
        return JSONResponse(body, status_code=200 if decode else 503)

    # SageMaker's health probe, GET or POST as vLLM serves it: /health's answer (a route per
    # method: one route of both gave the OpenAPI schema the same operation id twice)
    for method in ("GET", "POST"):
        app.add_api_route("/ping", health, methods=[method], operation_id=f"ping_{method.lower()}")

    @app.get("/metrics")
    async def metrics_route(request: Request) -> Response:
        return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    add_dashboard_routes(app)

    @app.get("/version")
    async def version() -> Response:
        try:
            v = pkg_version("pdserve")
        except PackageNotFoundError:
            v = "unknown"
        return JSONResponse({"version": v})


class _ApiKey:
    """ASGI middleware: 401 on every path but ``open_paths`` (any method, unknown paths
    included, so nothing about the routes shows) unless the request carries one of
    ``api_keys``: ``Authorization: Bearer KEY``, or HTTP Basic auth with the key as the
    password (any user name). The digests of the token and of every key are compared, all of
    them each time, in constant time: neither a key's length nor which key matched shows in
    the timing."""

    def __init__(
        self,
        app: ASGIApp,
        api_keys: tuple[str, ...],
        metrics: RouterMetrics,
        open_paths: frozenset[str],
    ) -> None:
        if not api_keys:
            raise ValueError("_ApiKey needs at least one key")
        self.app = app
        self.digests = tuple(hashlib.sha256(k.encode()).digest() for k in api_keys)
        self.metrics = metrics
        self.open_paths = open_paths

    def _valid(self, token: bytes) -> bool:
        got = hashlib.sha256(token).digest()
        ok = False
        for digest in self.digests:  # no early exit
            ok |= hmac.compare_digest(got, digest)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        sent, token = _credentials(scope["headers"])
        if token is not None and self._valid(token):
            # an open route (/health) shows a key holder more than anyone else
            scope.setdefault("state", {})[AUTHENTICATED] = True
            return await self.app(scope, receive, send)
        if scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":  # no such route today; refused all the same
            self.metrics.error(403)
            return await send({"type": "websocket.close", "code": 1008})
        path: str = scope["path"]
        basic = any(path == p or path.startswith(p + "/") for p in _BROWSER_PATHS)
        if basic:
            challenge = f"Basic {_REALM}"
        else:
            challenge = f"Bearer {_REALM}" + (', error="invalid_token"' if sent else "")
        if sent:
            err = AuthenticationError("invalid API key")
        else:
            err = AuthenticationError(
                "missing API key: send 'Authorization: Bearer KEY' (or HTTP Basic auth "
                "with the key as the password)"
            )
        if sent or not basic:  # a browser's first, credential-less load is the challenge's
            self.metrics.error(err.status)  # handshake: opening the dashboard was an "error"
        return await JSONResponse(
            err.to_dict(),
            status_code=err.status,
            headers={"WWW-Authenticate": challenge, "Cache-Control": "no-store"},
        )(scope, _replay([]), send)


def _credentials(headers: Iterable[tuple[bytes, bytes]]) -> tuple[bool, bytes | None]:
    """(whether an Authorization header came, the key it carries or None). More than one
    Authorization header, an unknown scheme or a malformed Basic value carry no key."""
    values = [v for k, v in headers if k == b"authorization"]
    if not values:
        return False, None
    if len(values) > 1:
        return True, None
    scheme, _, rest = values[0].strip().partition(b" ")
    rest = rest.strip()
    scheme = scheme.lower()
    if scheme == b"bearer":
        return True, rest or None
    if scheme == b"basic":
        try:
            decoded = base64.b64decode(rest, validate=True)
        except (binascii.Error, ValueError):
            return True, None
        _user, colon, password = decoded.partition(b":")
        return True, password if colon and password else None
    return True, None


def _install_error_handlers(app: FastAPI, metrics: RouterMetrics) -> None:
    @app.exception_handler(RouterError)
    async def router_error(_: Request, e: RouterError) -> Response:
        metrics.error(e.status)
        if e.status >= 500:
            logger.warning("%s: %s", type(e).__name__, e.message)
        return JSONResponse(e.to_dict(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> Response:
        errors = e.errors()
        if errors and tuple(errors[0].get("loc", ())) == ("body",):
            # the body as a whole: a JSON array / null / string, or not sent as JSON at all
            # (curl's -d without -H sends a form type, which FastAPI does not parse)
            ctype = request.headers.get("content-type", "")
            why = (
                f" (it was sent as {ctype!r}: send Content-Type: application/json)"
                if "json" not in ctype.lower()
                else ""
            )
            err = InvalidRequestError("the request body must be a JSON object" + why, param="body")
            metrics.error(err.status)
            return JSONResponse(err.to_dict(), status_code=err.status)
        parts = [
            f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body')}: {err.get('msg')}"
            for err in errors[:5]
        ]
        first = errors[0].get("loc", ()) if errors else ()
        param = ".".join(str(x) for x in first if x != "body") or None
        err = InvalidRequestError("invalid request: " + "; ".join(parts), param=param)
        metrics.error(err.status)
        return JSONResponse(err.to_dict(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        if isinstance(e, BodyError):
            metrics.error(e.error.status)
            return JSONResponse(e.error.to_dict(), status_code=e.error.status)
        if e.status_code == 404:
            body = NotFoundError(f"no such endpoint: {request.method} {request.url.path}").to_dict()
        else:
            body = {
                "error": {
                    "message": str(e.detail),
                    "type": "invalid_request_error",
                    "param": None,
                    "code": e.status_code,
                }
            }
        return JSONResponse(body, status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, e: ClientDisconnected) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> Response:
        logger.exception("unhandled error")
        metrics.error(500)
        err = RouterError("internal server error")
        return JSONResponse(err.to_dict(), status_code=500)


async def _sweep(reader: DirectoryReader, config: RouterConfig) -> None:
    """Janitor: clean stale directory members a bounded batch at a time."""
    task = asyncio.current_task()
    assert task is not None
    cursor = 0
    while True:
        await asyncio.sleep(config.directory_sweep_interval_s if cursor == 0 else 0.05)
        try:
            cursor, removed = await reader.sweep(config.name, cursor, count=500)
            if removed:
                logger.info("directory sweep removed %d stale entries", removed)
        except Exception as e:  # noqa: BLE001 - the janitor must outlive any failure
            logger.debug("directory sweep failed: %r", e)
            cursor = 0
        if task.cancelling():  # a cancel redis-py's wait_for swallowed (Python 3.11): stop
            raise asyncio.CancelledError


# ---- CLI ------------------------------------------------------------------------------------


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    RouterConfig.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # work moved off the event loop (long prompts' rendering, big responses) runs Python in a
    # thread: a 1 ms switch interval (CPython's default is 5) gives the loop its turn sooner
    sys.setswitchinterval(0.001)
    try:
        config = RouterConfig.from_cli_args(args)
        check_tls_files(config)
        load_model_files(config)  # fail fast with a clear message, before binding the port
    except (ConfigError, ValueError, OSError) as e:
        print(f"pdserve router: error: {e}", file=sys.stderr)
        return 2
    _log_access_settings(config)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            host=config.host,
            port=config.port,
            ssl_keyfile=config.ssl_keyfile,
            ssl_certfile=config.ssl_certfile,
            ssl_ca_certs=config.ssl_ca_certs,
            ssl_cert_reqs=config.ssl_cert_reqs,
            log_level=config.uvicorn_log_level,
            access_log=config.access_log,
            timeout_keep_alive=30,
            # uvicorn annotates an int, but uses it as an asyncio timeout: a float works
            timeout_graceful_shutdown=config.shutdown_timeout_s,  # type: ignore[arg-type]
        )
    )
    sockets = None
    if config.fd is not None:
        # the socket's own family (uvicorn's --fd would take it for a Unix socket, and every
        # client address with it)
        try:
            sockets = [socket.socket(fileno=config.fd)]
        except OSError as e:
            print(f"pdserve router: error: --fd {config.fd}: {e}", file=sys.stderr)
            return 2
        host, port = sockets[0].getsockname()[:2]
        scheme = "https" if config.ssl_certfile else "http"
        logger.info(
            "serving on %s://%s:%d (inherited socket, fd %d)", scheme, host, port, config.fd
        )
    server.run(sockets=sockets)
    return 0 if server.started else 3  # uvicorn.run's exit status when it could not start


def _log_access_settings(config: RouterConfig) -> None:
    """How clients get in, in one line (the number of keys, never a key)."""
    loopback = config.host in ("127.0.0.1", "::1", "localhost")
    if not config.api_key:
        (logger.info if loopback else logger.warning)(
            "no API key configured: every route on %s:%d is open", config.host, config.port
        )
    else:
        logger.info(
            "%d API key(s) configured: required on every route but /health, /ping%s",
            len(config.api_key),
            " and /metrics" if config.disable_metrics_auth else "",
        )
        if not config.tls and not loopback:
            logger.warning(
                "API keys are sent in clear text: serve HTTPS (--ssl-certfile/--ssl-keyfile) "
                "or put a TLS proxy in front"
            )
    if config.tls:
        reqs = {0: "not asked for", 1: "checked if sent", 2: "required"}[config.ssl_cert_reqs]
        logger.info("serving HTTPS; client certificates %s", reqs)
