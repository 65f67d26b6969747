"""The dashboard's live copy of the swarm, from NATS: advertisements, session telemetry, fetch progress, and the
events an operator wants to see as they happen (nodes joining, serving, lost; sessions repaired or failed).

It listens on core NATS only (the registry's puts on ``$KV.<bucket>.*``, ``telemetry.*``, ``artifacts.progress.*``),
after one best-effort read of the registry bucket, so a gateway needs no JetStream consumer for it. A node counts as
lost once its last heartbeat here is older than the registry TTL, as the trackers count it (KV expiry notifies no
one). Started on the first dashboard request, not with the gateway: a gateway nobody watches decodes no telemetry.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import BaseModel, Field

from bus import codec
from bus.subjects import Subjects
from gateway import dashboard_view as views
from schemas.artifact import FetchProgress
from schemas.node import NodeAdvertisement
from schemas.session import SessionPhase
from schemas.telemetry import GenerationTelemetry

log = logging.getLogger(__name__)
FINISHED_SHOWN_S = 30.0
"""A session that ended stays on the page this long."""
STALE_SESSION_S = 60.0
"""A session whose telemetry stopped without a terminal phase is dropped after this long."""
LOST_SHOWN_S = 300.0
"""A lost node stays on the page (state ``lost``) this long after its last heartbeat."""
MAX_EVENTS = 200
MAX_SESSIONS = 500
"""Sessions kept at most (the oldest go first): a flood of snapshots under made-up ids cannot grow the gateway."""
SNAPSHOT_TIMEOUT_S = 3.0


class Event(BaseModel):
    at: float = Field(description="wall-clock seconds")
    kind: str = Field(description="node | fetch | repair | failure | session")
    text: str


class DashboardState(BaseModel):
    """One frame of the page: what the SSE stream sends, whole, whenever it changes."""

    models: list[views.ModelView]
    nodes: list[views.NodeView]
    sessions: list[views.SessionView]
    links: views.RttMatrix
    events: list[Event]


@dataclasses.dataclass
class _Seen:
    advert: NodeAdvertisement
    at: float
    lost: bool = False


class SwarmFeed:
    """Subscriptions and the state they feed; ``state()`` is the page's frame. ``start()`` is idempotent."""

    def __init__(self, nc: NATS, subjects: Subjects, *, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._nc = nc
        self._subjects = subjects
        self._ttl = ttl_s
        self._clock = clock
        self._nodes: dict[str, _Seen] = {}
        self._sessions: dict[str, tuple[GenerationTelemetry, float]] = {}
        self._fetches: dict[str, FetchProgress] = {}
        self._compute: dict[str, float] = {}
        """node id -> the latest compute ms per layer a session through it reported"""
        self.events: collections.deque[Event] = collections.deque(maxlen=MAX_EVENTS)
        self._subs: list[Subscription] = []
        self._starting: asyncio.Lock = asyncio.Lock()
        self.started = False

    async def start(self) -> None:
        async with self._starting:
            if self.started:
                return
            s = self._subjects
            self._subs = [await self._nc.subscribe(s.registry_key_subject(), cb=self._on_advert),
                          await self._nc.subscribe(s.telemetry("*"), cb=self._on_telemetry),
                          await self._nc.subscribe(s.artifact_progress("*"), cb=self._on_progress)]
            await self._read_registry()
            self.started = True

    async def stop(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self.started = False

    async def _read_registry(self) -> None:
        """The advertisements already in the bucket; without it the page fills within one heartbeat anyway."""
        try:
            async with asyncio.timeout(SNAPSHOT_TIMEOUT_S):
                kv = await self._nc.jetstream().key_value(self._subjects.registry_bucket)
                for key in await kv.keys():
                    with contextlib.suppress(Exception):
                        entry = await kv.get(key)
                        if entry.value:
                            self._put(codec.decode(entry.value, NodeAdvertisement), quiet=True)
        except Exception as exc:  # noqa: BLE001 - no bucket yet, no permission, no keys: heartbeats fill it
            log.debug("dashboard: registry not read at start (%s)", type(exc).__name__)

    # ---- feeds ------------------------------------------------------------------------------------------------

    def _event(self, kind: str, text: str) -> None:
        self.events.appendleft(Event(at=time.time(), kind=kind, text=text))

    async def _on_advert(self, msg: Msg) -> None:
        key = msg.subject.rsplit(".", 1)[-1]
        if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or not msg.data:
            if self._nodes.pop(key, None) is not None:
                self._event("node", f"node {key} left the swarm (stopped or draining)")
            return
        with contextlib.suppress(codec.DecodeError):
            self._put(codec.decode(msg.data, NodeAdvertisement))

    def _put(self, advert: NodeAdvertisement, *, quiet: bool = False) -> None:
        known = self._nodes.get(advert.node_id)
        if known is not None and known.advert.sent_at > advert.sent_at:
            return
        self._nodes[advert.node_id] = _Seen(advert, self._clock())
        if quiet:
            return
        where = f"layers {advert.layers} of {advert.backend.model_name or advert.model_id}"
        if known is None:
            self._event("node", f"node {advert.node_id} joined: {advert.state} {where}")
        elif known.lost:
            self._event("node", f"node {advert.node_id} is back: {advert.state} {where}")
        elif known.advert.state != advert.state:
            self._event("node", f"node {advert.node_id} is {advert.state} {where}")

    async def _on_progress(self, msg: Msg) -> None:
        with contextlib.suppress(codec.DecodeError):
            p = codec.decode(msg.data, FetchProgress)
            before = self._fetches.get(p.node_id)
            self._fetches[p.node_id] = p
            if len(self._fetches) > MAX_SESSIONS:  # progress of nodes long gone, or made-up ids
                del self._fetches[min(self._fetches, key=lambda n: self._fetches[n].sent_at)]
            if p.phase in ("done", "failed") and (before is None or before.phase != p.phase):
                what = "fetched" if p.phase == "done" else "failed to fetch"
                tail = f": {p.message}" if p.message else ""
                self._event("fetch", f"node {p.node_id} {what} layers [{p.start}, {p.end}) "
                                     f"({p.bytes_downloaded / 1e6:.1f} MB){tail}")

    async def _on_telemetry(self, msg: Msg) -> None:
        with contextlib.suppress(codec.DecodeError):
            self._absorb(codec.decode(msg.data, GenerationTelemetry))

    def _absorb(self, snap: GenerationTelemetry) -> None:
        before = self._sessions.get(snap.session_id)
        if before is not None and before[0].seq > snap.seq and not snap.phase.terminal:
            return
        self._sessions[snap.session_id] = (snap, self._clock())
        if len(self._sessions) > MAX_SESSIONS:
            del self._sessions[min(self._sessions, key=lambda sid: self._sessions[sid][1])]
        self._compute.update(views.compute_per_layer(snap))
        old = before[0] if before is not None else None
        sid = snap.session_id[:8]
        if snap.repair is not None and (old is None or old.repair != snap.repair):
            r = snap.repair
            if snap.phase is SessionPhase.REPAIRING:
                self._event("repair", f"session {sid}: node {r.lost_node} lost, repairing layers {r.layers}")
            elif r.replacement:
                took = f" in {r.duration_ms:.0f} ms" if r.duration_ms is not None else ""
                self._event("repair", f"session {sid}: layers {r.layers} moved from {r.lost_node} to "
                                      f"{', '.join(r.replacement)} ({r.source or 'rebuilt'}){took}")
        if snap.phase is SessionPhase.FAILED and (old is None or old.phase is not SessionPhase.FAILED):
            why = snap.failure.describe() if snap.failure is not None else "no reason given"
            self._event("failure", f"session {sid} failed: {why}")

    # ---- the frame --------------------------------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        for node_id, seen in list(self._nodes.items()):
            age = now - seen.at
            if age > LOST_SHOWN_S:
                del self._nodes[node_id]
            elif age > self._ttl and not seen.lost:
                seen.lost = True
                self._event("failure", f"node {node_id} lost: no heartbeat for {age:.0f} s "
                                       f"(layers {seen.advert.layers})")
        for sid, (snap, at) in list(self._sessions.items()):
            if now - at > (FINISHED_SHOWN_S if snap.phase.terminal else STALE_SESSION_S):
                del self._sessions[sid]

    def state(self) -> DashboardState:
        now = self._clock()
        self._expire(now)
        live = [s.advert for s in self._nodes.values() if not s.lost]
        nodes = [views.node_view(s.advert, lost=s.lost, age_s=now - s.at, compute_ms_per_layer=self._compute.get(n),
                                 progress=self._fetches.get(n))
                 for n, s in sorted(self._nodes.items(), key=lambda kv: (kv[1].advert.model_id,
                                                                         kv[1].advert.layers.start, kv[0]))]
        rtt = views.rtt_pairs(live)
        snaps = sorted((snap for snap, _ in self._sessions.values()),
                       key=lambda s: (s.phase.terminal, -s.sent_at))
        models = views.model_views(live)
        names = {m.id: m.name for m in models}
        return DashboardState(models=models, nodes=nodes,
                              sessions=[views.session_view(s, rtt, names) for s in snaps],
                              links=views.rtt_matrix(live), events=list(self.events)[:50])

    def as_json(self) -> dict[str, Any]:
        return self.state().model_dump(mode="json")
