"""Reading JSON request bodies: the checks FastAPI's own parsing lacks, as an ``APIRoute`` class.

FastAPI parses a body with ``json.loads`` (which accepts NaN, lone UTF-16 surrogates and any
nesting its C stack allows) and then validates it with pydantic. :class:`JSONBodyRoute` gives
every route a request whose ``json()`` refuses, with a 400 that says why:

- bytes that are not UTF-8, and bodies that are not JSON, ``NaN`` / ``Infinity`` included
  (Python's parser accepts them; RFC 8259 has no such numbers);
- nesting deeper than the parser's recursion limit (``RecursionError``, never a 500);
- lone surrogates (``"\\ud800"``) anywhere in a string or key: Python keeps them in ``str``,
  but they cannot be encoded as UTF-8 again, so echoing one (a stop string, an error message)
  would fail while writing the response.

Numbers too large for a float (``1e999``) parse as infinity and are refused by the models
(``allow_inf_nan=False``); the body size by the body-limit middleware; deep nesting inside
tools and messages by ``router/sampling.py``.

Validation runs on the event loop and pydantic holds the GIL throughout (a thread would not
help), so a long list of models (22,500 chat messages fit in the 1 MiB limit: ~80 ms in one
go) is validated ahead, a slice per loop turn, and handed to the route's own validation as
model instances, which pydantic takes as they are. A slice that fails leaves the list as sent:
the route's validation then reports the error exactly as it would have.
"""

from __future__ import annotations

import asyncio
import json
import re
import types
import typing
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from router.errors import InvalidRequestError

# a \uD800-\uDFFF escape; only then can a parsed string hold a lone surrogate (raw UTF-8 bytes
# cannot encode one). Pairs are fine (clients with ensure_ascii send emoji that way).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class _NonFiniteNumber(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NonFiniteNumber(name)


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def _non_finite_path(text: str) -> tuple[str, str]:
    """(dotted path, literal) of the first NaN / Infinity in ``text`` (the failure path only)."""
    stack: list[tuple[Any, str]] = [(json.loads(text, parse_constant=_Marker), "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, _Marker):
            return path or "body", v.name
        if isinstance(v, dict):
            stack.extend((c, f"{path}.{k}" if path else str(k)) for k, c in reversed(v.items()))
        elif isinstance(v, list):
            stack.extend(
                (c, f"{path}.{i}" if path else str(i)) for i, c in reversed(list(enumerate(v)))
            )
    return "body", "NaN"


class BodyError(StarletteHTTPException):
    """A body the router refuses before validation; carries the OpenAI-style error."""

    def __init__(self, error: InvalidRequestError) -> None:
        super().__init__(status_code=int(error.status), detail=error.message)
        self.error = error


def parse_json_body(raw: bytes) -> Any:
    """``json.loads`` with the checks above; raises :class:`BodyError`."""
    where: str | None  # path of the offending value, in the error branches
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(
            InvalidRequestError(
                f"the request body is not valid UTF-8 (byte {e.start})", param="body"
            )
        ) from None
    try:
        obj = json.loads(text, parse_constant=_refuse_constant)
    except _NonFiniteNumber:
        where, literal = _non_finite_path(text)
        raise BodyError(
            InvalidRequestError(
                f"{where}: {literal} is not a JSON number (the value must be finite)", param=where
            )
        ) from None
    except json.JSONDecodeError as e:
        raise BodyError(
            InvalidRequestError(
                f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                param="body",
            )
        ) from None
    except RecursionError:
        raise BodyError(
            InvalidRequestError("the request body nests too deeply", param="body")
        ) from None
    if _SURROGATE_ESCAPE.search(raw):
        where = lone_surrogate(obj)
        if where is not None:
            raise BodyError(
                InvalidRequestError(
                    f"{where or 'the body'} holds a lone UTF-16 surrogate, which is not valid "
                    "Unicode text",
                    param=where or "body",
                )
            )
    return obj


def lone_surrogate(obj: Any) -> str | None:
    """Dotted path of the first string or key holding a lone surrogate, or None."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            if not _encodable(v):
                return path
        elif isinstance(v, dict):
            for k, c in v.items():
                p = f"{path}.{k}" if path else str(k)
                if not _encodable(k):
                    return path or "body"
                stack.append((c, p))
        elif isinstance(v, list):
            stack.extend((c, f"{path}.{i}") for i, c in enumerate(v))
    return None


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# lists longer than this are validated ahead in slices of this many items
PREVALIDATE_SLICE = 512


def model_list_fields(model: Any) -> dict[str, TypeAdapter[Any]]:
    """``{name in the body: adapter}`` for the fields of ``model`` typed ``list[SomeModel]``
    (optionally ``| None``)."""
    out: dict[str, TypeAdapter[Any]] = {}
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return out
    for name, f in model.model_fields.items():
        ann = f.annotation
        if typing.get_origin(ann) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(ann) if a is not type(None)]
            ann = args[0] if len(args) == 1 else None
        if typing.get_origin(ann) is list:
            (item,) = typing.get_args(ann)
            if isinstance(item, type) and issubclass(item, BaseModel):
                out[f.alias or name] = TypeAdapter(list[item])  # type: ignore[valid-type]
    return out


async def prevalidate_lists(body: Any, fields: dict[str, TypeAdapter[Any]]) -> None:
    """Replace each long list of models in ``body`` by its validated items, validating one
    slice per event-loop turn; a list with an invalid item is left as it was."""
    if not isinstance(body, dict):
        return
    for name, adapter in fields.items():
        items = body.get(name)
        if not isinstance(items, list) or len(items) <= PREVALIDATE_SLICE:
            continue
        done: list[Any] = []
        for i in range(0, len(items), PREVALIDATE_SLICE):
            await asyncio.sleep(0)
            try:
                done.extend(adapter.validate_python(items[i : i + PREVALIDATE_SLICE]))
            except ValidationError:
                break
        else:
            body[name] = done


class _CheckedJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json


class JSONBodyRoute(APIRoute):
    """An ``APIRoute`` whose handler reads the body through :func:`parse_json_body` and
    validates long lists of models a slice per loop turn (:func:`prevalidate_lists`)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        body_type = self.body_field.field_info.annotation if self.body_field else None
        lists = model_list_fields(body_type)

        async def checked(request: Request) -> Response:
            req = _CheckedJSONRequest(request.scope, request.receive)
            if lists and request.method == "POST":
                try:
                    await prevalidate_lists(await req.json(), lists)
                except BodyError:
                    pass  # the route's handler reads the body again and answers the error
            return await handler(req)

        return checked
