"""The HTTP edge shared by the gateway and the node: errors to responses, request bodies in.

Every HTTP server of ours answers a ``SwarmrouteError`` the same way: its status, its OpenAI-shaped body
(``to_body``) and its headers (``http_headers``: ``Retry-After`` on a 429), whether the request went through
Starlette (``EXCEPTION_HANDLERS``) or through the node's fast lane (``answer``). Bodies are read once, the same
way, with the same limits and the same 400/413 answers (``read_body``, ``read_model``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from bus.hotpath import Answer
from schemas.errors import (
    BadRequestError,
    NotFoundError,
    PayloadTooLargeError,
    SwarmrouteError,
    error_for_status,
    validation_error,
)

__all__ = ["EXCEPTION_HANDLERS", "answer", "error_response", "read_body", "read_model"]

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


def error_response(exc: SwarmrouteError) -> Response:
    return JSONResponse(exc.to_body(), status_code=exc.status, headers=exc.http_headers() or None)


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
    return error_response(error_for_status(exc.status_code, str(exc.detail)))


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(SwarmrouteError(f"internal error: {type(exc).__name__}"))


EXCEPTION_HANDLERS: Mapping[Any, Any] = {
    SwarmrouteError: _swarmroute,
    ValidationError: _validation,
    HTTPException: _http,
    Exception: _unexpected,
}
"""Starlette's ``exception_handlers`` for every app of ours."""


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


async def read_model(request: Request, model: type[M], limit: int) -> M:
    """A JSON object body validated as ``model``; 400 naming the field for anything else."""
    body = await read_body(request.receive, dict(request.scope["headers"]), limit)
    try:
        raw = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise BadRequestError("request body must be a JSON object")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None
