"""The HTTP edge shared by the gateway and the node: errors to responses, request bodies in.

Every HTTP server of ours answers a ``SwarmrouteError`` the same way: its status, its OpenAI-shaped body
(``to_body``) and its headers (``http_headers``: ``Retry-After`` on a 429), whether the request went through
Starlette (``EXCEPTION_HANDLERS``) or through the node's fast lane (``answer``). Bodies are read once, the same
way, with the same limits and the same 400/413 answers (``read_body``, ``read_model``); a JSON body is UTF-8, at
most ``MAX_JSON_DEPTH`` levels deep, with finite numbers and no lone UTF-16 surrogates (``check_json``), so that
nothing a client sends can fail later, deep inside, as a 500.

Anything else that escapes a handler is a real internal error: a 500, logged once with its traceback. A client
that goes away before its answer (``ClientGone``) is no error at all: answered (to nobody) with status 499, nginx's
"client closed request", so that request metrics count it apart from the 5xx, and not logged here (whoever raises
it logs the cancellation, once, at info).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bus.hotpath import Answer
from schemas.errors import (
    BadRequestError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    SwarmrouteError,
    error_for_status,
    validation_error,
)

__all__ = ["EXCEPTION_HANDLERS", "MAX_JSON_DEPTH", "ClientGone", "InternalErrors", "edge_app", "answer", "check_json",
           "error_response", "parse_json", "read_body", "read_model"]

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)

MAX_JSON_DEPTH = 64
"""Most levels of nesting a JSON body may have (the outer object is level 1). Deeper bodies would reach Python's
recursion limit in whatever walks them next (pydantic's serializers, ``jsonschema``, the tail's grammar converter);
no request of ours needs more (the gateway allows a JSON Schema ``gateway.constraints.MAX_SCHEMA_DEPTH``, less)."""

CLIENT_CLOSED_REQUEST = 499
"""The status a request whose client went away is counted with (nginx's; the client never reads it)."""

_SURROGATE = re.compile("[\ud800-\udfff]")


class ClientGone(Exception):
    """The client went away before its answer: the request is cancelled, not failed."""


def error_response(exc: SwarmrouteError) -> Response:
    # ASCII JSON: a message that quotes the client's text can never fail to encode (a lone surrogate would).
    return Response(json.dumps(exc.to_body()), status_code=exc.status, headers=exc.http_headers() or None,
                    media_type="application/json")


def answer(exc: SwarmrouteError) -> Answer:
    """The same answer as ``error_response``, for servers that write raw HTTP (the node's fast lane)."""
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in exc.http_headers().items()]
    return exc.status, json.dumps(exc.to_body()).encode(), headers


async def _swarmroute(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SwarmrouteError)
    return error_response(exc)


async def _validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ValidationError)
    return error_response(validation_error(exc))


