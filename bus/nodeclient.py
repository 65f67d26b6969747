"""HTTP client for the node API: the data plane's transport (frames, tokens) and session control.

Used by a node to reach its successor and its head, and by the gateway to open and close sessions. Every failure to
reach a node becomes a ``HopError`` naming the node and saying whether it was unreachable, timed out, or answered
with an error, which is what the structured session failure reports.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Literal

import httpx

from bus.capability import HEADER_CAPABILITY, HEADER_SESSION_TOKEN
from bus.frame_batch import FrameBatcher, batchable
from bus.hoplink import HttpLink, LinkError
from bus.tls import PinnedTransport, PinTable, split_pin
from schemas.errors import HopError, error_from_body
from schemas.node import LayerRange
from schemas.prefix_offer import PrefixOffer, PrefixOfferRequest
from schemas.route import HopPosition, ReplayRequest, RouteUpdate
from schemas.session import FailureReason, Prompt, SessionOpen, SessionOpened, TokenizeReply
from schemas.snapshot import SnapshotList

FRAME_CONTENT_TYPE = "application/x-swarmroute-frame"
TOKEN_CONTENT_TYPE = "application/x-swarmroute-token"
WINDOW_CONTENT_TYPE = "application/x-swarmroute-window"
"""A verify window's verdict (``bus.frame.encode_window``, issue #20)."""
SNAPSHOT_CONTENT_TYPE = "application/x-swarmroute-snapshot"
"""A snapshot segment (``bus.snapshot``)."""
"""A token frame (``bus.frame.encode_token``); the tokens endpoint also takes a JSON ``TokenEvent``."""
SessionState = Literal["open", "ended", "gone", "unreachable", "unknown"]


