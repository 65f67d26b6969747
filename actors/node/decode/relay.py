"""Plain decoding on a route of several hops (n = 1, no speculation): one decode step per token the tail posts.

The step a token feeds is usually queued, or already run inline and its frame sent, by ``HeadSession.on_token``
the moment the token arrived (``Choice.prefetched``); the loop here picks it up, announces the token while that step
runs, and forwards its frame once it has. It only computes a step itself when ``on_token`` could not.
"""

from __future__ import annotations

import asyncio
import time

from actors.node.choices import Choice
from actors.node.head_port import HeadPort
from actors.node.session import StepFuture
from schemas.session import SessionPhase, TokenEvent


class Relay:
    def stop(self) -> None:
        """Nothing of its own runs: the steps ``on_token`` queued are the head's to cancel."""

    async def run(self, port: HeadPort) -> None:
        choice = port.choices.first
        while True:
            event = await port.next_event()
            # Timed from the token's arrival: on_token may already have run the next step inline since.
            now = choice.arrivals.pop(event.seq, None) or time.perf_counter()
            wall_ms = (now - choice.step_started) * 1e3 if choice.step_started is not None else None
            port.phase = SessionPhase.DECODE
            if event.finish_reason is not None:
                await port.announce(event, wall_ms)
                choice.end(event.finish_reason, event.seq + 1)
                await port.complete(event)
                return
            queued, forwarded = take_prefetched(choice, event)
            choice.step_started = now  # the next step started (or was queued) as this token arrived
            if forwarded:
                await port.announce(event, wall_ms)
                continue
            if queued is not None and queued.done():
                # It ran inline but was not forwarded (it failed, or was cancelled): compute raises that first.
                port.forward(choice, await port.compute(choice, choice.decode_step(event.token), queued), event)
                await port.announce(event, wall_ms)
                continue
            # Start the next forward pass first (on_token has usually queued it already): publishing the token and
            # telemetry then overlaps it instead of delaying it.
            step = asyncio.ensure_future(port.compute(choice, choice.decode_step(event.token), queued))
            try:
                await port.announce(event, wall_ms)
            except BaseException:
                step.cancel()
                raise
            port.forward(choice, await step, event)


def take_prefetched(choice: Choice, event: TokenEvent) -> tuple[StepFuture | None, bool]:
    """The step ``on_token`` queued for this token and whether it is forwarded; (None, False) if none."""
    prefetched, choice.prefetched = choice.prefetched, None
    if prefetched is None:
        return None, False
    seq, future, forwarded = prefetched
    if seq != event.seq:
        future.cancel()
        return None, False
    return future, forwarded