async def _http(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error_response(NotFoundError(f"no such endpoint: {request.method} {request.url.path}"))
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return error_response(MethodNotAllowedError(
            f"{request.method} is not allowed on {request.url.path} (allowed: {allowed or 'none'})", allow=allowed))
    return error_response(error_for_status(exc.status_code, str(exc.detail)))


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(SwarmrouteError(f"internal error: {type(exc).__name__}"))


EXCEPTION_HANDLERS: Mapping[Any, Any] = {
    SwarmrouteError: _swarmroute,
    ValidationError: _validation,
    HTTPException: _http,
    ClientGone: _client_gone,
    Exception: _unexpected,
}
"""Starlette's ``exception_handlers`` for every app of ours. Starlette answers ``Exception`` in its outermost
middleware and then raises it again for the server to log: a second traceback, which ``InternalErrors`` spares."""


class InternalErrors:
    """ASGI middleware, to add first (innermost): what no exception handler took is a real internal error, logged
    once with its request and answered with a 500 (if nothing was sent yet), and not raised further, where
    Starlette's catch-all would answer it and then raise it again for the server to log a second time."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if isinstance(exc, ClientDisconnect) or isinstance(exc.__cause__, ClientDisconnect | ClientGone):
                return  # the client left mid-answer (an ASGI 2.4 server raises on send): cancelled, no error
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            if not started:
                await error_response(SwarmrouteError(f"internal error: {type(exc).__name__}"))(scope, receive, send)


def edge_app(routes: Sequence[BaseRoute]) -> Starlette:
    """A Starlette app answering errors as every app of ours does: the handlers above, and ``InternalErrors`` so
    that a real internal error is one 500 and one traceback."""
    return Starlette(routes=list(routes), exception_handlers=EXCEPTION_HANDLERS,
                     middleware=[Middleware(InternalErrors)])


async def read_body(receive: Receive, headers: Mapping[bytes, bytes], limit: int) -> bytes:
    """The whole request body, at most ``limit`` bytes (413 beyond: by the declared length at once, else as it
    streams in); a client that goes away mid-body is a 400."""
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"request body of {declared.decode()} bytes exceeds the limit of {limit} bytes")
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequestError("the client went away before sending the whole body")
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


def parse_json(body: bytes) -> object:
    """A JSON body as Python values, checked (``check_json``); a 400 saying what is wrong for anything else."""
    try:
        # surrogatepass: a lone surrogate encoded as bytes (ED A0 80) gets through to check_json, which names its
        # field, instead of failing here with a byte offset; every other byte that is not UTF-8 still fails here.
        text = body.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as exc:
        raise BadRequestError(f"request body is not valid JSON: it is not UTF-8 ({exc})") from None
    try:
        raw = json.loads(text)
    except RecursionError:
        raise BadRequestError(f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except ValueError as exc:  # JSONDecodeError, and an integer of more than 4300 digits
        raise BadRequestError(f"request body is not valid JSON: {exc}") from None
    check_json(raw)
    return raw


def check_json(value: object, max_depth: int = MAX_JSON_DEPTH) -> None:
    """A 400 naming the field for what JSON can carry but no request may: nesting deeper than ``max_depth``, a
    number that is not finite (Python's parser reads ``NaN``, ``Infinity`` and ``1e999``) and text with a lone
    UTF-16 surrogate (``"\\ud800"``: no Unicode character, it cannot be encoded as UTF-8 for the next hop)."""
    stack: list[tuple[dict[str, Any] | list[Any], tuple[str | int, ...]]] = []
    if isinstance(value, dict | list):
        stack.append((value, ()))
    else:
        _check_scalar(value, ())
    while stack:
        node, path = stack.pop()
        if len(path) >= max_depth:
            where = _where(path[:3]) + (".…" if len(path) > 3 else "")
            raise BadRequestError(f"{where}: the request body is nested more than {max_depth} levels deep",
                                  param=_param(path))
        for key, item in node.items() if isinstance(node, dict) else enumerate(node):
            if isinstance(key, str) and _SURROGATE.search(key):
                raise _surrogate(path + (key,))
            if isinstance(item, dict | list):
                stack.append((item, path + (key,)))
            elif isinstance(item, str | float):
                _check_scalar(item, path + (key,))


def _check_scalar(value: object, path: tuple[str | int, ...]) -> None:
    if isinstance(value, str):
        if _SURROGATE.search(value):
            raise _surrogate(path)
    elif isinstance(value, float) and not math.isfinite(value):
        raise BadRequestError(f"{_where(path)}: {value} is not a JSON number (NaN and infinities are not JSON; "
                              f"numbers must be finite)", param=_param(path))


def _surrogate(path: tuple[str | int, ...]) -> BadRequestError:
    return BadRequestError(f"{_where(path)}: the text holds a lone UTF-16 surrogate, which is no Unicode character "
                           f"(a surrogate escape like \\ud83d must pair with a low one like \\ude00)",
                           param=_param(path))


def _where(path: tuple[str | int, ...]) -> str:
    return _printable(".".join(str(p) for p in path)) or "body"


def _param(path: tuple[str | int, ...]) -> str | None:
    return _printable(str(path[0])) if path else None


def _printable(text: str) -> str:
    """``text`` with its surrogates written as escapes: a field name can be the bad text itself."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


async def read_model(request: Request, model: type[M], limit: int) -> M:
    """A JSON object body validated as ``model``; 400 naming the field for anything else."""
    raw = parse_json(await read_body(request.receive, dict(request.scope["headers"]), limit))
    if not isinstance(raw, dict):
        raise BadRequestError("request body must be a JSON object")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None
