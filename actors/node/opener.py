"""Opening a Route Session on this node (``POST /v1/sessions``), for the node actor (``actors.node.actor``).

An open is admitted (``admission``), checked against this node's shard and capacity, tokenized on a head that was
sent a prompt (issue #20), and its backend session opened; a head starts opening the hops after it at once
(``route_open.RouteOpening``), so they open while its own backend session does. Then what the session starts
from: a replacement for a lost hop imports the lost hop's snapshot chain (issue #18), any other single-choice
session takes what it can of a kept prefix (prefix reuse: a head no more than every later hop holds). The role
(``HeadSession`` at hop 0, else ``HopSession``) is built once all that is settled, with it as one ``SessionStart``,
registered and started; a head's open is answered once its later hops have (``HeadSession.route_opened``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from actors.backend import Backend, ForkingBackend, KvBackend
from actors.node.admission import Admission
from actors.node.engine import StepEngine
from actors.node.head_session import HeadSession
from actors.node.hop_session import HopSession
from actors.node.metrics import NodeMetrics
from actors.node.prefix_pull import PrefixPull
from actors.node.recovery.standby import fetch_chain
from actors.node.reuse import Reuse
from actors.node.route_open import RouteOpening
from actors.node.runtime import NodeRuntime
from actors.node.session import NodeSession, SessionStart
from bus import frame as frames
from bus.nodeclient import NodeClient
from schemas.errors import BadRequestError, CapacityError, ContextLengthError
from schemas.reasoning import ReasoningStart
from schemas.session import CONTEXT_CAP, Resume, SessionOpen, SessionOpened, session_budget
from schemas.snapshot import StandbyRef


class SessionOpener:
    def __init__(self, *, node_id: str, model_id: str, backend: Backend, engine: StepEngine, client: NodeClient,
                 admission: Admission, reuse: Reuse, metrics: NodeMetrics, sessions: dict[str, NodeSession],
                 hidden_shape: tuple[int, ...], on_closed: Callable[[NodeSession], Awaitable[None]],
                 pull: PrefixPull | None = None) -> None:
        self.node_id = node_id
        self.model_id = model_id
        self.backend = backend
        self.engine = engine
        self.client = client
        self.admission = admission
        self.reuse = reuse
        self.metrics = metrics
        self.sessions = sessions
        """The node's open sessions, by id: an opened session is registered here."""
        self.hidden_shape = hidden_shape
        self.on_closed = on_closed
        self.pull = pull
        """Prefixes this node's route lacks, pulled from another route's node (issue #26)."""
        self.opened_total = 0
        """Sessions opened here so far (advertised: trackers tell a restarted node by it)."""

    def sequences_in_use(self) -> int:
        """Backend sequences the open sessions hold or have reserved: one per choice."""
        return sum(s.request.n for s in self.sessions.values())

    async def open(self, rt: NodeRuntime, request: SessionOpen) -> SessionOpened:
        grant = self.admission.admit_open(request)
        self._check(request)
        if request.prompt is not None:  # issue #20: the head tokenizes what the gateway did not
            request = await self._tokenized(request)
        self._check_tokens(request)
        reasoning = self._reasoning(request)
        if reasoning is not None and request.sampling.constraint is not None:
            # The tail constrains the answer after the reply's think block (issue #27): it is told where the reply
            # starts, as the gateway is, in the request every later hop (and a replacement for one) is opened with.
            request = request.model_copy(update={"sampling": request.sampling.model_copy(
                update={"reasoning": reasoning})})
        session_token = grant.session_token if grant else None
        # The head opens the hops after it now, while it opens its own backend session and prefills (issue #20).
        opening = RouteOpening(self.client, request, session_token) if request.downstream else None
        try:
            await self.engine.call(lambda: self.backend.open_session(
                request.session_id, prompt_tokens=request.prompt_tokens, sampling=request.sampling))
        except BaseException:
            if opening is not None:
                await opening.cancel()
            raise
        try:
            session = await self._session(rt, request, session_token, opening)
        except BaseException:
            await self.engine.close_session(request.session_id)
            if opening is not None:
                await opening.cancel()
            raise
        if session.reused:
            self.metrics.prefix_reused.inc(session.reused)
        self.admission.record(grant)
        self.sessions[request.session_id] = session
        self.opened_total += 1
        self.admission.settled.opened(request.session_id)
        self.metrics.session_opened(request.hop_index, len(request.route.hops))
        session.start()
        if isinstance(session, HeadSession):
            await session.route_opened()  # its first frame waits for the later hops' answers, and so does this
        return SessionOpened(session_id=request.session_id, node_id=self.node_id,
                             prompt_tokens=len(request.prompt_tokens), reused=session.reused,
                             max_tokens=request.max_tokens if request.fit_max_tokens else None,
                             reasoning=reasoning)

    def _reasoning(self, request: SessionOpen) -> ReasoningStart | None:
        """The head tells the gateway where the reply starts relative to a think block (issue #27), read from the
        prompt's last tokens: the gateway only sees the reply. A backend without a template says nothing."""
        start = getattr(self.backend, "reasoning_start", None)
        return start(request.prompt_tokens) if request.hop_index == 0 and start is not None else None

    def _check(self, request: SessionOpen) -> None:
        """This node can hold the session: the route names it with its layers, and it has a sequence per choice."""
        try:
            frames.session_bytes(request.session_id)  # frames carry it as 16 bytes
        except ValueError as exc:
            raise BadRequestError(str(exc), param="session_id") from exc
        if request.session_id in self.sessions:
            raise BadRequestError(f"session {request.session_id} is already open on node {self.node_id}")
        hops = request.route.hops
        if request.hop_index >= len(hops) or hops[request.hop_index].node_id != self.node_id:
            raise BadRequestError(f"hop {request.hop_index} of the route is not node {self.node_id}")
        if hops[request.hop_index].layers != self.backend.layers:
            raise BadRequestError(f"route expects layers {hops[request.hop_index].layers} from node "
                                  f"{self.node_id}, which serves {self.backend.layers}")
        if request.n > self.backend.max_sessions:
            raise BadRequestError(f"n={request.n} choices need as many sequences; node {self.node_id} holds "
                                  f"{self.backend.max_sessions}", param="n")
        if request.n > 1 and not isinstance(self.backend, ForkingBackend):
            raise BadRequestError(f"node {self.node_id}'s backend cannot fork a session into choices", param="n")
        if self.sequences_in_use() + request.n > self.backend.max_sessions:
            # Every choice forks into a sequence of its own after prefill: all of them are reserved now.
            raise CapacityError(f"node {self.node_id} is full ({self.backend.max_sessions} sequences, "
                                f"{self.sequences_in_use()} in use; this session needs {request.n})",
                                retry_after=1.0)

    def _check_tokens(self, request: SessionOpen) -> None:
        n_ctx = min(self.backend.info.context_length, CONTEXT_CAP)
        if len(request.prompt_tokens) + request.max_tokens > n_ctx:
            raise ContextLengthError(f"prompt ({len(request.prompt_tokens)} tokens) + max_tokens "
                                     f"({request.max_tokens}) exceed the context of {n_ctx} tokens")
        n_vocab = self.backend.info.n_vocab
        if request.hop_index == 0 and n_vocab and any(not 0 <= t < n_vocab for t in request.prompt_tokens):
            raise BadRequestError(f"prompt token ids must lie in [0, {n_vocab}) for this model", param="prompt")

    async def _tokenized(self, request: SessionOpen) -> SessionOpen:
        """A head's open with a prompt instead of tokens (issue #20): tokenized here, checked against the route's
        context as the gateway checks it, the generation budget settled."""
        assert request.prompt is not None
        if not self.backend.is_head:
            raise BadRequestError(f"node {self.node_id} is not a head: it has no tokenizer input")
        tokens = await self.engine.call(self.backend.tokenize, request.prompt)
        budget = session_budget(len(tokens), None if request.fit_max_tokens else request.max_tokens,
                                default=request.max_tokens,
                                context=min(request.route.context_length, CONTEXT_CAP))
        return request.model_copy(update={"prompt_tokens": tokens, "max_tokens": budget, "prompt": None})

    async def _session(self, rt: NodeRuntime, request: SessionOpen, session_token: str | None,
                       opening: RouteOpening | None) -> NodeSession:
        """The role, on a backend session that holds what it starts from: a lost hop's rebuilt KV, or a prefix."""
        reused = 0
        if request.resume is not None:
            await self._rebuild(request, request.resume, session_token)
        else:  # n > 1 too: choice 0 starts from the prefix, and the forks copy it with the prompt (issue #26)
            # A batch-invariant session computes what it does not reuse in a cold run's chunks and cells, bit for
            # bit: whole chunks from host pieces, never a parked sequence or pulled pieces (issue #26 against #31).
            invariant = request.sampling.batch_invariant
            source = request.route.hops[request.hop_index].prefix_source if self.pull is not None else None
            if source is not None and not invariant:
                reused = await self._pulled(request, source, opening)
            else:
                limit = request.reuse_limit
                if opening is not None and self.reuse.reusable(request.prompt_tokens, request.prefill_chunk,
                                                               invariant=invariant):
                    # Prefix reuse: the head reuses no more than every hop after it holds (issue #18).
                    limit = min(o.reused for o in await opening.result())
                rejected = self.reuse.rejected
                reused = await self.reuse.start(request.session_id, request.prompt_tokens, request.prefill_chunk,
                                                limit, invariant=invariant)
                self.metrics.prefix_rejected.inc(self.reuse.rejected - rejected)
        start = SessionStart(session_token=session_token, reused=reused, opening=opening)
        session: NodeSession
        if request.hop_index == 0:
            session = HeadSession(rt, request, hidden_shape=self.hidden_shape, on_closed=self.on_closed, start=start)
        else:
            session = HopSession(rt, request, hidden_shape=self.hidden_shape, on_closed=self.on_closed, start=start)
        if request.resume is not None and session.is_tail:  # a lost tail's replacement, or a 1-node route's head
            await session.restart_generation(request.resume.generated)
        return session

    async def _pulled(self, request: SessionOpen, source: StandbyRef, opening: RouteOpening | None) -> int:
        """What the session starts from when its hop has a prefix source (issue #26): what this node kept, then
        what the source holds beyond, pulled if cheaper than computing it. A head pulls while the later hops open
        (and pull) and then keeps no more than the least of them holds."""
        assert self.pull is not None
        tokens, chunk, sid = request.prompt_tokens, request.prefill_chunk, request.session_id
        limit = None if opening is not None else request.reuse_limit
        rejected, pulled, dropped = self.reuse.rejected, self.pull.pulled_positions, self.pull.rejected
        reused = await self.reuse.start(sid, tokens, chunk, limit)
        reused = await self.pull.pull(sid, tokens, reused, limit, chunk, source)
        if opening is not None:
            reused = await self.reuse.cut(sid, reused, min([reused, *(o.reused for o in await opening.result())]))
        self.metrics.prefix_rejected.inc(self.reuse.rejected - rejected + self.pull.rejected - dropped)
        self.metrics.prefix_pulled.inc(self.pull.pulled_positions - pulled)
        return reused

    async def _rebuild(self, request: SessionOpen, resume: Resume, session_token: str | None) -> None:
        """A replacement for a lost hop (issue #18): import the lost hop's snapshot chain from its standby (every
        segment checked against its digest and linked to the one before). Its session then starts at
        ``resume.start`` with the tokens generated so far (a tail starts its sampler and stop rules over from
        them); the journal replay that follows brings the KV up to the route's position. A replacement head (issue
        #31) recomputes what lies beyond the chain from the tokens itself (``actors.node.recovery.takeover``)."""
        if resume.segments:
            kv = await fetch_chain(self.client, resume, request.session_id, self.backend.layers, self.model_id,
                                   session_token=session_token)
            backend = self.backend
            if not isinstance(backend, KvBackend):
                raise BadRequestError(f"node {self.node_id}'s backend cannot import KV")
            await self.engine.call(backend.import_kv, request.session_id, kv, resume.start)

