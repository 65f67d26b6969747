"""Link RTTs: a node times the data-plane round trip to the nodes it routes to and from, for its advertisement.

Its peers are its neighbours on the routes of its open sessions: the hop before it and the hop after it, the tail's
"after" being the head (tokens go back there). A peer stays measured for ``FORGET_S`` after its last session, so an
operator's matrix (the gateway's dashboard) does not empty between requests. Each measurement is the least of a few
``GET /health`` on a kept-alive connection: one try may wait behind a forward pass on either side, the least is the
link plus the two HTTP stacks, which is what a hop's frame pays on top of compute.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable, Iterable

import httpx

from bus.tls import PinnedTransport, PinTable
from schemas.route import Route

PROBE_INTERVAL_S = 5.0
"""Each peer is measured again this often."""
FORGET_S = 600.0
"""A peer no open session has used for this long is no longer measured (nor advertised)."""
TRIES = 3
TIMEOUT_S = 5.0


def route_neighbours(route: Route, hop_index: int, node_id: str) -> dict[str, str]:
    """The nodes next to hop ``hop_index`` on ``route``'s ring (node id -> endpoint), never this node itself."""
    hops = route.hops
    if len(hops) < 2:
        return {}
    near = (hops[(hop_index - 1) % len(hops)], hops[(hop_index + 1) % len(hops)])
    return {h.node_id: h.endpoint for h in near if h.node_id != node_id and h.endpoint}


class LinkProbe:
    """Measures the peers ``peers()`` names (node id -> endpoint) every ``interval_s``; ``rtt_ms`` holds the
    latest figures. ``run()`` is the loop (a task of the node), ``aclose()`` frees the connections. With ``tls``
    (a client context) it reaches pinned ``https://`` peers as the node's frames do."""

    def __init__(self, peers: Callable[[], Iterable[tuple[str, str]]], *, interval_s: float = PROBE_INTERVAL_S,
                 forget_s: float = FORGET_S, clock: Callable[[], float] = time.monotonic,
                 tls: ssl.SSLContext | None = None) -> None:
        self._peers = peers
        self._interval = interval_s
        self._forget = forget_s
        self._clock = clock
        self._known: dict[str, tuple[str, float]] = {}
        """node id -> (endpoint, when a session last named it)"""
        self._measured: dict[str, float] = {}
        self.rtt_ms: dict[str, float] = {}
        # Idle connections are dropped before the peer's server drops them (uvicorn: 5 s), so a try rarely meets a
        # connection closed under it; the first try of a round may pay a connect, the least of the round does not.
        limits = httpx.Limits(max_keepalive_connections=32, keepalive_expiry=3.0)
        self._pins = PinTable()
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(TIMEOUT_S), limits=limits,
                                         transport=None if tls is None else PinnedTransport(tls, self._pins,
                                                                                            limits=limits))

    def _refresh(self) -> list[tuple[str, str]]:
        """Peers to measure now: new ones at once, the others once their figure is ``interval_s`` old."""
        now = self._clock()
        for node_id, endpoint in self._peers():
            self._known[node_id] = (endpoint, now)
        for node_id in [n for n, (_, seen) in self._known.items() if now - seen > self._forget]:
            del self._known[node_id]
            self._measured.pop(node_id, None)
            self.rtt_ms.pop(node_id, None)
        return [(n, e) for n, (e, _) in self._known.items() if now - self._measured.get(n, -1e18) >= self._interval]

    async def measure(self, endpoint: str) -> float | None:
        """The least of ``TRIES`` round trips to ``endpoint`` in ms; None if it refused (gone) or failed, and
        ``TimeoutError`` if no try got an answer (busy, or the machine is loaded: nothing learnt)."""
        best: float | None = None
        for _ in range(TRIES):
            started = time.perf_counter()
            try:
                response = await self._client.get(self._pins.url(f"{endpoint.rstrip('/')}/health"))
            except httpx.ConnectError:
                return None  # refused: the peer is gone
            except httpx.HTTPError:
                continue  # a timeout, or a kept-alive connection the peer closed meanwhile: try again
            if response.status_code >= 500:
                return None
            ms = (time.perf_counter() - started) * 1e3
            best = ms if best is None else min(best, ms)
        if best is None:
            raise TimeoutError(f"{endpoint} did not answer {TRIES} tries within {TIMEOUT_S:g}s each")
        return round(best, 3)

    async def probe_due(self) -> None:
        """Measure every peer that is due. A peer that refuses loses its figure until it answers again; one that
        only timed out keeps its last figure."""
        for node_id, endpoint in self._refresh():
            self._measured[node_id] = self._clock()
            try:
                rtt = await self.measure(endpoint)
            except TimeoutError:
                continue
            if rtt is None:
                self.rtt_ms.pop(node_id, None)
            else:
                self.rtt_ms[node_id] = rtt

    async def run(self, tick_s: float = 1.0) -> None:
        while True:
            with contextlib.suppress(Exception):  # a probe must never take the node down
                await self.probe_due()
            await asyncio.sleep(tick_s)

    async def aclose(self) -> None:
        await self._client.aclose()
