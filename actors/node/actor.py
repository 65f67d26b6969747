"""The node actor: serves one shard over binary HTTP, keeps each session's Hot KV State, heartbeats on NATS.

HTTP API (docs/protocol.md has the full contract)::

    GET    /health                          liveness
    GET    /v1/info                         this node's advertisement
    POST   /v1/tokenize                     head: Prompt -> token ids
    POST   /v1/sessions                     open (SessionOpen); the head starts prefill at once
    GET    /v1/sessions/{id}                position and counters of one session
    POST   /v1/sessions/{id}/frames         binary activation frame (every hop but the head)
    POST   /v1/sessions/{id}/tokens         head: the tail's sampled token (token frame or TokenEvent)
    POST   /v1/sessions/{id}/failure        head: a downstream hop reports a failure (FailureReason)
    POST   /v1/sessions/{id}/route          a repaired route: go on as its hop (RouteUpdate -> HopPosition)
    POST   /v1/sessions/{id}/replay         resend the journal to the new successor (ReplayRequest)
    DELETE /v1/sessions/{id}                free the session (idempotent)
    POST   /v1/snapshots                    standby: keep one snapshot segment (bus.snapshot body)
    GET    /v1/snapshots/{id}?layers=A:B    standby: the chain held for a session's hop (SnapshotList)
    GET    /v1/snapshots/{id}/{digest}      standby: one segment's body
    DELETE /v1/snapshots/{id}               standby: forget a session's chains

Why one module of ~560 lines: the actor's lifecycle, heartbeats and every control endpoint of a session (open with
its reuse or rebuild, status, repair updates and replays, close with keep) share its sessions, engine and admission;
the per-token endpoints (``hop_api``), the standby's (``standby``) and the KV bookkeeping (``reuse``) live beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys
import time
from typing import TypeVar

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.js.kv import KeyValue
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as HttpRoute

from actors.backend import Backend, ForkingBackend, KvBackend
from actors.node.admission import Admission
from actors.node.speculation.drafts import DraftSource, ModelDraft, NgramDraft
from actors.node.engine import StepEngine
from actors.node.head_session import HeadSession
from actors.node.hop_api import HopApi
from actors.node.hop_session import HopSession
from actors.node.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from actors.node.metrics import NodeMetrics
from actors.node.prefix_cache import PrefixCache
from actors.node.reuse import Reuse
from actors.node.ring import RingGroups
from actors.node.route_open import RouteOpening
from actors.node.runtime import NodeRuntime
from actors.node.session import NodeSession
from actors.node.recovery.snapshot_store import SnapshotStore
from actors.node.spin import LoopPoller
from actors.node.recovery.standby import StandbyApi, fetch_chain
from actors.registry import open_registry
from actors.selfcheck import warm_up
from actors.services import node_service
from bus import codec
from bus import frame as frames
from bus.actor import NatsActor
from bus.capability import HEADER_CAPABILITY, HEADER_SESSION_TOKEN, verifier_from_settings
from bus.connection import keep_cancellation
from bus.http_edge import EXCEPTION_HANDLERS, read_model
from bus.httpserver import HttpServer
from bus.nodeclient import NodeClient
from bus.subjects import Subjects
from schemas.errors import (
    BadRequestError,
    CapacityError,
    ContextLengthError,
    SessionNotFoundError,
)
from schemas.frame import WireDType
from schemas.node import Capacity, NodeAdvertisement
from schemas.route import RepairRequest, ReplayRequest, RouteReply, RouteUpdate
from schemas.session import (
    CONTEXT_CAP,
    FailureReason,
    Prompt,
    Resume,
    SessionOpen,
    SessionOpened,
    TokenizeReply,
    session_budget,
)
from schemas.settings import Settings

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
SWITCH_INTERVAL_S = 0.0001
"""``sys.setswitchinterval`` of a node process (see ``Node._on_start``)."""
MIN_BEAT_SPACING_S = 0.05
"""Heartbeats triggered by freed sessions are coalesced to at most one per this interval."""
CLIENT_PROBE_TIMEOUT_S = 2.0
"""How long a head waits for its client's answer to a presence probe; silence counts as "unknown"."""


