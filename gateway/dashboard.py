"""The operators' dashboard, served by the gateway: one page, live over SSE from the swarm's telemetry.

    GET  /dashboard                    the page (gateway/static/dashboard.html, .js, .css: no build step, no CDN)
    GET  /dashboard/events             SSE: the whole ``DashboardState`` as JSON whenever it changes
    GET  /dashboard/state              the same, once (scripts, curl)
    GET  /dashboard/static/{file}      the page's assets
    GET  /dashboard/login              with API keys set: a form asking for one
    POST /dashboard/login              checks the key; sets an HttpOnly cookie holding an HMAC of it, never the key

With ``api_keys`` set, every path but the login form and the static assets takes the cookie or the usual
``Authorization: Bearer`` (a browser cannot give EventSource a header, hence the cookie). The gateway's key
middleware leaves ``/dashboard`` to this module, so a browser without a key gets the form instead of a JSON 401.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import re
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import BaseRoute
from starlette.routing import Route as HttpRoute

from bus.http_edge import error_response
from gateway.dashboard_feed import SwarmFeed
from schemas.errors import AuthenticationError, NotFoundError

PREFIX = "/dashboard"
COOKIE = "swarmroute_dashboard"
PUSH_INTERVAL_S = 0.5
"""The stream looks for changes this often (telemetry comes at most every 0.1 s per session, heartbeats every 2 s)."""
REFRESH_S = 2.0
_AGE = re.compile(r'"heartbeat_age_s":[-0-9.e]+')
_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
_LOGIN_SIZE = 4096

Handler = Callable[[Request], Awaitable[Response]]


def _asset(name: str) -> bytes:
    return resources.files("gateway").joinpath("static", name).read_bytes()


def cookie_value(key: bytes) -> str:
    """What the cookie holds for an API key: an HMAC of it, so the cookie is not the key itself."""
    return hmac.new(key, b"swarmroute-dashboard", hashlib.sha256).hexdigest()


class DashboardAuth:
    """The gateway's API keys, taken from the cookie or the Bearer header; no keys means open."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys
        self._cookies = [cookie_value(k).encode() for k in keys]

    def allows(self, request: Request) -> bool:
        if not self.keys:
            return True
        given = request.headers.get("authorization", "")
        token = given[7:].encode() if given.lower().startswith("bearer ") else b""
        cookie = request.cookies.get(COOKIE, "").encode()
        return (any(hmac.compare_digest(token, k) for k in self.keys)
                or any(hmac.compare_digest(cookie, c) for c in self._cookies))

    def key_matching(self, given: str) -> bytes | None:
        return next((k for k in self.keys if hmac.compare_digest(given.encode(), k)), None)


def dashboard_routes(feed: SwarmFeed, keys: list[bytes]) -> list[BaseRoute]:
    auth = DashboardAuth(keys)

    def guarded(handler: Handler, *, page: bool = False) -> Handler:
        async def run(request: Request) -> Response:
            if not auth.allows(request):
                if page:
                    return RedirectResponse(f"{PREFIX}/login", status_code=303)
                return error_response(AuthenticationError("missing or invalid API key (Authorization: Bearer, or "
                                                          f"sign in at {PREFIX}/login)"))
            await feed.start()
            return await handler(request)
        return run

    async def page(request: Request) -> Response:
        return Response(_asset("dashboard.html"), media_type="text/html; charset=utf-8",
                        headers={"cache-control": "no-cache"})

    async def state(request: Request) -> Response:
        return Response(json.dumps(feed.as_json()), media_type="application/json")

    async def events(request: Request) -> Response:
        return StreamingResponse(_frames(feed), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in _ASSETS:
            raise NotFoundError(f"no dashboard asset {name!r}", code="not_found")
        return Response(_asset(name), media_type=_ASSETS[name], headers={"cache-control": "no-cache"})

    async def login_form(request: Request) -> Response:
        return _login_page("", 200)

    async def login(request: Request) -> Response:
        body = (await request.body())[:_LOGIN_SIZE].decode(errors="replace")
        given = urllib.parse.parse_qs(body).get("key", [""])[0].strip()
        key = auth.key_matching(given) if auth.keys else None
        if auth.keys and key is None:
            return _login_page("That is not one of this gateway's API keys.", 401)
        response = RedirectResponse(PREFIX, status_code=303)
        if key is not None:
            response.set_cookie(COOKIE, cookie_value(key), path=PREFIX, httponly=True, samesite="strict",
                                secure=request.url.scheme == "https")
        return response

    return [
        HttpRoute(PREFIX, guarded(page, page=True), methods=["GET"]),
        HttpRoute(f"{PREFIX}/", guarded(page, page=True), methods=["GET"]),
        HttpRoute(f"{PREFIX}/events", guarded(events), methods=["GET"]),
        HttpRoute(f"{PREFIX}/state", guarded(state), methods=["GET"]),
        HttpRoute(f"{PREFIX}/static/{{name}}", static, methods=["GET"]),
        HttpRoute(f"{PREFIX}/login", login_form, methods=["GET"]),
        HttpRoute(f"{PREFIX}/login", login, methods=["POST"]),
    ]


def _login_page(message: str, status: int) -> Response:
    html = _asset("login.html").decode().replace("{{message}}", message.replace("<", "&lt;"))
    return Response(html, status_code=status, media_type="text/html; charset=utf-8")


async def _frames(feed: SwarmFeed) -> AsyncIterator[bytes]:
    """The state whenever it changed, and at least every ``REFRESH_S`` (heartbeat ages move on); a keep-alive
    comment is never needed in between."""
    last, quiet = "", 0.0
    while True:
        frame = json.dumps(feed.as_json(), separators=(",", ":"))
        if frame != last and (_without_ages(frame) != _without_ages(last) or quiet >= REFRESH_S):
            last, quiet = frame, 0.0
            yield b"data: " + frame.encode() + b"\n\n"
        await asyncio.sleep(PUSH_INTERVAL_S)
        quiet += PUSH_INTERVAL_S


def _without_ages(frame: str) -> str:
    return _AGE.sub("", frame)
