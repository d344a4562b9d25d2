"""Cluster membership: the cluster secret, gRPC call authentication and gRPC TLS.

Every process of one cluster (router, prefill and decode workers) knows the *cluster secret*
(``pdserve up`` generates one; compose and Kubernetes mount it as a secret). It is read from
``--cluster-secret-file`` or the environment (``PDSERVE_CLUSTER_SECRET``), never from a flag
value, so it does not show in ``ps``.

* gRPC: every call between processes carries ``pdserve-cluster-token`` = HMAC-SHA256(secret,
  "grpc") in its metadata; workers refuse calls without the right token with UNAUTHENTICATED
  (compared in constant time). The gRPC health service stays open, for probes (Kubernetes'
  gRPC probe cannot send metadata), and tells nothing but SERVING / NOT_SERVING.
* UCX: the KV transfer handshake proves knowledge of the same secret (``kvtransfer.auth``).
* TLS (optional): ``--grpc-ssl-certfile/--grpc-ssl-keyfile`` make every worker's gRPC server
  TLS; ``--grpc-ssl-ca-certs`` makes clients verify servers against that CA and, on servers,
  requires client certificates from it (mutual TLS). Without TLS the token travels in clear
  text: keep worker ports on a private network (the default binds loopback).

Without a secret, workers accept every call and log a warning saying so.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import hmac
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

logger = logging.getLogger(__name__)

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
SECRET_FILE_ENV = "PDSERVE_CLUSTER_SECRET_FILE"
TOKEN_HEADER = "pdserve-cluster-token"
OPEN_SERVICES = ("/grpc.health.v1.Health/",)  # callable without the token (probes)
_MIN_SECRET_BYTES = 16


class SecurityConfigError(ValueError):
    """The cluster secret or a TLS file is missing, unreadable or too weak."""


def _load_secret(path: str | None, environ: Mapping[str, str]) -> bytes | None:
    """The secret in the file ``path``, else in ``environ[SECRET_ENV]``, else None."""
    if path:
        secret = _read(path, "--cluster-secret-file").strip()
        if not secret:
            raise SecurityConfigError(f"--cluster-secret-file {path!r} is empty")
        return secret
    value = environ.get(SECRET_ENV, "").strip()
    return value.encode() if value else None


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise SecurityConfigError(f"cannot read {what} {path!r}: {e.strerror or e}") from None


@dataclass(frozen=True)
class ClusterSecurity:
    """What one process needs to talk to (or serve) the other cluster members."""

    secret: bytes | None = field(default=None, repr=False)
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    _pem: dict[str, bytes | None] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        if self.secret is not None and len(self.secret) < _MIN_SECRET_BYTES:
            raise SecurityConfigError(
                f"the cluster secret must have at least {_MIN_SECRET_BYTES} bytes "
                "(pdserve up generates 32 random bytes; `openssl rand -hex 32` does too)"
            )
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise SecurityConfigError("give --grpc-ssl-certfile and --grpc-ssl-keyfile together")
        # the PEM files, read once here (a missing one is a start-up error, not a failed call)
        pem = {
            what: _read(path, f"--grpc-ssl-{what}") if path else None
            for what, path in (
                ("certfile", self.ssl_certfile),
                ("keyfile", self.ssl_keyfile),
                ("ca-certs", self.ssl_ca_certs),
            )
        }
        object.__setattr__(self, "_pem", pem)

    # ---- construction ----------------------------------------------------------------

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group(
            "cluster security",
            "how cluster members prove membership to each other (docs/deploy.md, Security)",
        )
        g.add_argument(
            "--cluster-secret-file",
            default=os.environ.get(SECRET_FILE_ENV),
            help="file holding the cluster secret (at least 16 bytes; surrounding whitespace "
            f"is ignored); or set {SECRET_ENV} to the secret itself (env {SECRET_FILE_ENV} "
            "names the file too). Every gRPC call and KV connection between cluster members "
            "proves it; without one, anyone who reaches a worker's port may call it",
        )
        g.add_argument(
            "--grpc-ssl-certfile",
            default=None,
            help="PEM certificate: serve gRPC over TLS (with --grpc-ssl-keyfile), and present "
            "it as a client certificate when calling other members",
        )
        g.add_argument("--grpc-ssl-keyfile", default=None, help="PEM private key of the above")
        g.add_argument(
            "--grpc-ssl-ca-certs",
            default=None,
            help="PEM CA bundle: clients use TLS and verify servers against it; servers "
            "with a certificate then also require client certificates from it (mutual TLS)",
        )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ClusterSecurity:
        return cls(
            secret=_load_secret(getattr(ns, "cluster_secret_file", None), os.environ),
            ssl_certfile=getattr(ns, "grpc_ssl_certfile", None),
            ssl_keyfile=getattr(ns, "grpc_ssl_keyfile", None),
            ssl_ca_certs=getattr(ns, "grpc_ssl_ca_certs", None),
        )

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ClusterSecurity:
        """The secret named by ``environ`` (the file variable first, then the value), no TLS:
        what a child given that environment uses; ``from_environ(os.environ)`` for tools."""
        return cls(secret=_load_secret(environ.get(SECRET_FILE_ENV), environ))

    @classmethod
    def from_env(cls) -> ClusterSecurity:
        """For tools and tests: the secret this process's environment names, no TLS."""
        return cls.from_environ(os.environ)

    @classmethod
    def for_run_dir(cls, run_dir: str | Path) -> ClusterSecurity:
        """The secret of the ``pdserve up --run-dir`` cluster: the environment's, else the one
        it generated in the run directory (tools run by the same user, e.g. ``pdserve fuzz``)."""
        env = cls.from_env()
        path = Path(run_dir) / "cluster-secret"
        if env.secret is None and path.is_file():
            return cls(secret=_load_secret(str(path), {}))
        return env

    # ---- gRPC ------------------------------------------------------------------------

    @functools.cached_property
    def token(self) -> str | None:
        if self.secret is None:
            return None
        return hmac.new(self.secret, b"pdserve-grpc", hashlib.sha256).hexdigest()

    @functools.cached_property
    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata every client call carries (empty without a secret)."""
        t = self.token
        return () if t is None else ((TOKEN_HEADER, t),)

    @property
    def tls(self) -> bool:
        return bool(self.ssl_ca_certs or self.ssl_certfile)

    def _channel_credentials(self) -> grpc.ChannelCredentials:
        pem = self._pem
        return grpc.ssl_channel_credentials(
            root_certificates=pem["ca-certs"],
            private_key=pem["keyfile"],
            certificate_chain=pem["certfile"],
        )

    def aio_channel(self, address: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
        if self.tls:
            return grpc.aio.secure_channel(address, self._channel_credentials(), options=options)
        return grpc.aio.insecure_channel(address, options=options)

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A blocking channel whose every call carries the token (tools, probes, tests)."""
        if self.tls:
            ch = grpc.secure_channel(address, self._channel_credentials(), options=options)
        else:
            ch = grpc.insecure_channel(address, options=options)
        if self.secret is None:
            return ch
        return grpc.intercept_channel(ch, _TokenInterceptor(self.call_metadata))

    def add_port(self, server: Any, address: str) -> int:
        """Bind ``server`` (sync or aio) to ``address``, with TLS when configured."""
        if not self.ssl_certfile:
            return int(server.add_insecure_port(address))
        pem = self._pem
        key, cert = pem["keyfile"], pem["certfile"]
        assert key is not None and cert is not None  # given together (__post_init__)
        creds = grpc.ssl_server_credentials(
            [(key, cert)],
            root_certificates=pem["ca-certs"],
            require_client_auth=pem["ca-certs"] is not None,
        )
        return int(server.add_secure_port(address, creds))

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [] if self.token is None else [ClusterAuthInterceptor(self.token)]

    def warn_if_open(self, what: str) -> None:
        if self.secret is None:
            logger.warning(
                "%s: no cluster secret (--cluster-secret-file or %s): anyone who reaches its "
                "ports may call it and push KV to it; pdserve up, compose and the Kubernetes "
                "manifests always set one",
                what,
                SECRET_ENV,
            )


class ClusterAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but the health service's unless it carries the cluster token."""

    def __init__(self, token: str):
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        method = details.method or ""  # type: ignore[attr-defined]
        handler = await continuation(details)
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        got = b""
        for key, value in details.invocation_metadata or ():  # type: ignore[attr-defined]
            if key == TOKEN_HEADER:
                got = value.encode() if isinstance(value, str) else bytes(value)
        if hmac.compare_digest(got, self._token):
            return handler
        return _refusal(handler, "no cluster token" if not got else "wrong cluster token")


def _refusal(handler: Any, why: str) -> Any:
    message = f"not a member of this cluster ({why}): calls need the cluster secret"

    async def unary(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises

    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.stream_stream_rpc_method_handler(streaming, **kw)


class _TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Blocking-channel interceptor adding the token to every call."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self._metadata = metadata

    def _details(self, d: Any) -> Any:
        return _Details(
            d.method,
            d.timeout,
            (*(d.metadata or ()), *self._metadata),
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, d: Any, request: Any) -> Any:
        return continuation(self._details(d), request)

    def intercept_unary_stream(self, continuation: Any, d: Any, request: Any) -> Any:
        return continuation(self._details(d), request)

    def intercept_stream_unary(self, continuation: Any, d: Any, it: Any) -> Any:
        return continuation(self._details(d), it)

    def intercept_stream_stream(self, continuation: Any, d: Any, it: Any) -> Any:
        return continuation(self._details(d), it)


class _Details(grpc.ClientCallDetails):
    def __init__(
        self,
        method: str,
        timeout: float | None,
        metadata: Any,
        credentials: Any,
        wait_for_ready: Any,
        compression: Any,
    ):
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression
