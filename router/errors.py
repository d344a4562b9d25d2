"""Named router errors; each maps to one HTTP status and OpenAI's error JSON.

``{"error": {"message": str, "type": str, "param": str | null, "code": str | int | null}}``
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any


class RouterError(Exception):
    """Base class: ``status`` is the HTTP status, ``err_type``/``code`` go into the JSON."""

    status: int = 500
    err_type: str = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }


class InvalidRequestError(RouterError):
    """Bad parameters or a prompt the model cannot take (400)."""

    status = HTTPStatus.BAD_REQUEST
    err_type = "invalid_request_error"


class AuthenticationError(RouterError):
    status = HTTPStatus.UNAUTHORIZED
    err_type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFoundError(RouterError):
    status = HTTPStatus.NOT_FOUND
    err_type = "invalid_request_error"
    code = "model_not_found"


class NotFoundError(RouterError):
    status = HTTPStatus.NOT_FOUND
    err_type = "invalid_request_error"
    code = "not_found"


class RequestTooLargeError(RouterError):
    status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    err_type = "invalid_request_error"
    code = "request_too_large"


class RequestTimeoutError(RouterError):
    """The client stopped sending its request body (408)."""

    status = HTTPStatus.REQUEST_TIMEOUT
    err_type = "invalid_request_error"
    code = "request_timeout"


class OverloadedError(RouterError):
    """Admission refused: too many requests in flight here or queued on the workers (429)."""

    status = HTTPStatus.TOO_MANY_REQUESTS
    err_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, retry_after_s))})


class NoWorkerError(RouterError):
    """No healthy worker can serve the request (503)."""

    status = HTTPStatus.SERVICE_UNAVAILABLE
    err_type = "service_unavailable_error"
    code = "no_worker_available"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Retry-After": "1"})


class UpstreamError(RouterError):
    """Workers failed and the retries are used up (502)."""

    status = HTTPStatus.BAD_GATEWAY
    err_type = "server_error"
    code = "upstream_error"


class RequestFailedError(RouterError):
    """The request itself failed on a worker (500, no retry: another worker would fail it too,
    and the worker that reported it is healthy)."""

    status = HTTPStatus.INTERNAL_SERVER_ERROR
    err_type = "server_error"
    code = "request_failed"


class DeadlineExceededError(RouterError):
    """The request did not finish within ``--request-timeout`` (504)."""

    status = HTTPStatus.GATEWAY_TIMEOUT
    err_type = "timeout_error"
    code = "request_timeout"