@dataclasses.dataclass
class NodeConfig:
    node_id: str
    """Unique in the swarm; also the registry key."""

    model_id: str
    """What the tracker matches route requests against (content-derived id for GGUF artifacts)."""

    host: str = "127.0.0.1"
    """Listen address of the node's HTTP API."""

    port: int = 0
    """Listen port; 0 picks a free one."""

    advertise_url: str | None = None
    """Base URL peers should use, when it differs from the listen address (NAT, containers)."""

    wire_dtype: str = "f32"
    """Activation dtype this node sends: f32 (bit-exact) or f16 (half the bytes)."""

    manifest_id: str = ""
    """Artifact manifest this node's shard was verified against."""

    verified: bool = True
    """Whether the shard passed verification; unverified nodes are never routed to."""

    aliases: tuple[str, ...] = ()
    """Other names clients may use for the model (the id stays content-derived for GGUF artifacts)."""


class Node(NatsActor):
    """An async context manager (``bus.actor.NatsActor``); ``stop()`` is safe to call twice."""

    def __init__(self, config: NodeConfig, backend: Backend, settings: Settings, *, nc: NATS | None = None,
                 draft: Backend | None = None) -> None:
        super().__init__(settings, nc=nc, name=f"node-{config.node_id}")
        self.config = config
        self.backend = backend
        self.subjects = Subjects(settings.namespace)
        self.sessions: dict[str, NodeSession] = {}
        self.admission = Admission(verifier_from_settings(settings), config.node_id, skew_s=settings.capability_ttl_s)
        self.snapshots = SnapshotStore(int(settings.snapshot_budget_mb * 2**20))
        """Other nodes' snapshot chains this node holds as their standby (issue #18)."""
        self.standby = StandbyApi(self.snapshots, self.admission, config.node_id,
                                  max_body_bytes=settings.max_frame_bytes)
        hop_api = HopApi(self._app(), self._session_for, max_frame_bytes=settings.max_frame_bytes,
                         max_body_bytes=settings.max_body_bytes)
        self.server = HttpServer(hop_api, config.host, config.port, hot=hop_api)
        self._client = NodeClient(timeout_s=settings.hop_timeout_s)
        self._tasks: list[asyncio.Task[None]] = []
        self._rebinding: asyncio.Task[None] | None = None
        self._kv: KeyValue | None = None
        self.runtime: NodeRuntime | None = None
        self.hidden_shape = tuple(backend.info.hidden_shape)
        self.metrics = NodeMetrics()
        self.engine = StepEngine(backend, ring=RingGroups(settings.ring_groups),
                                 on_pass=self.metrics.pass_steps.observe)
        self.draining = False
        """Set by ``drain()``: no more heartbeats, so the registry forgets this node while its sessions finish."""
        self.metrics.bind(live_sessions=lambda: len(self.sessions), max_sessions=lambda: self.backend.max_sessions,
                          kv_bytes=self.backend.kv_bytes_in_use)
        self._beat_soon = asyncio.Event()
        self._opened_total = 0
        self.metrics.snapshots_held.set_function(lambda: float(self.snapshots.bytes_used))
        self.reuse = Reuse(self.engine, PrefixCache(max_entries=settings.prefix_cache_sessions,
                                                    max_bytes=int(settings.prefix_cache_mb * 2**20)),
                           self.snapshots, model_id=config.model_id, layers=backend.layers)
        """Completed sessions' KV kept for requests that start the same way (issue #18)."""
        self.metrics.prefix_cache_sessions.set_function(lambda: float(len(self.reuse.cache)))
        self.draft_engine = StepEngine(draft) if draft is not None else None
        """The draft model's engine, on a head that was given one (``speculation = model``, issue #20)."""

    @property
    def endpoint(self) -> str:
        return self.config.advertise_url or self.server.url

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
                                   ask_repair=self._ask_repair, drafts=self._draft_source)
        await self.engine.start()
        # On the engine's thread, like every later pass: a pass started on any other thread that lives on would
        # leave a second OpenMP pool in the process, and every pass after it ~1.6x slower (actors/node/engine.py).
        await self.engine.call(warm_up, self.backend)
        if self.draft_engine is not None:
            await self.draft_engine.start()
            await self.draft_engine.call(warm_up, self.draft_engine.backend)
        await self.server.start()
        self._kv = await open_registry(self.nc, self.subjects, self.settings.registry_ttl_s,
                                       replicas=self.settings.registry_replicas)
        await self.advertise_now()
        self.service = await node_service(self.nc, self.subjects, self.advertisement)
        self._tasks = [asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
                       asyncio.create_task(self._sweep_loop(), name="idle-sweep")]
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
        await self._withdraw()
        for session in list(self.sessions.values()):
            await session.close()
        await self.server.stop()
        await self.engine.stop()
        if self.draft_engine is not None:
            await self.draft_engine.stop()
            self.draft_engine.backend.close()
        await self._client.aclose()

    # ---- NATS --------------------------------------------------------------------------------------------------

    async def _publish(self, subject: str, model: BaseModel) -> None:
        await self.nc.publish(subject, codec.encode(model))
        keep_cancellation()

    def advertisement(self) -> NodeAdvertisement:
        info = self.backend.info
        capacity = Capacity(max_sessions=self.backend.max_sessions,
                            active_sessions=min(self.sequences_in_use(), self.backend.max_sessions),
                            max_context=min(info.context_length, CONTEXT_CAP),
                            kv_bytes_in_use=self.backend.kv_bytes_in_use(), sessions_opened=self._opened_total,
                            sessions_refused=self.admission.settled.refused,
                            snapshot_free_bytes=max(0, self.snapshots.budget_bytes - self.snapshots.bytes_used),
                            prefix_keys=self.reuse.cache.keys())
        return NodeAdvertisement(node_id=self.config.node_id, endpoint=self.endpoint, model_id=self.config.model_id,
                                 layers=self.backend.layers, is_head=self.backend.is_head,
                                 is_tail=self.backend.is_tail, backend=info, capacity=capacity,
                                 verified=self.config.verified, manifest_id=self.config.manifest_id,
                                 aliases=list(self.config.aliases))

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
            msg = await self.nc.request(self.subjects.repair_request, codec.encode(request),
                                        timeout=self.settings.hop_timeout_s)
            keep_cancellation()
        except NoRespondersError:
            return RouteReply(error="no tracker answers repair requests", status=503)
        except Exception as exc:  # noqa: BLE001 - a timeout or an outage: the head asks again while it may
            return RouteReply(error=f"the trackers did not answer: {type(exc).__name__}", status=503)
        try:
            return codec.decode(msg.data, RouteReply)
        except codec.DecodeError as exc:
            return RouteReply(error=f"an unreadable tracker reply: {exc}", status=502)

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
        if session.keep and session.request.n == 1 and self.reuse.enabled:
            try:
                await self.reuse.keep(session.id, session.recovery.tokens, min(session.keep, session.position),
                                      session.request.prefill_chunk, session.session_token)
            except Exception as exc:  # noqa: BLE001 - a prefix not kept costs a later prefill, nothing else
                log.warning("session %s: KV not kept for reuse: %r", session.id[:8], exc)
        for backend_id in session.choices.backend_ids():  # n > 1: every choice's forked backend session too
            with contextlib.suppress(Exception):
                await self.engine.close_session(backend_id)
        self._beat_soon.set()

    async def open_session(self, request: SessionOpen) -> SessionOpened:
        grant = self.admission.admit_open(request)
        try:
            frames.session_bytes(request.session_id)  # frames carry it as 16 bytes
        except ValueError as exc:
            raise BadRequestError(str(exc), param="session_id") from exc
        if request.session_id in self.sessions:
            raise BadRequestError(f"session {request.session_id} is already open on node {self.config.node_id}")
        hops = request.route.hops
        if request.hop_index >= len(hops) or hops[request.hop_index].node_id != self.config.node_id:
            raise BadRequestError(f"hop {request.hop_index} of the route is not node {self.config.node_id}")
        if hops[request.hop_index].layers != self.backend.layers:
            raise BadRequestError(f"route expects layers {hops[request.hop_index].layers} from node "
                                  f"{self.config.node_id}, which serves {self.backend.layers}")
        if request.n > self.backend.max_sessions:
            raise BadRequestError(f"n={request.n} choices need as many sequences; node {self.config.node_id} holds "
                                  f"{self.backend.max_sessions}", param="n")
        if request.n > 1 and not isinstance(self.backend, ForkingBackend):
            raise BadRequestError(f"node {self.config.node_id}'s backend cannot fork a session into choices",
                                  param="n")
        if self.sequences_in_use() + request.n > self.backend.max_sessions:
            # Every choice forks into a sequence of its own after prefill: all of them are reserved now.
            raise CapacityError(f"node {self.config.node_id} is full ({self.backend.max_sessions} sequences, "
                                f"{self.sequences_in_use()} in use; this session needs {request.n})",
                                retry_after=1.0)
        if request.prompt is not None:  # issue #20: the head tokenizes what the gateway did not
            request = await self._tokenized(request)
        n_ctx = min(self.backend.info.context_length, CONTEXT_CAP)
        if len(request.prompt_tokens) + request.max_tokens > n_ctx:
            raise ContextLengthError(f"prompt ({len(request.prompt_tokens)} tokens) + max_tokens "
                                     f"({request.max_tokens}) exceed the context of {n_ctx} tokens")
        n_vocab = self.backend.info.n_vocab
        if request.hop_index == 0 and n_vocab and any(not 0 <= t < n_vocab for t in request.prompt_tokens):
            raise BadRequestError(f"prompt token ids must lie in [0, {n_vocab}) for this model", param="prompt")
        session_token = grant.session_token if grant else None
        # The head opens the hops after it now, while it opens its own backend session and prefills (issue #20).
        opening = RouteOpening(self._client, request, session_token) if request.downstream else None
        try:
            await self.engine.call(lambda: self.backend.open_session(
                request.session_id, prompt_tokens=request.prompt_tokens, sampling=request.sampling))
        except BaseException:
            if opening is not None:
                await opening.cancel()
            raise
        assert self.runtime is not None
        role = HeadSession if request.hop_index == 0 else HopSession
        session = role(self.runtime, request, hidden_shape=self.hidden_shape, on_closed=self._session_closed)
        session.session_token = session_token
        reused = 0
        try:
            if request.resume is not None:
                await self._rebuild(session, request.resume)
            elif request.n == 1:
                limit = request.reuse_limit
                if opening is not None and self.reuse.reusable(request.prompt_tokens, request.prefill_chunk):
                    # Prefix reuse: the head reuses no more than every hop after it holds (issue #18).
                    limit = min(o.reused for o in await opening.result())
                reused = await self.reuse.start(request.session_id, request.prompt_tokens, request.prefill_chunk,
                                                limit)
        except BaseException:
            await self.engine.close_session(request.session_id)
            if opening is not None:
                await opening.cancel()
            raise
        if reused:
            session.choices.first.position = session.reused = reused
            self.metrics.prefix_reused.inc(reused)
        self.admission.record(grant)
        self.sessions[request.session_id] = session
        self._opened_total += 1
        self.admission.settled.opened(request.session_id)
        self.metrics.session_opened(request.hop_index, len(hops))
        if opening is not None and isinstance(session, HeadSession):
            session.opening = opening  # its first frame waits for the later hops' answers
        session.start()
        if opening is not None:
            try:
                await opening.result()
            except BaseException:
                await session.close()  # it has published nothing yet: the answer below says what failed
                raise
        return SessionOpened(session_id=request.session_id, node_id=self.config.node_id,
                             prompt_tokens=len(request.prompt_tokens), reused=reused,
                             max_tokens=request.max_tokens if request.fit_max_tokens else None)

    async def _tokenized(self, request: SessionOpen) -> SessionOpen:
        """A head's open with a prompt instead of tokens (issue #20): tokenized here, checked against the route's
        context as the gateway checks it, the generation budget settled."""
        assert request.prompt is not None
        if not self.backend.is_head:
            raise BadRequestError(f"node {self.config.node_id} is not a head: it has no tokenizer input")
        tokens = await self.engine.call(self.backend.tokenize, request.prompt)
        budget = session_budget(len(tokens), None if request.fit_max_tokens else request.max_tokens,
                                default=request.max_tokens,
                                context=min(request.route.context_length, CONTEXT_CAP))
        return request.model_copy(update={"prompt_tokens": tokens, "max_tokens": budget, "prompt": None})

    async def _rebuild(self, session: NodeSession, resume: Resume) -> None:
        """A replacement for a lost hop (issue #18): import the lost hop's snapshot chain from its standby (every
        segment checked against its digest and linked to the one before), then, on a tail, start the sampler and
        stop rules over from the tokens generated so far. The journal replay that follows brings the KV up to
        the route's position."""
        if not isinstance(session, HopSession):
            raise BadRequestError("the head is never replaced")
        if resume.segments:
            kv = await fetch_chain(self._client, resume, session.id, self.backend.layers, self.config.model_id,
                                   session_token=session.session_token)
            backend = self.backend
            if not isinstance(backend, KvBackend):
                raise BadRequestError(f"node {self.config.node_id}'s backend cannot import KV")
            await self.engine.call(backend.import_kv, session.id, kv, resume.start)
        session.choices.first.position = resume.start
        session.recovery.tokens = [*session.request.prompt_tokens, *resume.generated]
        if session.is_tail:
            await session.restart_generation(resume.generated)

    def sequences_in_use(self) -> int:
        """Backend sequences the open sessions hold or have reserved: one per choice."""
        return sum(s.request.n for s in self.sessions.values())

    def _get(self, session_id: str) -> NodeSession:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionNotFoundError(f"session {session_id} is not open on node {self.config.node_id}")
        return session

    def _member(self, request: Request) -> NodeSession:
        return self._session_for(request.path_params["sid"], request.headers.get(HEADER_SESSION_TOKEN))

    def _session_for(self, session_id: str, session_token: str | None) -> NodeSession:
        """The session a request is about, if the request proves membership (session token, when admission is on)."""
        session = self._get(session_id)
        Admission.check_session_token(session.session_token, session_token)
        return session

    # ---- HTTP --------------------------------------------------------------------------------------------------

    def _app(self) -> Starlette:
        routes = [
            HttpRoute("/health", self._health, methods=["GET"]),
            HttpRoute("/metrics", self._metrics, methods=["GET"]),
            HttpRoute("/v1/info", self._info, methods=["GET"]),
            HttpRoute("/v1/tokenize", self._tokenize, methods=["POST"]),
            HttpRoute("/v1/sessions", self._open, methods=["POST"]),
            HttpRoute("/v1/sessions/{sid}", self._status, methods=["GET"]),
            HttpRoute("/v1/sessions/{sid}", self._close, methods=["DELETE"]),
            # POST .../frames and .../tokens, the per-token path, are served by HopApi in front of this app.
            HttpRoute("/v1/sessions/{sid}/failure", self._failure, methods=["POST"]),
            HttpRoute("/v1/sessions/{sid}/route", self._route_update, methods=["POST"]),
            HttpRoute("/v1/sessions/{sid}/replay", self._replay, methods=["POST"]),
            *self.standby.routes(),
        ]
        return Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS)

    async def _json(self, request: Request, model: type[M]) -> M:
        return await read_model(request, model, self.settings.max_body_bytes)

    async def _metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "node_id": self.config.node_id, "sessions": len(self.sessions)})

    async def _info(self, request: Request) -> Response:
        return JSONResponse(self.advertisement().model_dump(mode="json"))

    async def _tokenize(self, request: Request) -> Response:
        prompt = await self._json(request, Prompt)
        self.admission.check_capability(request.headers.get(HEADER_CAPABILITY))
        if not self.backend.is_head:
            raise BadRequestError(f"node {self.config.node_id} is not a head: it has no tokenizer input")
        tokens = await self.engine.call(self.backend.tokenize, prompt)
        # With tools the head tells the gateway how it asked the model to write calls (the tail constrains, the
        # gateway parses that format); a backend that renders no tools refused them in ``tokenize`` already.
        tool_format = getattr(self.backend, "tool_format", None)
        if prompt.tools is not None and tool_format is None:
            raise BadRequestError(f"node {self.config.node_id}'s backend does not render tools", param="tools")
        reply = TokenizeReply(tokens=tokens,
                              tool_format=tool_format() if prompt.tools is not None and tool_format else None)
        return JSONResponse(reply.model_dump(mode="json"))

    async def _open(self, request: Request) -> Response:
        open_request = await self._json(request, SessionOpen)
        try:
            opened = await self.open_session(open_request)
        except BaseException:
            if self.admission.settled.refused_open(open_request.session_id):
                self._beat_soon.set()  # the trackers release the route's reservation here now, not in 1.5 beats
            raise
        return JSONResponse(opened.model_dump(mode="json"), status_code=201)

    async def _status(self, request: Request) -> Response:
        s = self._member(request)
        return JSONResponse({"session_id": s.id, "position": s.position, "phase": s.phase.value,
                             "frames_received": s.frames_received, "bytes_received": s.bytes_received,
                             "positions_received": s.positions_received})

    async def _close(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        session = self.sessions.get(sid)
        token = request.headers.get(HEADER_SESSION_TOKEN)
        if session is not None:
            Admission.check_session_token(session.session_token, token)
            if isinstance(session, HeadSession) and request.query_params.get("cancel") == "1":
                await session.cancel("its client went away")
            else:
                session.keep = _positions(request.query_params.get("keep"), session.position)
                await session.close()
        elif self.admission.settled.closed_unopened(sid):
            self._beat_soon.set()  # a route refused before it reached this hop: its reservation ends now
        keys = [k for k in request.query_params.get("keys", "").split(",") if k]
        kept = self.reuse.cache.get(sid)
        if keys and kept is not None:
            Admission.check_session_token(kept.token, token)
            self.reuse.cache.attach_keys(sid, keys)
            self._beat_soon.set()  # trackers learn at once where the next turn's prefix is
        return JSONResponse({"closed": session is not None})

    async def _failure(self, request: Request) -> Response:
        session = self._member(request)
        reason = await self._json(request, FailureReason)
        session.on_failure_report(reason)
        return Response(status_code=204)

    # ---- repair and snapshots (issue #18) ----------------------------------------------------------------------

    async def _route_update(self, request: Request) -> Response:
        session = self._member(request)
        update = await self._json(request, RouteUpdate)
        if update.session_id != session.id or not isinstance(session, HopSession):
            raise BadRequestError(f"a route update for session {update.session_id} reaches the heads of none")
        hops = update.route.hops
        if update.hop_index >= len(hops) or hops[update.hop_index].node_id != self.config.node_id:
            raise BadRequestError(f"hop {update.hop_index} of the repaired route is not node {self.config.node_id}")
        self.admission.check_update(update, session.session_token)
        position = await session.update_route(update)
        return JSONResponse(position.model_dump(mode="json"))

    async def _replay(self, request: Request) -> Response:
        session = self._member(request)
        replay = await self._json(request, ReplayRequest)
        return JSONResponse({"positions": session.replay(replay)})


def _positions(keep: str | None, held: int) -> int:
    """``keep`` of a DELETE: ``1`` (before issue #20) or how many positions are confirmed; 0 when absent."""
    if not keep or not keep.isdigit():
        return 0
    return held if keep == "1" else min(int(keep), held)
