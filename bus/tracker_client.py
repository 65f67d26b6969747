"""Asking the trackers, over NATS request/reply: the one client of the gateway (routes, served models), a
session's head (a replacement for a lost hop) and a joining node (its layer assignment).

Every request fails the same way: nobody answering, or no answer in time, is a ``NoRouteError`` (503: the
caller may ask again, and the gateway's client sees why), an error reply is the error the tracker raised
(``bus.nats_edge.reply_error``). A reply that does not decode raises ``codec.DecodeError``; a cancellation that
arrives with the reply is kept (``keep_cancellation``).
"""

from __future__ import annotations

from typing import TypeVar

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from bus import codec
from bus.connection import keep_cancellation
from bus.nats_edge import reply_error
from bus.subjects import Subjects
from schemas.assignment import AssignmentReply, AssignmentRequest
from schemas.base import WireModel
from schemas.errors import NoRouteError
from schemas.route import ModelsReply, RepairRequest, Route, RouteReply, RouteRequest

__all__ = ["TrackerClient"]

R = TypeVar("R", bound=WireModel)


class TrackerClient:
    def __init__(self, nc: NATS, subjects: Subjects, *, timeout_s: float = 3.0) -> None:
        self._nc = nc
        self._subjects = subjects
        self._timeout = timeout_s

    async def _request(self, what: str, subject: str, payload: bytes, reply: type[R]) -> R:
        try:
            msg = await self._nc.request(subject, payload, timeout=self._timeout)
        except NoRespondersError:
            raise NoRouteError(f"no tracker is running (nobody answers on the {what} subject)") from None
        except (NatsTimeoutError, TimeoutError):
            raise NoRouteError(f"no tracker answered within {self._timeout:g}s") from None
        keep_cancellation()  # a requester gone meanwhile (a client while routing) must not go on with the answer
        return codec.decode(msg.data, reply)

    async def route(self, model: str, session_id: str, exclude: list[str] | None = None, *,
                    standby: bool = False, prefix_keys: list[str] | None = None) -> Route:
        request = RouteRequest(model=model, session_id=session_id, exclude=exclude or [], standby=standby,
                               prefix_keys=prefix_keys or [])
        reply = await self._request("route", self._subjects.route_request, codec.encode(request), RouteReply)
        if reply.route is not None:
            return reply.route
        raise reply_error(reply, "the tracker found no route")

    async def models(self) -> ModelsReply:
        return await self._request("models", self._subjects.models_request, b"", ModelsReply)

    async def repair(self, request: RepairRequest) -> Route:
        """The route with hop ``request.lost`` replaced (issue #18)."""
        reply = await self._request("repair", self._subjects.repair_request, codec.encode(request), RouteReply)
        if reply.route is not None:
            return reply.route
        raise reply_error(reply, "the tracker found no replacement")

    async def assign(self, request: AssignmentRequest) -> AssignmentReply:
        """A joining node's layer range, held as a lease (the reply names it)."""
        reply = await self._request("assign", self._subjects.assign_request, codec.encode(request), AssignmentReply)
        if reply.layers is not None:
            return reply
        raise reply_error(reply, "the tracker assigned no layers")