class NodeClient:
    """One pooled, keep-alive HTTP client for every node this process talks to. ``aclose()`` is idempotent.

    With ``tls`` (``bus.tls.client_context``) it presents this process's identity to ``https://<pin>@...`` endpoints
    and checks each node's key against the endpoint's pin before a request goes out. With ``batch_frames`` the
    decode and token frames of one loop turn for one peer go out as one batch (``bus.frame_batch``)."""

    def __init__(self, *, timeout_s: float = 10.0, headers: dict[str, str] | None = None,
                 tls: ssl.SSLContext | None = None, batch_frames: bool = False) -> None:
        self._timeout = timeout_s
        self._tls = tls
        self._pins = PinTable()
        nodelay = [(6, 1, 1)]  # IPPROTO_TCP, TCP_NODELAY
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0)),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64, keepalive_expiry=60.0),
            headers=headers or {},
            transport=(httpx.AsyncHTTPTransport(socket_options=nodelay) if tls is None
                       else PinnedTransport(tls, self._pins, socket_options=nodelay)),
        )
        self._links: dict[str, HttpLink] = {}
        self.batcher = FrameBatcher(self._link, _refused) if batch_frames else None
        """Issue #26: decode and token frames to one peer in one loop turn go as one request (``bus.frame_batch``)."""
        self._lone_requests = 0
        """Per-token-path requests written alone (not in a batch): each carries one frame."""

    @property
    def data_plane(self) -> tuple[int, int]:
        """(requests written, frames they carried) on the per-token path (frames, tokens, verdicts; a batch is one
        request): issue #26's calls per token, what frame batches save."""
        batched = (self.batcher.requests, self.batcher.frames) if self.batcher is not None else (0, 0)
        return self._lone_requests + batched[0], self._lone_requests + batched[1]

    def _link(self, endpoint: str) -> HttpLink:
        link = self._links.get(endpoint)
        if link is None:
            bare, pin = split_pin(endpoint)
            link = self._links[endpoint] = HttpLink(bare, tls=self._tls if bare.startswith("https:") else None,
                                                    pin=pin)
        return link

    async def aclose(self) -> None:
        if self.batcher is not None:
            await self.batcher.aclose()
        links, self._links = self._links, {}
        for link in links.values():
            await link.aclose()
        await self._client.aclose()

    def _hot_start(self, node: str, endpoint: str, path: str, body: bytes, content_type: str,
                   timeout: float | None, session_token: str | None) -> Coroutine[Any, Any, None]:
        """The per-token path: raw keep-alive link (the request is written now if a connection is idle), same error
        semantics as the httpx path once awaited."""
        if self._tls is None and endpoint.startswith("https:"):
            return _failing(HopError(node, "unreachable", f"node {node} at {split_pin(endpoint)[0]} speaks TLS, and "
                                                          "this process runs with tls = off"))
        wait = timeout if timeout is not None else self._timeout
        if self.batcher is not None and batchable(body):
            return self.batcher.send(node, endpoint, path, body, content_type, wait, session_token)
        link = self._link(endpoint)
        self._lone_requests += 1
        return self._hot_answer(node, endpoint, path, wait,
                                link.post_now(path, body, content_type, wait, _auth(session_token)))

    @staticmethod
    async def _hot_answer(node: str, endpoint: str, path: str, wait: float,
                          answer: Callable[[], Coroutine[Any, Any, tuple[int, bytes]]]) -> None:
        try:
            status, payload = await answer()
        except LinkError as exc:
            if exc.timeout:
                raise HopError(node, "timeout", f"node {node} did not answer POST {path} within {wait:g}s") from None
            raise HopError(node, "unreachable", f"node {node} unreachable at {endpoint}: {exc}") from None
        if status >= 400:
            raise _refused(node, f"POST {path}", status, payload)

    async def _request(self, node: str, method: str, url: str, *, timeout: float | None = None,
                       content: bytes | None = None, json: object | None = None,
                       content_type: str | None = None, extra: dict[str, str] | None = None) -> httpx.Response:
        headers = {"content-type": content_type} if content_type else {}
        headers.update(extra or {})
        try:
            response = await self._client.request(method, self._pins.url(url), content=content, json=json,
                                                  headers=headers,
                                                  timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT)
        except httpx.TimeoutException as exc:
            raise HopError(node, "timeout", f"node {node} did not answer {method} {_path(url)} within "
                                            f"{timeout or self._timeout:g}s") from exc
        except httpx.TransportError as exc:
            raise HopError(node, "unreachable", f"node {node} unreachable at {url}: {type(exc).__name__}") from exc
        if response.status_code >= 400:
            raise _refused(node, f"{method} {_path(url)}", response.status_code, response.content)
        return response

    async def tokenize(self, node: str, endpoint: str, prompt: Prompt, *, capability: str = "") -> list[int]:
        return (await self.tokenize_reply(node, endpoint, prompt, capability=capability)).tokens

    async def tokenize_reply(self, node: str, endpoint: str, prompt: Prompt, *,
                             capability: str = "") -> TokenizeReply:
        """The head's whole answer: the tokens and, for a prompt with tools, the tool-call format it rendered."""
        r = await self._request(node, "POST", f"{endpoint}/v1/tokenize", json=prompt.model_dump(mode="json"),
                                extra={HEADER_CAPABILITY: capability} if capability else None)
        return TokenizeReply.model_validate(r.json())

    async def open_session(self, node: str, endpoint: str, request: SessionOpen) -> SessionOpened:
        r = await self._request(node, "POST", f"{endpoint}/v1/sessions", json=request.model_dump(mode="json"))
        return SessionOpened.model_validate(r.json())

    async def close_session(self, node: str, endpoint: str, session_id: str, *, timeout: float = 2.0,
                            session_token: str | None = None, cancel: bool = False, keep: int = 0,
                            keys: Sequence[str] = ()) -> bool:
        """Free the session on a node; with ``cancel`` a head ends it as cancelled (it publishes the end). ``keep``:
        it completed, the node may keep its first ``keep`` positions for reuse (the confirmed ones: a speculative
        session's last window may have left more); ``keys``: prefix keys naming what that KV holds (issue #18),
        also for a session the node freed already. False if the node could not be reached."""
        params = [p for p, on in (("cancel=1", cancel), (f"keep={keep}", keep > 0)) if on]
        if keys:
            params.append("keys=" + ",".join(keys))
        query = "?" + "&".join(params) if params else ""
        try:
            await self._request(node, "DELETE", f"{endpoint}/v1/sessions/{session_id}{query}", timeout=timeout,
                                extra=_auth(session_token))
        except HopError as exc:
            return exc.peer_status == 404  # already gone there counts as freed
        return True

    def send_frame(self, node: str, endpoint: str, session_id: str, frame: bytes, *,
                   timeout: float | None = None, session_token: str | None = None) -> Coroutine[Any, Any, None]:
        """POST a frame. The request is written at once when a connection to the node is idle (so the caller may
        do other work before awaiting the answer); the answer comes after the node has computed it."""
        return self._hot_start(node, endpoint, f"/v1/sessions/{session_id}/frames", frame, FRAME_CONTENT_TYPE,
                               timeout, session_token)

    def send_token(self, node: str, endpoint: str, session_id: str, token_frame: bytes, *,
                   timeout: float | None = None, session_token: str | None = None) -> Coroutine[Any, Any, None]:
        """POST a sampled token (a token frame) to the session's head; written at once like ``send_frame``."""
        return self._hot_start(node, endpoint, f"/v1/sessions/{session_id}/tokens", token_frame, TOKEN_CONTENT_TYPE,
                               timeout, session_token)

    def send_window(self, node: str, endpoint: str, session_id: str, window_frame: bytes, *,
                    timeout: float | None = None, session_token: str | None = None) -> Coroutine[Any, Any, None]:
        """POST a verify window's verdict to the session's head; written at once like ``send_token``."""
        return self._hot_start(node, endpoint, f"/v1/sessions/{session_id}/tokens", window_frame,
                               WINDOW_CONTENT_TYPE, timeout, session_token)

    async def report_failure(self, node: str, endpoint: str, session_id: str, reason: FailureReason, *,
                             timeout: float = 2.0, session_token: str | None = None) -> None:
        await self._request(node, "POST", f"{endpoint}/v1/sessions/{session_id}/failure",
                            content=reason.model_dump_json().encode(), content_type="application/json",
                            timeout=timeout, extra=_auth(session_token))

    async def session_state(self, node: str, endpoint: str, session_id: str, *, timeout: float = 1.0,
                            session_token: str | None = None) -> SessionState:
        """Whether a node still holds a session: ``open``, ``ended`` (the head freed it because it ended: its end is
        published or on its way), ``gone`` (it answers but does not hold it: restarted, or freed it), ``unreachable``
        (nothing listens: the process died) or ``unknown`` (no answer in time: busy, or a network that drops
        packets; proves nothing)."""
        try:
            await self._request(node, "GET", f"{endpoint}/v1/sessions/{session_id}", timeout=timeout,
                                extra=_auth(session_token))
        except HopError as exc:
            if exc.kind == "unreachable":
                return "unreachable"
            if exc.peer_status == 404:
                return "ended" if exc.peer_error is not None and exc.peer_error.code == "session_ended" else "gone"
            return "unknown"
        return "open"

    # ---- issue #18: snapshots on a standby holder, route repair -------------------------------------------------

    async def put_snapshot(self, node: str, endpoint: str, body: bytes, *, capability: str = "",
                           session_token: str | None = None, timeout: float | None = None) -> None:
        """Hand one snapshot segment (``bus.snapshot.encode``) to its standby holder."""
        extra = {**(_auth(session_token) or {}), **({HEADER_CAPABILITY: capability} if capability else {})}
        await self._request(node, "POST", f"{endpoint}/v1/snapshots", content=body, content_type=SNAPSHOT_CONTENT_TYPE,
                            timeout=timeout, extra=extra)

    async def list_snapshots(self, node: str, endpoint: str, session_id: str, layers: LayerRange, *,
                             session_token: str | None = None, timeout: float | None = None) -> SnapshotList:
        r = await self._request(node, "GET", f"{endpoint}/v1/snapshots/{session_id}?layers={layers.start}:"
                                             f"{layers.end}", timeout=timeout, extra=_auth(session_token))
        return SnapshotList.model_validate(r.json())

    async def get_snapshot(self, node: str, endpoint: str, session_id: str, digest: str, *,
                           session_token: str | None = None, timeout: float | None = None) -> bytes:
        r = await self._request(node, "GET", f"{endpoint}/v1/snapshots/{session_id}/{digest}", timeout=timeout,
                                extra=_auth(session_token))
        return r.content

    async def prefix_offer(self, node: str, endpoint: str, request: PrefixOfferRequest, *, capability: str = "",
                           timeout: float | None = None) -> PrefixOffer:
        """What ``node`` holds of a prompt's prefix (issue #26): ``actors.node.prefix_offers``."""
        r = await self._request(node, "POST", f"{endpoint}/v1/prefixes", json=request.model_dump(mode="json"),
                                timeout=timeout, extra={HEADER_CAPABILITY: capability} if capability else None)
        return PrefixOffer.model_validate(r.json())

    async def post_receipt(self, node: str, endpoint: str, body: bytes, *, referee: bool = False,
                           timeout: float | None = None) -> httpx.Response:
        """A spot check's receipt for ``node`` to recompute (issue #28, ``actors.node.spot_check``): accepted with
        202; ``referee``: to settle a dispute, answered with the referee's verdict."""
        path = "/v1/spot-checks/referee" if referee else "/v1/spot-checks"
        return await self._request(node, "POST", f"{endpoint}{path}", content=body, timeout=timeout,
                                   content_type="application/x-swarmroute-receipt")

    async def get_prefix_piece(self, node: str, endpoint: str, offer: str, index: int, *,
                               timeout: float | None = None) -> bytes:
        r = await self._request(node, "GET", f"{endpoint}/v1/prefixes/{offer}/{index}", timeout=timeout)
        return r.content

    async def drop_snapshots(self, node: str, endpoint: str, session_id: str, *, session_token: str | None = None,
                             timeout: float = 2.0) -> None:
        await self._request(node, "DELETE", f"{endpoint}/v1/snapshots/{session_id}", timeout=timeout,
                            extra=_auth(session_token))

    async def update_route(self, node: str, endpoint: str, update: RouteUpdate, *, session_token: str | None = None,
                           timeout: float | None = None) -> HopPosition:
        r = await self._request(node, "POST", f"{endpoint}/v1/sessions/{update.session_id}/route",
                                content=update.model_dump_json().encode(), content_type="application/json",
                                timeout=timeout, extra=_auth(session_token))
        return HopPosition.model_validate(r.json())

    async def replay(self, node: str, endpoint: str, session_id: str, request: ReplayRequest, *,
                     session_token: str | None = None, timeout: float | None = None) -> None:
        await self._request(node, "POST", f"{endpoint}/v1/sessions/{session_id}/replay",
                            content=request.model_dump_json().encode(), content_type="application/json",
                            timeout=timeout, extra=_auth(session_token))

    async def session_position(self, node: str, endpoint: str, session_id: str, *, timeout: float = 2.0,
                               session_token: str | None = None) -> int:
        """Where a node's KV of a session ends (``GET /v1/sessions/{id}``)."""
        r = await self._request(node, "GET", f"{endpoint}/v1/sessions/{session_id}", timeout=timeout,
                                extra=_auth(session_token))
        return int(r.json()["position"])

    async def probe(self, node: str, endpoint: str, *, timeout: float = 1.0) -> bool:
        """True if the node answers its health check in time."""
        try:
            await self._request(node, "GET", f"{endpoint}/health", timeout=timeout)
        except HopError:
            return False
        return True


def _refused(node: str, request: str, status: int, body: bytes) -> HopError:
    """A node's error answer (either transport): its error rebuilt from the body, kept on the ``HopError``."""
    try:
        parsed = json.loads(body) if body else None
    except ValueError:
        parsed = None
    peer = error_from_body(status, parsed)
    return HopError(node, "http_error", f"node {node} answered {status} to {request}: {peer.message}",
                    peer_status=status, peer_error=peer)


async def _failing(error: HopError) -> None:
    raise error


def _auth(session_token: str | None) -> dict[str, str] | None:
    return {HEADER_SESSION_TOKEN: session_token} if session_token else None


def _path(url: str) -> str:
    return "/" + url.split("/", 3)[-1] if url.count("/") >= 3 else url
