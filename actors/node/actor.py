"""The node actor: serves one shard over binary HTTP, keeps each session's Hot KV State, heartbeats on NATS.

``Node`` holds the parts and runs the lifecycle: the step engine over its backend, the HTTP server (the per-token
endpoints, ``hop_api``, in front of the control endpoints, ``control_api``, which list the whole API), the
registry heartbeats and the idle sweep, and what a head asks of NATS (its client's presence, the trackers'
repairs). Opening a session is ``opener``'s; freeing one (and keeping its KV for prefix reuse, ``reuse``) is here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time

from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.js.kv import KeyValue
from pydantic import BaseModel

from actors.backend import Backend
from actors.node.admission import Admission
from actors.node.build_id import build_id, kernels_id
from actors.node.config import NodeConfig
from actors.node.control_api import ControlApi
from actors.node.endings import Endings
from actors.node.engine import StepEngine
from actors.node.eviction_watch import EvictionWatch
from actors.node.hop_api import HopApi
from actors.node.link_probe import LinkProbe, route_neighbours
from actors.node.metrics import NodeMetrics
from actors.node.opener import SessionOpener
from actors.node.peer_keys import PeerKeys
from actors.node.prefix_cache import PrefixCache
from actors.node.prefix_offers import PrefixOffers
from actors.node.prefix_pull import PrefillRate, PrefixPull, PullPolicy
from actors.node.process_memory import resident_bytes
from actors.node.recovery.snapshot_store import SnapshotStore
from actors.node.recovery.standby import StandbyApi
from actors.node.reuse import Reuse
from actors.node.ring import RingGroups
from actors.node.runtime import NodeRuntime
from actors.node.session import NodeSession
from actors.node.speculation.drafts import DraftSource, ModelDraft, NgramDraft
from actors.node.spin import LoopPoller
from actors.node.spot_check import SpotChecks
from actors.registry import open_registry
from actors.selfcheck import warm_up
from actors.services import node_service
from bus import codec
from bus.actor import NatsActor
from bus.capability import verifier_from_settings
from bus.connection import keep_cancellation
from bus.httpserver import HttpServer
from bus.nats_edge import error_reply
from bus.nodeclient import NodeClient
from bus.subjects import Subjects
from bus.tracker_client import TrackerClient
from schemas.errors import (
    BadRequestError,
    NoRouteError,
    RouteFailedError,
    SwarmrouteError,
)
from schemas.frame import WireDType
from schemas.node import Capacity, NodeAdvertisement
from schemas.route import RepairRequest, RouteReply
from schemas.session import CONTEXT_CAP, SessionOpen, SessionOpened
from schemas.settings import Settings
from schemas.spot_check import CheckerReply, CheckerRequest, Dispute, DisputeReply

log = logging.getLogger(__name__)
SWITCH_INTERVAL_S = 0.0001
"""``sys.setswitchinterval`` of a node process (see ``Node._on_start``)."""
MIN_BEAT_SPACING_S = 0.05
"""Heartbeats triggered by freed sessions are coalesced to at most one per this interval."""
CLIENT_PROBE_TIMEOUT_S = 2.0
"""How long a head waits for its client's answer to a presence probe; silence counts as "unknown"."""


