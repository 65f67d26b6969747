"""A replacement head taking a session over after its head was lost (issue #31).

The gateway finds the head gone (``gateway.live_session``), a tracker names a node serving the head's layers, and
the gateway opens the session there with what only the old head held (the request, the tokens the client has, the
telemetry seq), plus the head's snapshot chain from its standby (``SessionOpen.resume``, imported by the opener up to
``resume.start``). The later hops still hold their KV and the tail its sampler. This module then, through the head's
port (``actors.node.head_port.HeadPort``):

1. *cut*: asks every later hop where its KV ends; ``cut`` is the least of those and ``resume.target`` (the position
   whose frame the tail samples the client's next token from, or the start of the last prefill chunk when no token
   came yet). Every later hop goes on to the new route at the next epoch, its KV cut back to ``cut``; the tail
   starts its stop rules and sampler (random state included) over from the tokens the client has and samples
   again from ``cut`` on;
2. *rebuild*: the head's own input is token ids, so it needs no journal: it recomputes what lies between the
   imported chain and ``cut`` from the tokens, in the shapes the lost head computed them (prefill chunks on their
   boundaries, decode positions one at a time), without sending a frame (every later hop holds those positions);
3. *resume*: the prefill goes on from there (``actors.node.prefill``, frames below ``cut`` stay home), or, in
   decode, the step that feeds the client's last token is computed and its frame sent: the tail samples the next
   token, and the stream goes on with no token duplicated or missing.

On a 1-node route the replacement is its own tail: there is nothing to cut or re-bind, its opener started the stop
rules and the sampler over from the client's tokens (``NodeSession.restart_generation``, the random state replayed
with them), its prefill samples no token the client has, and it samples the client's next token itself from the
step that feeds the last one.
"""

from __future__ import annotations

import logging
import time

from actors.node.head_port import HeadPort
from bus import capability
from schemas.errors import SwarmrouteError
from schemas.route import RouteUpdate
from schemas.session import RouteChanged, SessionPhase, TokenEvent
from schemas.telemetry import RepairView

log = logging.getLogger(__name__)


class TakeoverFailed(Exception):
    """Why the replacement head could not re-bind the route; the session then fails with this message."""


class HeadTakeover:
    def __init__(self, head: HeadPort) -> None:
        assert head.request.resume is not None
        self.head = head
        self.resume = head.request.resume
        self.started = time.monotonic()

    async def rebind(self) -> int:
        """Steps 1 (cut the later hops back, re-bind them to this head); returns ``cut``."""
        head = self.head
        hops = head.route.hops[1:]
        positions = [await self._ask(h.node_id, head.rt.client.session_position(
            h.node_id, h.endpoint, head.id, session_token=head.session_token)) for h in hops]
        cut = min([*positions, self.resume.target])
        generated = self.resume.generated[:max(0, cut - len(head.request.prompt_tokens) + 1)]
        last = len(head.route.hops) - 1
        for i, hop in enumerate(head.route.hops[1:], start=1):
            tail = {"generated": generated, "quiet_below": cut} if i == last else {}
            update = RouteUpdate(session_id=head.id, epoch=head.recovery.epoch,
                                 route=capability.strip(head.route, keep_standby=i), hop_index=i,
                                 capability=hop.capability, truncate_to=cut, **tail)  # type: ignore[arg-type]
            await self._ask(hop.node_id, head.rt.client.update_route(
                hop.node_id, hop.endpoint, update, session_token=head.session_token,
                timeout=head.rt.settings.hop_timeout_s))
        head.recovery.quiet_below = cut  # nothing below it leaves: every later hop holds it
        await head.rt.publish(head.rt.subjects.tokens(head.id), RouteChanged(
            session_id=head.id, epoch=head.recovery.epoch, route=capability.strip(head.route)))
        return cut

    async def catch_up(self, cut: int) -> None:
        """Step 3 in decode (after the prefill, which rebuilt and sent what the prompt needed): recompute the decode
        positions between the KV and ``cut`` one at a time, then send the frame of the client's last token."""
        head = self.head
        prompt = len(head.request.prompt_tokens)
        choice = head.choices.first
        generated = self.resume.generated
        while choice.position < prompt + len(generated):
            j = choice.position - prompt
            if head.is_tail:  # a 1-node route: this node samples the client's next token from the last feed
                last = j == len(generated) - 1
                out, timing = await head.compute(choice, choice.decode_step(generated[j], sample=last))
                if last:
                    head.put_events([head.sampled(choice, out, (head.stamp(timing),))])
                continue
            event = TokenEvent(session_id=head.id, seq=j, token=generated[j], text="")
            result = await head.compute(choice, choice.decode_step(generated[j]))
            if choice.position - 1 >= cut:
                head.forward(choice, result, event)  # the step the tail samples the client's next token from
        if generated:
            head.phase = SessionPhase.DECODE
        view = RepairView(lost_node=self.resume.lost_node, layers=head.route.hops[0].layers,
                          replacement=[head.rt.node_id], source="snapshot" if self.resume.segments else "journal",
                          snapshot_positions=self.resume.start, replayed_positions=choice.position - self.resume.start,
                          duration_ms=round((time.monotonic() - self.started) * 1e3, 3), repairs=head.recovery.epoch)
        await head.telemetry.repaired(head.route, view, head.phase)
        log.info("session %s taken over by %s: %d positions imported, %d recomputed, the tail samples from %d",
                 head.id[:8], head.rt.node_id, self.resume.start, choice.position - self.resume.start, cut)

    @staticmethod
    async def _ask(node: str, call: object) -> int:
        try:
            answer = await call  # type: ignore[misc]
        except SwarmrouteError as exc:
            raise TakeoverFailed(f"node {node} failed while the head was replaced: {exc.message}") from None
        return answer if isinstance(answer, int) else int(answer.position)
