"""The one mapper from exceptions to OpenAI-shaped error responses."""

from __future__ import annotations

import logging

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from schemas.errors import BadRequestError, CapacityError, NotFoundError, SwarmrouteError

log = logging.getLogger(__name__)


def validation_message(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors()[:5]:
        loc = ".".join(str(p) for p in e["loc"]) or "body"
        parts.append(f"{loc}: {e['msg']}")
    return "; ".join(parts)


def validation_param(exc: ValidationError) -> str | None:
    """The request field the first error is about (its top-level name, as OpenAI's ``param``), if any."""
    for e in exc.errors():
        if e["loc"]:
            return str(e["loc"][0])
    return None


def validation_error(exc: ValidationError) -> BadRequestError:
    """A request body that does not validate: a 400 naming the field."""
    return BadRequestError(validation_message(exc), param=validation_param(exc))


def error_response(exc: SwarmrouteError) -> Response:
    headers = {"retry-after": str(max(1, round(exc.retry_after)))} if isinstance(exc, CapacityError) else None
    return JSONResponse(exc.to_body(), status_code=exc.status, headers=headers)


async def handle_swarmroute(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SwarmrouteError)
    return error_response(exc)


async def handle_validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ValidationError)
    return error_response(validation_error(exc))


async def handle_http(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error_response(NotFoundError(f"no such endpoint: {request.method} {request.url.path}"))
    error = BadRequestError(str(exc.detail))
    error.status = exc.status_code
    return error_response(error)


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(SwarmrouteError(f"internal error: {type(exc).__name__}"))


EXCEPTION_HANDLERS = {
    SwarmrouteError: handle_swarmroute,
    ValidationError: handle_validation,
    HTTPException: handle_http,
    Exception: handle_unexpected,
}