class Node(NatsActor):
    """An async context manager (``bus.actor.NatsActor``); ``stop()`` is safe to call twice."""

    def __init__(self, config: NodeConfig, backend: Backend, settings: Settings, *, nc: NATS | None = None,
                 draft: Backend | None = None) -> None:
        super().__init__(settings, nc=nc, name=f"node-{config.node_id}")
        self.config = config
        self.backend = backend
        self.subjects = Subjects(settings.namespace)
        self.sessions: dict[str, NodeSession] = {}
        self.endings = Endings()
        """Sessions headed here that ended (``actors.node.endings``): a probe in the window before the end is
        published hears "ended"."""
        self.admission = Admission(verifier_from_settings(settings), config.node_id, skew_s=settings.capability_ttl_s)
        self.snapshots = SnapshotStore(int(settings.snapshot_budget_mb * 2**20))
        """Other nodes' snapshot chains this node holds as their standby (issue #18)."""
        self.standby = StandbyApi(self.snapshots, self.admission, config.node_id,
                                  max_body_bytes=settings.max_frame_bytes)
        self.keys = PeerKeys(settings, config.node_id, config.host)
        """Its data-plane identity and TLS (issue #29)."""
        self._client = NodeClient(timeout_s=settings.hop_timeout_s, tls=self.keys.client,
                                  batch_frames=settings.frame_batch)
        self._tasks: list[asyncio.Task[None]] = []
        self._rebinding: asyncio.Task[None] | None = None
        self._kv: KeyValue | None = None
        self._evictions_sub: Subscription | None = None
        self.runtime: NodeRuntime | None = None
        self.hidden_shape = tuple(backend.info.hidden_shape)
        self.metrics = NodeMetrics()
        self.engine = StepEngine(backend, ring=RingGroups(settings.ring_groups),
                                 on_pass=self.metrics.pass_steps.observe)
        self.draining = False
        """Set by ``drain()``: no more heartbeats, so the registry forgets this node while its sessions finish."""
        self.metrics.bind(live_sessions=lambda: len(self.sessions), max_sessions=lambda: self.backend.max_sessions,
                          kv_bytes=self.backend.kv_bytes_in_use)
        self.metrics.bind_data_plane(lambda: self._client.data_plane)
        self._beat_soon = asyncio.Event()
        self.metrics.snapshots_held.set_function(lambda: float(self.snapshots.bytes_used))
        self.reuse = Reuse(self.engine, PrefixCache(max_entries=settings.prefix_cache_sessions,
                                                    max_bytes=int(settings.prefix_cache_mb * 2**20)),
                           self.snapshots, model_id=config.model_id, layers=backend.layers,
                           by_token=settings.prefix_reuse == "token" and settings.llama_batch_invariant != "all")
        """Completed sessions' KV kept for requests that start the same way (issue #18)."""
        self.metrics.prefix_cache_sessions.set_function(lambda: float(len(self.reuse.cache)))
        self.draft_engine = StepEngine(draft) if draft is not None else None
        """The draft model's engine, on a head that was given one (``speculation = model``, issue #20)."""
        self.prefix_offers = PrefixOffers(self.reuse, self.admission, model_id=config.model_id, layers=backend.layers,
                                          backend=backend.info.version, max_body_bytes=settings.max_body_bytes)
        """Kept prefixes offered to hops of other routes (issue #26)."""
        self.prefix_pull = PrefixPull(self.reuse, self._client,
                                      PullPolicy(PrefillRate(self.metrics.prefill_totals), mode=settings.prefix_pull),
                                      model_id=config.model_id, layers=backend.layers,
                                      timeout_s=settings.hop_timeout_s)
        """Prefixes pulled from other routes' nodes when that is cheaper than computing them (issue #26)."""
        self.spot = SpotChecks(node_id=config.node_id, model_id=config.model_id, build_id=build_id(backend.info),
                               kernels_id=kernels_id(backend.info),
                               backend=backend, engine=self.engine, settings=settings, metrics=self.metrics,
                               ask_checker=self._ask_checker, report_dispute=self._report_dispute,
                               client=self._client)
        """Spot checks (issue #28): this node's sampled receipts, and the receipts it recomputes for others."""
        self.spot.manifest_id = config.manifest_id
        self.eviction_watch = EvictionWatch(config.node_id, self.sessions, self.metrics, on_cleared=self.spot.cleared)
        self.opener = SessionOpener(node_id=config.node_id, model_id=config.model_id, backend=backend,
                                    engine=self.engine, client=self._client, admission=self.admission,
                                    reuse=self.reuse, metrics=self.metrics, sessions=self.sessions,
                                    hidden_shape=self.hidden_shape, on_closed=self._session_closed,
                                    pull=self.prefix_pull)
        control = ControlApi(node_id=config.node_id, backend=backend, engine=self.engine, admission=self.admission,
                             reuse=self.reuse, metrics=self.metrics, standby=self.standby, sessions=self.sessions,
                             open_session=lambda request: self.open_session(request),  # a wrapper set later counts
                             advertisement=self.advertisement, beat_soon=self._beat_soon.set,
                             max_body_bytes=settings.max_body_bytes, endings=self.endings,
                             prefix_offers=self.prefix_offers, extra_routes=self.spot.routes())
        hop_api = HopApi(control.app(), control.session_for, max_frame_bytes=settings.max_frame_bytes,
                         max_body_bytes=settings.max_body_bytes)
        self.server = HttpServer(hop_api, config.host, config.port, hot=hop_api, tls=self.keys.trust)
        self.links = LinkProbe(self._route_peers, interval_s=max(self.settings.heartbeat_s, 1.0) * 2.5,
                               tls=self.keys.client)
        """Data-plane RTTs to the nodes this one routes to and from, advertised for operators."""

    @property
    def endpoint(self) -> str:
        return self.keys.endpoint(self.config.advertise_url or self.server.url)

    # ---- lifecycle ---------------------------------------------------------------------------------------------

    async def _on_start(self) -> None:
        # The process tuning a node needs, here rather than in the CLI so that in-process tests run what
        # production runs: the backend's worker thread needs the GIL back the moment a forward pass returns, and
        # with the default 5 ms switch interval a busy event loop can hold it that long.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.runtime = NodeRuntime(node_id=self.config.node_id, engine=self.engine, client=self._client,
                                   publish=self._publish, subjects=self.subjects, settings=self.settings,
                                   wire_dtype=WireDType.parse(self.config.wire_dtype), metrics=self.metrics,
                                   poller=LoopPoller(on_polled=self.metrics.spin_seconds.inc),
                                   client_present=self._client_present, manifest_id=self.config.manifest_id,
                                   ask_repair=self._ask_repair, drafts=self._draft_source,
                                   spot_recorder=self.spot.recorder_for)
        await self.engine.start()
        # On the engine's thread, like every later pass: a pass started on any other thread that lives on would
        # leave a second OpenMP pool in the process, and every pass after it ~1.6x slower (actors/node/engine.py).
        await self.engine.call(warm_up, self.backend)
        if self.draft_engine is not None:
            await self.draft_engine.start()
            await self.draft_engine.call(warm_up, self.draft_engine.backend)
        await self.server.start()
        await self.keys.follow(self.nc, self.subjects)
        self._kv = await open_registry(self.nc, self.subjects, self.settings.registry_ttl_s,
                                       replicas=self.settings.registry_replicas)
        await self.advertise_now()
        self.service = await node_service(self.nc, self.subjects, self.advertisement)
        self._evictions_sub = await self.nc.subscribe(self.subjects.evictions(), cb=self.eviction_watch.on_message)
        if self.settings.test_misbehave:
            log.error("node %s runs with SWARMROUTE_TEST_MISBEHAVE=%s: it computes WRONG on purpose (a test of spot "
                      "checks, issue #28); never run it in production", self.config.node_id,
                      self.settings.test_misbehave)
        self._tasks = [asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
                       asyncio.create_task(self._sweep_loop(), name="idle-sweep"),
                       asyncio.create_task(self.links.run(), name="link-probe")]
        log.info("node %s serving layers %s of %s at %s", self.config.node_id, self.backend.layers,
                 self.config.model_id, self.endpoint)

    async def drain(self, timeout_s: float) -> int:
        """Stop advertising (trackers route no new session here), then wait up to ``timeout_s`` for the open
        sessions to finish. Returns how many are still open; ``stop()`` afterwards frees them."""
        if not self.running:
            return len(self.sessions)
        self.draining = True
        await self._withdraw()
        log.info("node %s draining: %d session(s) open", self.config.node_id, len(self.sessions))
        deadline = time.monotonic() + timeout_s
        while self.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return len(self.sessions)

    async def _on_stop(self) -> None:
        tasks = [*self._tasks, *([self._rebinding] if self._rebinding is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._stop_service()
        if self._evictions_sub is not None:
            with contextlib.suppress(Exception):
                await self._evictions_sub.unsubscribe()
        await self.spot.aclose()
        await self._withdraw()
        for session in list(self.sessions.values()):
            await session.close()
        await self.server.stop()
        await self.engine.stop()
        if self.draft_engine is not None:
            await self.draft_engine.stop()
            self.draft_engine.backend.close()
        await self._client.aclose()
        await self.links.aclose()
        await self.keys.stop()

    # ---- NATS --------------------------------------------------------------------------------------------------

    async def _publish(self, subject: str, model: BaseModel) -> None:
        await self.nc.publish(subject, codec.encode(model))
        keep_cancellation()

    def advertisement(self) -> NodeAdvertisement:
        info = self.backend.info
        capacity = Capacity(max_sessions=self.backend.max_sessions,
                            active_sessions=min(self.sequences_in_use(), self.backend.max_sessions),
                            max_context=min(info.context_length, CONTEXT_CAP),
                            kv_bytes_in_use=self.backend.kv_bytes_in_use(), sessions_opened=self.opener.opened_total,
                            sessions_refused=self.admission.settled.refused,
                            snapshot_free_bytes=max(0, self.snapshots.budget_bytes - self.snapshots.bytes_used),
                            prefix_keys=self.reuse.cache.keys())
        return NodeAdvertisement(node_id=self.config.node_id, endpoint=self.endpoint, model_id=self.config.model_id,
                                 layers=self.backend.layers, is_head=self.backend.is_head,
                                 is_tail=self.backend.is_tail, backend=info, capacity=capacity,
                                 verified=self.config.verified, manifest_id=self.config.manifest_id,
                                 aliases=list(self.config.aliases), link_rtt_ms=dict(self.links.rtt_ms),
                                 rss_bytes=resident_bytes(), fingerprint=self.keys.fingerprint,
                                 certificate=self.keys.certificate, build_id=self.spot.build_id,
                                 kernels_id=self.spot.kernels_id)

    @property
    def _registry_timeout_s(self) -> float:
        """How long one registry write may wait for JetStream's ack. A stream that lost its leader (its server died)
        answers nothing until a new one is elected; a put waiting the client's default 5 s, plus a rebind waiting
        as long, left this node out of the registry, and out of the trackers' view, for longer than the TTL."""
        return max(0.5, min(self.settings.heartbeat_s, self.settings.registry_ttl_s / 4))

    async def _client_present(self, session_id: str) -> bool | None:
        """Whether a session's client (its gateway) still listens: NATS answers "no responders" at once when
        nobody subscribes to the session's subjects any more. No answer in time says nothing either way."""
        try:
            await self.nc.request(self.subjects.client(session_id), b"", timeout=CLIENT_PROBE_TIMEOUT_S)
            keep_cancellation()
        except NoRespondersError:
            return False
        except Exception:  # noqa: BLE001 - a timeout or an outage: unknown, the next probe asks again
            return None
        return True

    def _draft_source(self, session_id: str, source: str) -> DraftSource:
        """A speculative session's drafts (issue #20): prompt lookup, or the draft model this head loaded."""
        if source == "ngram":
            return NgramDraft()
        if source == "model" and self.draft_engine is not None:
            return ModelDraft(self.draft_engine, session_id=session_id)
        raise BadRequestError(f"node {self.config.node_id} has no {source!r} draft source", param="speculation")

    async def _ask_repair(self, request: RepairRequest) -> RouteReply:
        """Ask the trackers to replace a lost hop of a session this node heads (issue #18)."""
        try:
            route = await TrackerClient(self.nc, self.subjects, timeout_s=self.settings.hop_timeout_s).repair(request)
        except SwarmrouteError as exc:  # no tracker answers (503), or the tracker's refusal
            return error_reply(RouteReply, exc)
        except codec.DecodeError as exc:
            return error_reply(RouteReply, RouteFailedError(f"an unreadable tracker reply: {exc}"))
        except Exception as exc:  # noqa: BLE001 - an outage: the head asks again while it may
            return error_reply(RouteReply, NoRouteError(f"the trackers did not answer: {type(exc).__name__}"))
        return RouteReply(route=route)

    async def _ask_checker(self, request: CheckerRequest) -> CheckerReply:
        """Who recomputes a receipt of this node's layers (or referees a dispute): the trackers pick (issue #28)."""
        try:
            msg = await self.nc.request(self.subjects.spot_checker_request, codec.encode(request),
                                        timeout=self.settings.hop_timeout_s)
            return codec.decode(msg.data, CheckerReply)
        except Exception as exc:  # noqa: BLE001 - no tracker, an outage: the check is skipped
            return CheckerReply(status=503, error=f"the trackers did not answer: {type(exc).__name__}")

    async def _report_dispute(self, dispute: Dispute) -> DisputeReply:
        msg = await self.nc.request(self.subjects.dispute_request, codec.encode(dispute),
                                    timeout=self.settings.hop_timeout_s)
        return codec.decode(msg.data, DisputeReply)

    async def advertise_at(self, url: str | None) -> None:
        """Advertise another base URL for peers (e.g. a proxy in front of this node), at once."""
        self.config.advertise_url = url
        await self.advertise_now()

    async def advertise_now(self) -> None:
        """Publish this node's advertisement into the registry now (heartbeats do it every ``heartbeat_s``)."""
        assert self._kv is not None
        await self._kv.put(self.config.node_id, codec.encode(self.advertisement()))
        keep_cancellation()

    async def _withdraw(self) -> None:
        """Delete this node's advertisement (drain, clean stop); a registry that cannot answer is not waited for."""
        if self._kv is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._registry_timeout_s):
                    await self._kv.delete(self.config.node_id)

    async def _heartbeat_loop(self) -> None:
        while True:
            # Every heartbeat_s, and at once (coalesced) when a session frees its slot: a stale "full" would make
            # the tracker refuse routes the swarm has room for.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.heartbeat_s):  # unlike wait_for, no task per wait
                    await self._beat_soon.wait()
            self._beat_soon.clear()
            if self.draining:
                continue  # a draining node stays out of the registry
            try:
                async with asyncio.timeout(self._registry_timeout_s):
                    await self.advertise_now()
            except Exception as exc:  # noqa: BLE001 - a NATS outage must not kill the node; retry next beat
                # No ack: a stream electing a leader, or a restarted server without the bucket (NATS says "no
                # responders" only when nobody at all listens, and trackers listen to these subjects). The put
                # itself still reached the trackers' live feed either way.
                if isinstance(exc, TimeoutError):
                    log.warning("heartbeat not acknowledged within %.1fs", self._registry_timeout_s)
                else:
                    log.warning("heartbeat failed: %s", type(exc).__name__)
                self._rebind_soon()
            await asyncio.sleep(MIN_BEAT_SPACING_S)

    def _rebind_soon(self) -> None:
        """Rebind in the background: heartbeats keep their pace meanwhile, which the trackers' view depends on."""
        if self._rebinding is None or self._rebinding.done():
            self._rebinding = asyncio.create_task(self._rebind_registry(), name="registry-rebind")

    async def _rebind_registry(self) -> None:
        """A NATS server restarted without its (in-memory) registry bucket: create it again, so heartbeats land
        in the KV once more instead of failing until some tracker restarts. Binds the bucket if it still exists."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._registry_timeout_s + self.settings.heartbeat_s):
                self._kv = await open_registry(self.nc, self.subjects, self.settings.registry_ttl_s,
                                               replicas=self.settings.registry_replicas,
                                               unavailable_wait_s=self.settings.heartbeat_s)

    async def _sweep_loop(self) -> None:
        ttl = self.settings.session_idle_ttl_s
        while True:
            await asyncio.sleep(min(ttl / 4, 5.0))
            cutoff = time.monotonic() - ttl
            for session in [s for s in self.sessions.values() if s.last_activity < cutoff]:
                log.info("freeing idle session %s", session.id)
                await session.close()

    # ---- sessions ----------------------------------------------------------------------------------------------

    async def _session_closed(self, session: NodeSession) -> None:
        if self.sessions.get(session.id) is session:
            del self.sessions[session.id]
            if session.is_head and session.phase.terminal:
                self.endings.ended(session.id, session.phase)
        if session.keep and self.reuse.enabled:  # n > 1: choice 0's KV (the session's own backend session)
            try:
                await self.reuse.keep(session.id, session.recovery.tokens, min(session.keep, session.position),
                                      session.request.prefill_chunk, session.session_token,
                                      invariant=session.request.sampling.batch_invariant)
            except Exception as exc:  # noqa: BLE001 - a prefix not kept costs a later prefill, nothing else
                log.warning("session %s: KV not kept for reuse: %r", session.id[:8], exc)
        for backend_id in session.choices.backend_ids():  # n > 1: every choice's forked backend session too
            with contextlib.suppress(Exception):
                await self.engine.close_session(backend_id)
        self._beat_soon.set()

    async def open_session(self, request: SessionOpen) -> SessionOpened:
        """Open a session here (``opener``); a head's answer waits until the hops after it have opened."""
        assert self.runtime is not None
        return await self.opener.open(self.runtime, request)

    def _route_peers(self) -> list[tuple[str, str]]:
        """The nodes next to this one on its open sessions' routes (``LinkProbe`` measures them)."""
        return [peer for s in list(self.sessions.values())
                for peer in route_neighbours(s.route, s.hop_index, self.config.node_id).items()]

    def sequences_in_use(self) -> int:
        """Backend sequences the open sessions hold or have reserved: one per choice."""
        return self.opener.sequences_in_use()
