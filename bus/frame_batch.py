"""One data-plane request per pass per hop (issue #26): the decode frames and token frames a node sends to one peer
in one turn of its event loop go out as one batch request (``POST /v1/batch``, ``bus.frame.encode_batch``).

A forward pass of several sessions ends in one loop callback that wakes every session's waiter; each then sends its
frame on in the next turn. Without batching, each is a request of its own (its HTTP head, a write, the peer's parse
and answer, all in Python); batched, the peer gets them in one read and queues every session's step before its
worker takes the next pass. Each entry keeps its own answer: the batch answers per entry, and one session's refusal
fails only that session's request. A lone frame goes out as it always did (``/v1/sessions/{id}/frames`` or
``/tokens``), byte for byte. A peer that predates batches answers a batch with a whole-request 404 (it has no
``/v1/batch``; a node that has it never answers a whole batch with a 404, its entries' refusals are inside its
200): the batcher then sends that batch's entries one by one, and every later frame for that peer too (``lone``),
so a route may mix versions.

Only requests whose order is causal are batched (decode frames and token frames: each exists because its
predecessor was computed downstream, ``actors.node.outbox``); prefill chunks, verify windows and control requests are
sent as before. The cost: a frame waits for the end of the loop turn it was made in (one ``call_soon``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from bus import frame as frames
from bus.capability import HEADER_SESSION_TOKEN
from bus.hoplink import HttpLink, LinkError
from schemas.errors import HopError
from schemas.frame import MAGIC, MAX_BATCH, TOKEN_MAGIC, FrameKind

log = logging.getLogger(__name__)

BATCH_PATH = "/v1/batch"
BATCH_CONTENT_TYPE = "application/x-swarmroute-batch"

Refused = Callable[[str, str, int, bytes], HopError]
"""(node, request, status, body) -> the HopError of an error answer (``bus.nodeclient``'s mapping)."""


def batchable(body: bytes) -> bool:
    """A decode frame or a token frame: what may ride a batch."""
    return body[:4] == TOKEN_MAGIC or (body[:4] == MAGIC and len(body) > 4 and body[4] == FrameKind.DECODE)


@dataclasses.dataclass(slots=True)
class _Entry:
    path: str
    body: bytes
    content_type: str
    token: str
    future: asyncio.Future[None]


@dataclasses.dataclass(slots=True)
class _Peer:
    node: str
    wait: float
    entries: list[_Entry] = dataclasses.field(default_factory=list)


class FrameBatcher:
    """Not thread-safe: used from the node's event loop."""

    def __init__(self, link_of: Callable[[str], HttpLink], refused: Refused) -> None:
        self._link_of = link_of
        self._refused = refused
        self._peers: dict[str, _Peer] = {}
        """Endpoint -> what waits for the end of this loop turn."""
        self._sending: set[asyncio.Task[None]] = set()
        self.lone: set[str] = set()
        """Endpoints that answered a batch with a 404: peers that predate batches, sent one frame per request."""
        self.requests = 0
        """Requests written (a batch counts once): what the benchmarks compare."""
        self.frames = 0

    def send(self, node: str, endpoint: str, path: str, body: bytes, content_type: str, wait: float,
             session_token: str | None) -> Coroutine[Any, Any, None]:
        """Queue one frame for ``endpoint``'s batch of this loop turn; the coroutine (await it or not) ends with
        its entry's answer, raising a ``HopError`` as a request of its own would."""
        loop = asyncio.get_running_loop()
        peer = self._peers.get(endpoint)
        if peer is None:
            peer = self._peers[endpoint] = _Peer(node, wait)
            loop.call_soon(self._flush, endpoint)
        future: asyncio.Future[None] = loop.create_future()
        # Read here so that a failure nobody awaits (the session closed meanwhile) is not logged as unretrieved.
        future.add_done_callback(_retrieve)
        peer.entries.append(_Entry(path, body, content_type, session_token or "", future))
        peer.wait = max(peer.wait, wait)
        return _answer(future)

    def _flush(self, endpoint: str) -> None:
        peer = self._peers.pop(endpoint)
        size = 1 if endpoint in self.lone else MAX_BATCH
        for at in range(0, len(peer.entries), size):
            self._post(peer.node, endpoint, peer.wait, peer.entries[at:at + size])

    def _post(self, node: str, endpoint: str, wait: float, entries: list[_Entry]) -> None:
        """Write ``entries`` as one request (a lone entry to its own path), settled by a task of its own."""
        link = self._link_of(endpoint)
        if len(entries) == 1:
            e = entries[0]
            headers = {HEADER_SESSION_TOKEN: e.token} if e.token else None
            answer = link.post_now(e.path, e.body, e.content_type, wait, headers)
        else:
            body = frames.encode_batch([(e.body, e.token) for e in entries])
            answer = link.post_now(BATCH_PATH, body, BATCH_CONTENT_TYPE, wait)
        self.requests += 1
        self.frames += len(entries)
        task = asyncio.ensure_future(self._settle(node, endpoint, wait, answer, entries))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _settle(self, node: str, endpoint: str, wait: float,
                      answer: Callable[[], Coroutine[Any, Any, tuple[int, bytes]]], entries: list[_Entry]) -> None:
        try:
            status, payload = await answer()
        except LinkError as exc:
            for e in entries:
                _fail(e, HopError(node, "timeout", f"node {node} did not answer POST {e.path} within {wait:g}s")
                      if exc.timeout else HopError(node, "unreachable", f"node {node} unreachable at {endpoint}: "
                                                                         f"{exc}"))
            return
        if len(entries) > 1 and status == 404:  # a peer without /v1/batch: these and later frames go one by one
            if endpoint not in self.lone:
                log.info("node %s at %s takes no frame batches (404): its frames go one per request", node, endpoint)
                self.lone.add(endpoint)
            self.frames -= len(entries)  # counted again as they are written alone
            for e in entries:
                self._post(node, endpoint, wait, [e])
            return
        if len(entries) == 1 or status >= 400:  # a lone request, or a batch refused as a whole
            for e in entries:
                if status >= 400:
                    _fail(e, self._refused(node, f"POST {e.path}", status, payload))
                elif not e.future.done():
                    e.future.set_result(None)
            return
        for e, (entry_status, body) in zip(entries, _results(node, payload, len(entries)), strict=True):
            if entry_status >= 400:
                _fail(e, self._refused(node, f"POST {e.path}", entry_status, body))
            elif not e.future.done():
                e.future.set_result(None)

    async def aclose(self) -> None:
        sending, self._sending = list(self._sending), set()
        for task in sending:
            task.cancel()
        await asyncio.gather(*sending, return_exceptions=True)


def _results(node: str, payload: bytes, n: int) -> list[tuple[int, bytes]]:
    """Each entry's (status, error body) from a batch answer; a malformed answer fails every entry (status 502)."""
    try:
        results = json.loads(payload)["results"]
        if len(results) != n:
            raise ValueError(f"{len(results)} results for {n} entries")
        return [(int(r["status"]), json.dumps({"error": r["error"]}).encode() if "error" in r else b"")
                for r in results]
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("node %s answered a batch with %r: %s", node, payload[:200], exc)
        body = json.dumps({"error": {"message": f"node {node} answered a batch of {n} malformed: {exc}",
                                     "type": "server_error", "code": "protocol"}}).encode()
        return [(502, body)] * n


def _fail(entry: _Entry, exc: HopError) -> None:
    if not entry.future.done():
        entry.future.set_exception(exc)


def _retrieve(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


async def _answer(future: asyncio.Future[None]) -> None:
    await future
