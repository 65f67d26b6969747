"""n > 1, in rounds: once every live choice's token is in, their steps are queued together and their frames name
the round's size, so on every hop one forward pass carries the same choices in the same order (a seeded request
comes out the same every time although a batch's shape moves llama.cpp's results). With head and tail on one node
the round's tokens are sampled here, and the next round starts from them.
"""

from __future__ import annotations

import asyncio
import time

from actors.node.choices import Choice
from actors.node.head_port import HeadPort
from schemas.session import SessionPhase, TokenEvent


class Rounds:
    def __init__(self, *, local: bool) -> None:
        self.local = local
        """Head and tail on one node: the steps sample, and no frame leaves."""

    def stop(self) -> None:
        """Nothing of its own runs: its steps are awaited by its task."""

    async def run(self, port: HeadPort) -> None:
        pending: dict[int, TokenEvent] = {}
        last = time.perf_counter()
        wall_ms: float | None = None
        while True:
            live = [c for c in port.choices.all if not c.ended]
            while len(pending) < len(live):
                event = await port.next_event()
                pending[event.index] = event
            port.phase = SessionPhase.DECODE
            going: list[tuple[Choice, TokenEvent]] = []
            for choice in live:
                event = pending.pop(choice.index)
                await port.announce(event, wall_ms)
                if event.finish_reason is not None:
                    choice.end(event.finish_reason, event.seq + 1)
                else:
                    going.append((choice, event))
            if not going:
                await port.complete(event)
                return
            items = [choice.decode_step(event.token, sample=self.local) for choice, event in going]
            steps = port.rt.engine.enqueue_group(items)
            timeout = port.token_timeout()
            try:
                async with asyncio.timeout(timeout):
                    results = [await port.compute(c, i, f) for (c, _), i, f in zip(going, items, steps, strict=True)]
            except TimeoutError:
                raise port.failed_here("timeout", f"no step on node {port.rt.node_id} for {timeout:g}s") from None
            now = time.perf_counter()
            wall_ms, last = (now - last) * 1e3, now
            for (choice, event), (out, timing) in zip(going, results, strict=True):
                if self.local:  # head and tail on this node: the next round's tokens are here already
                    pending[choice.index] = port.event_of(port.sampled(choice, out, (port.stamp(timing),)))
                else:
                    port.forward(choice, (out, timing), event, len(going))
