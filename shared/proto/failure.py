"""Whose failure a non-OK gRPC status is: one trailing-metadata entry on the status.

``pdserve-failure: request``: this request failed on the worker (another worker would fail it
too), so the router answers 500 without a retry and without blaming the worker.
``pdserve-failure: engine``: the worker's engine stopped; the router retries elsewhere.
``pdserve-failure: draining``: the worker is draining (SIGTERM) and takes no new request; the
router retries elsewhere.
``pdserve-failure: stall``: set by the router itself on a call it failed because the worker
sent nothing for too long (``shared/proto/mux.py``); the router retries elsewhere.
No entry: classify by the status code alone. No imports: the router uses this module.
"""

FAILURE_KEY = "pdserve-failure"
FAILURE_REQUEST = "request"
FAILURE_ENGINE = "engine"
FAILURE_STALL = "stall"
FAILURE_DRAINING = "draining"


def failure_metadata(kind: str) -> tuple[tuple[str, str], ...]:
    """Trailing metadata for ``context.abort(code, details, failure_metadata(kind))``."""
    return ((FAILURE_KEY, kind),)
