"""A head repairing its route after losing a hop (issue #18): the session goes on with the same tokens.

The head owns the session's fate, so it drives the repair (through its port, ``actors.node.head_port.HeadPort``),
step by step:

1. *quiesce*: its own step under way is settled (a step whose frame never left is undone); the tokens the tail
   sent before the loss stay valid. ``H`` is where the head's KV ends; the frame of position ``sample_from`` (the
   last one sent, when its token never came back) must be sampled again, every earlier one is known;
2. *replace*: the trackers name a node serving exactly the lost layers (it may take a while to appear: a
   supervisor restarting the lost node), with the session's own token in its capabilities;
3. *hold*: every upstream hop goes on to the repaired route (the hop before the replacement gets it as its
   successor) once its steps under way ran, and says where it stands and how far back its journal goes;
4. *cut*: every downstream hop is cut back to ``D``, the least any of them holds and at most ``sample_from``; the
   tail starts its sampler and stop rules over from the tokens the head has;
5. *rebuild*: the replacement imports the lost hop's snapshot chain up to a boundary ``P <= D`` the upstream
   journal reaches back to, and the upstream hop replays its journal from ``P``: the replacement computes every
   frame as originally computed, keeps what lies below ``D`` (its successor has it) and forwards the rest, and the
   tail samples the missing token.

Where no snapshot is usable the journal replays from position 0 (a loss during prefill, or before the first
snapshot). Nothing else is tried: a second loss, no replacement in time, a journal that does not reach back, or a
snapshot that fails its hash fails the session with the reason, as alpha did.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

from actors.backend import KvBackend
from actors.node.head_port import HeadPort
from actors.node.session import settled
from bus import capability
from schemas.errors import HopError, SnapshotError, SwarmrouteError
from schemas.frame import SampledToken
from schemas.route import HopPosition, RepairRequest, ReplayRequest, Route, RouteUpdate
from schemas.session import (
    MAX_EPOCH,
    FailureReason,
    Resume,
    RouteChanged,
    SessionOpen,
    SessionPhase,
    TokenEvent,
)
from schemas.snapshot import SnapshotSegment
from schemas.telemetry import RepairSource, RepairView

T = TypeVar("T")
log = logging.getLogger(__name__)
REPLACEMENT_POLL_S = 0.5
"""How often a head asks the trackers again while no node can take the lost layers over."""


class RepairFailed(Exception):
    """Why a repair was impossible; the session then fails with this message."""


class RouteRepair:
    """One repair of ``head``'s route around hop ``lost``; ``repairs``: the session's repairs before this one,
    ``lost_nodes``: the nodes it lost before (never routed to again)."""

    def __init__(self, head: HeadPort, lost: int, reason: FailureReason, *, repairs: int,
                 lost_nodes: list[str]) -> None:
        self.head = head
        self.rt = head.rt
        self.lost = lost
        self.reason = reason
        self.old = head.route
        self.lost_nodes = lost_nodes
        self.view = RepairView(lost_node=self.old.hops[lost].node_id, layers=self.old.hops[lost].layers,
                               repairs=repairs + 1)
        self.deadline = time.monotonic() + self.rt.settings.repair_timeout_s

    async def run(self) -> RepairView:
        started = time.monotonic()
        head = self.head
        if head.recovery.epoch >= MAX_EPOCH:
            raise RepairFailed(f"the session was repaired {MAX_EPOCH} times already")
        await head.telemetry.repairing(self.view)
        state = await self._quiesce()
        route = await self._replacement()
        epoch = head.recovery.epoch + 1
        self.view.replacement = [route.hops[self.lost].node_id]
        await head.telemetry.repairing(self.view)
        journal_start = await self._hold_upstream(route, epoch, state.position)
        cut = min([*(await self._downstream_positions()), state.sample_from])
        segments = await self._usable_snapshots(cut, journal_start)
        start = segments[-1].end if segments else 0
        await self._cut_downstream(route, epoch, cut, state.generated, state.sample_from)
        await self._open_replacement(route, epoch, segments, cut, state)
        head.recovery.epoch = epoch  # tokens of older epochs are dropped from now on
        head.retarget(route, 0)  # the head sends to its (maybe new) successor
        replayed = await self._replay(route, epoch, start)
        source: RepairSource = "snapshot" if segments else "journal"
        self.view = self.view.model_copy(update={"source": source, "snapshot_positions": start,
                                                 "replayed_positions": replayed,
                                                 "duration_ms": round((time.monotonic() - started) * 1e3, 3)})
        await self.rt.publish(self.rt.subjects.tokens(head.id),
                              RouteChanged(session_id=head.id, epoch=epoch, route=capability.strip(route)))
        log.info("session %s repaired: lost %s, %s took layers %s over (%s, %d positions imported, %d replayed)",
                 head.id[:8], self.view.lost_node, self.view.replacement[0], self.view.layers, source, start,
                 replayed)
        return self.view

    # ---- the steps ---------------------------------------------------------------------------------------------

    async def _quiesce(self) -> Quiesced:
        """Settle the head's steps under way and gather the tail's tokens that came before the loss: a step queued
        for a token but not yet sent on is undone (its token is fed again after the repair)."""
        head = self.head
        choice = head.choices.first
        kept = [e for e in head.take_events() if isinstance(e, TokenEvent | SampledToken)]
        if choice.prefetched is not None:
            _, step, forwarded = choice.prefetched
            if not forwarded:
                step.cancel()
                await settled(step)
                choice.prefetched = None
                backend = self.rt.engine.backend
                if not isinstance(backend, KvBackend):
                    raise RepairFailed(f"node {self.rt.node_id}'s {backend.info.kind} backend cannot cut its KV")
                await self.rt.engine.call(backend.truncate, head.id, choice.position)
        fed = head.fed()
        generated = fed + [e.token for e in kept if e.seq >= len(fed)][:1]
        head.put_events(kept)
        prompt = len(head.request.prompt_tokens)
        if len(generated) > len(fed):
            sample_from = head.position  # the last token sent is in: nothing to sample again
        elif fed:
            sample_from = head.position - 1
        else:
            sample_from = (prompt - 1) // head.request.prefill_chunk * head.request.prefill_chunk
        return Quiesced(head.position, generated, sample_from)

    async def _replacement(self) -> Route:
        """Ask the trackers until one names a node for the lost layers (or the repair's time is up)."""
        head = self.head
        excluded = [self.view.lost_node, *self.lost_nodes]
        while True:
            reply = await self.rt.ask_repair(RepairRequest(route=capability.strip(self.old), lost=self.lost,
                                                           exclude=excluded, session_token=head.session_token))
            if reply.route is not None:
                return reply.route
            if reply.status != 503 or time.monotonic() + REPLACEMENT_POLL_S > self.deadline:
                raise RepairFailed(f"no replacement for layers {self.view.layers}: {reply.error}")
            await asyncio.sleep(REPLACEMENT_POLL_S)
            await head.telemetry.repairing(self.view)

    def _update(self, route: Route, epoch: int, index: int, **kw: object) -> RouteUpdate:
        return RouteUpdate(session_id=self.head.id, epoch=epoch, route=capability.strip(route, keep_standby=index),
                           hop_index=index, capability=route.hops[index].capability, **kw)  # type: ignore[arg-type]

    async def _hold_upstream(self, route: Route, epoch: int, position: int) -> int:
        """Every hop between the head and the replacement goes on to the new route once it has computed all the
        head sent (``position``); returns how far back the journal of the hop just before the replacement goes."""
        head = self.head
        if self.lost == 1:
            journal = head.recovery.journal
            if journal is None:
                raise RepairFailed("the head keeps no journal (the session was opened without repair)")
            return journal.start
        last: HopPosition | None = None
        for i in range(1, self.lost):
            hop = route.hops[i]
            # Computed all the head sent before it goes on to the new route: a frame it computed after would go to
            # the replacement before the replacement has the session (a 404 that fails the session; seen when the
            # head's prefill ran ahead of it).
            while await self._ask(hop.node_id, self.rt.client.session_position(
                    hop.node_id, hop.endpoint, head.id, session_token=head.session_token)) < position:
                if time.monotonic() > self.deadline:
                    raise RepairFailed(f"node {hop.node_id} never got to position {position}")
                await asyncio.sleep(0.05)
            while True:
                # Cut back to the head's KV too: a speculative session's hops may hold positions of verify windows
                # the head dropped (issue #31); on a plain session nothing lies beyond it.
                last = await self._ask(hop.node_id, self.rt.client.update_route(
                    hop.node_id, hop.endpoint, self._update(route, epoch, i, truncate_to=position),
                    session_token=head.session_token, timeout=self.rt.settings.hop_timeout_s))
                if last.position >= position:
                    break
                if time.monotonic() > self.deadline:
                    raise RepairFailed(f"node {hop.node_id} never got to position {position}")
                await asyncio.sleep(0.05)
        assert last is not None
        if last.journal_start is None:
            raise RepairFailed(f"node {last.node_id} keeps no journal to rebuild {self.view.lost_node}'s KV from")
        return last.journal_start

    async def _downstream_positions(self) -> list[int]:
        head = self.head
        return [await self._ask(h.node_id, self.rt.client.session_position(
            h.node_id, h.endpoint, head.id, session_token=head.session_token)) for h in self.old.hops[self.lost + 1:]]

    async def _usable_snapshots(self, cut: int, journal_start: int) -> list[SnapshotSegment]:
        """The longest prefix of the lost hop's snapshot chain that ends at or before ``cut`` (its successor's
        positions) and where the upstream journal reaches back to; empty when the journal replays from 0."""
        standby = self.old.hops[self.lost].standby
        usable: list[SnapshotSegment] = []
        # An evicted node's snapshots hold the KV it computed wrong: rebuild from the journal instead (issue #28).
        if standby is not None and standby.node_id != self.view.lost_node and not self.reason.evicted:
            try:
                listing = await self.rt.client.list_snapshots(standby.node_id, standby.endpoint, self.head.id,
                                                              self.view.layers, session_token=self.head.session_token)
                for segment in listing.segments:
                    if segment.end > cut:
                        break
                    usable.append(segment)
            except HopError as exc:
                log.warning("session %s: standby %s lists no snapshots: %s", self.head.id[:8], standby.node_id, exc)
        while usable and usable[-1].end < journal_start:
            usable.clear()  # the journal starts after the chain ends: no way to bridge the gap
        if not usable and journal_start > 0:
            raise RepairFailed(f"no snapshot of {self.view.lost_node}'s layers {self.view.layers} at or after "
                               f"position {journal_start}, where the journal of the hop before it begins")
        return usable

    async def _cut_downstream(self, route: Route, epoch: int, cut: int, generated: list[int],
                              sample_from: int) -> None:
        head = self.head
        last = len(route.hops) - 1
        for i in range(self.lost + 1, len(route.hops)):
            hop = route.hops[i]
            tail = {"generated": generated, "quiet_below": sample_from} if i == last else {}
            await self._ask(hop.node_id, self.rt.client.update_route(
                hop.node_id, hop.endpoint, self._update(route, epoch, i, truncate_to=cut, **tail),
                session_token=head.session_token, timeout=self.rt.settings.hop_timeout_s))

    async def _open_replacement(self, route: Route, epoch: int, segments: list[SnapshotSegment], cut: int,
                                state: Quiesced) -> None:
        head = self.head
        hop = route.hops[self.lost]
        is_tail = self.lost == len(route.hops) - 1
        request = head.request
        resume = Resume(standby=self.old.hops[self.lost].standby if segments else None,
                        segments=[s.digest for s in segments], start=segments[-1].end if segments else 0,
                        quiet_below=state.sample_from if is_tail else cut, target=state.position,
                        generated=state.generated)
        open_request = SessionOpen(
            session_id=head.id, route=capability.strip(route, keep_standby=self.lost), hop_index=self.lost,
            prompt_tokens=request.prompt_tokens, max_tokens=request.max_tokens, sampling=request.sampling,
            stop=request.stop, ignore_eos=request.ignore_eos, prefill_chunk=request.prefill_chunk,
            capability=hop.capability, snapshot_every=request.snapshot_every, repair=True, epoch=epoch,
            resume=resume)
        if request.speculate is not None:  # a speculative session's windows go on through the replacement
            open_request.speculate = request.speculate
        try:
            await self.rt.client.open_session(hop.node_id, hop.endpoint, open_request)
        except HopError as exc:
            if isinstance(exc.peer_error, SnapshotError):
                raise RepairFailed(f"the snapshot of {self.view.lost_node}'s layers was refused: "
                                   f"{exc.peer_error.message}") from None
            raise RepairFailed(f"the replacement {hop.node_id} could not open the session: {exc.message}") from None

    async def _replay(self, route: Route, epoch: int, start: int) -> int:
        head = self.head
        request = ReplayRequest(epoch=epoch, start=start)
        if self.lost == 1:
            return head.replay(request)
        hop = route.hops[self.lost - 1]
        try:
            await self.rt.client.replay(hop.node_id, hop.endpoint, head.id, request, session_token=head.session_token)
        except HopError as exc:
            raise RepairFailed(f"node {hop.node_id} could not replay its journal: {exc.message}") from None
        return head.position - start

    @staticmethod
    async def _ask(node: str, call: Awaitable[T]) -> T:
        """One request to a hop of the route; a hop failing here is a second loss."""
        try:
            return await call
        except SwarmrouteError as exc:
            raise RepairFailed(f"node {node} failed during the repair: {exc.message}") from None


class Quiesced:
    """Where the head stands once its steps under way are settled (``RouteRepair._quiesce``)."""

    def __init__(self, position: int, generated: list[int], sample_from: int) -> None:
        self.position = position
        """Where the head's KV ends: what the replacement must hold once the journal has been replayed."""
        self.generated = generated
        """Every token the tail sent before the loss, announced or about to be."""
        self.sample_from = sample_from
        """The first position whose frame the tail must sample again (its token never came); ``position`` when
        every frame sent has its token."""


def replaceable(request: SessionOpen, route: Route, reason: FailureReason, *, repairs: int, limit: int) -> int | None:
    """The index of the hop ``reason`` names if the session repairs and that hop may be replaced (never the head);
    None when a repair cannot even be tried. Only a node that is gone or silent is replaced: one that answers with
    an error would answer a replacement's frames the same way (its input, not the node, is the problem)."""
    lost = next((i for i, h in enumerate(route.hops) if h.node_id == reason.node_id), 0)
    if (reason.kind not in ("unreachable", "timeout") or not request.repair or request.n > 1 or lost == 0
            or repairs >= limit):
        return None
    return lost


def phase_after(generated: list[int]) -> SessionPhase:
    return SessionPhase.DECODE if generated else SessionPhase.PREFILL
