"""The NATS edge, ``bus.http_edge``'s twin: errors to reply messages and back, for our request/reply subjects
that answer with a wire model carrying ``error`` and ``status`` (the tracker's ``RouteReply``, ``AssignmentReply``).

A responder answers a ``SwarmrouteError`` with ``error_reply`` (its message, status and code), or serves a whole
subject with ``endpoint`` (a request that does not decode is a 400 reply, a raised error its reply); a requester
turns an error reply back into the error the responder raised with ``reply_error``, the tree's one mapping
(``schemas.errors.error_for_status``), so the gateway raises the class the tracker's route selection raised.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from bus import codec
from bus.service import Handler
from schemas.base import WireModel
from schemas.errors import BadRequestError, SwarmrouteError, error_for_status

__all__ = ["ErrorReply", "endpoint", "error_reply", "reply_error"]

Q = TypeVar("Q", bound=WireModel)
R = TypeVar("R", bound=WireModel)

_UNCODED = (BadRequestError.status, BadRequestError.code)
"""A bare 400 travels without a code: the tracker's refusals of a request itself (undecodable, no such hop, no
session token) never carried one, and ``error_for_status(400)`` rebuilds the same ``BadRequestError`` without it."""


class ErrorReply(Protocol):
    """What a reply that may carry an error has: ``error``, the message (None when the reply carries its result),
    and ``status``, 200 or the error's HTTP status."""

    error: str | None
    status: int


def error_reply(reply: type[R], exc: SwarmrouteError, **fields: object) -> R:
    """``exc`` as a ``reply`` message: its message, its status and, when the reply names codes (``RouteReply``
    does, ``AssignmentReply`` does not), its code. ``fields`` are the reply's own (a route's ``uncovered``)."""
    wire: dict[str, object] = {"error": exc.message, "status": exc.status, **fields}
    if "code" in reply.model_fields and (exc.status, exc.code) != _UNCODED:
        wire["code"] = exc.code
    return reply.model_validate(wire)


def reply_error(reply: ErrorReply, default: str) -> SwarmrouteError:
    """The error a reply without its result carries, rebuilt from its status and code; ``default`` is the message
    of a reply that gives none."""
    code = getattr(reply, "code", None)
    return error_for_status(reply.status, reply.error or default, code=code if isinstance(code, str) else None)


def endpoint(request: type[Q], reply: type[R], handle: Callable[[Q], Awaitable[R]]) -> Handler:
    """A micro-service handler (``bus.service.Endpoint``) answering with ``reply`` messages: the request decoded as
    ``request`` (a 400 reply saying which field is wrong when it does not), then ``handle``'s reply, or the
    ``SwarmrouteError`` it raised as one."""

    async def serve(data: bytes) -> bytes:
        try:
            decoded = codec.decode(data, request)
        except codec.DecodeError as exc:
            return codec.encode(error_reply(reply, BadRequestError(str(exc))))
        try:
            answer = await handle(decoded)
        except SwarmrouteError as exc:
            answer = error_reply(reply, exc)
        return codec.encode(answer)

    return serve
