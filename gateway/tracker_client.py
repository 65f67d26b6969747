"""Asking the trackers for routes and for the list of served models, over NATS request/reply."""

from __future__ import annotations

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from bus import codec
from bus.connection import keep_cancellation
from bus.subjects import Subjects
from schemas.errors import NoRouteError, error_for_status
from schemas.route import ModelsReply, Route, RouteReply, RouteRequest


class TrackerClient:
    def __init__(self, nc: NATS, subjects: Subjects, *, timeout_s: float = 3.0) -> None:
        self._nc = nc
        self._subjects = subjects
        self._timeout = timeout_s

    async def _request(self, subject: str, payload: bytes) -> bytes:
        try:
            msg = await self._nc.request(subject, payload, timeout=self._timeout)
        except NoRespondersError:
            raise NoRouteError("no tracker is running (nobody answers on the route subject)") from None
        except NatsTimeoutError:
            raise NoRouteError(f"no tracker answered within {self._timeout:g}s") from None
        keep_cancellation()  # a client gone while routing: its request must not go on to open a session
        return bytes(msg.data)

    async def route(self, model: str, session_id: str, exclude: list[str] | None = None, *,
                    standby: bool = False, prefix_keys: list[str] | None = None) -> Route:
        request = RouteRequest(model=model, session_id=session_id, exclude=exclude or [], standby=standby,
                               prefix_keys=prefix_keys or [])
        reply = codec.decode(await self._request(self._subjects.route_request, codec.encode(request)), RouteReply)
        if reply.route is not None:
            return reply.route
        raise error_for_status(reply.status, reply.error or "the tracker found no route", code=reply.code)

    async def models(self) -> ModelsReply:
        return codec.decode(await self._request(self._subjects.models_request, b""), ModelsReply)
