"""Head and tail on one node: the engine chains the steps on its worker (each sampled token is the next input,
``StepEngine.chain``), so the loop only turns outputs into token events and announces them; it stops the chain when
the generation ends. The chain stops by itself where the generation ends for certain (``Generation.ends_for_certain``);
stop strings are the loop's to find (the stop rules stay ``Generation``'s).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from actors.backend import StepInput, StepOutput
from actors.node.engine import StepChain, StepTiming
from actors.node.head_port import HeadPort
from schemas.errors import SwarmrouteError
from schemas.session import SessionPhase


class LocalChain:
    def __init__(self) -> None:
        self._chain: StepChain | None = None
        self._port: HeadPort | None = None

    def stop(self) -> None:
        if self._chain is not None:
            self._chain.stop()

    async def run(self, port: HeadPort) -> None:
        self._port = port
        event = await port.next_event()  # the prefill's token
        first = port.choices.first
        last = time.perf_counter()
        wall_ms: float | None = None
        while True:
            port.phase = SessionPhase.DECODE
            if event.finish_reason is None and self._chain is None:
                self._chain = port.rt.engine.chain(self._step(port, event.token), self._follow)
            await port.announce(event, wall_ms)
            if event.finish_reason is not None:
                if self._chain is not None:
                    self._chain.stop()  # a stop string ended it: the step already queued is dropped
                first.end(event.finish_reason, event.seq + 1)
                await port.complete(event)
                return
            out, timing = await self._next(port, event.token)
            now = time.perf_counter()
            wall_ms, last = (now - last) * 1e3, now
            event = port.event_of(port.sampled(first, out, (port.stamp(timing),)))

    def _follow(self, item: StepInput, out: StepOutput) -> StepInput | None:
        """On the engine's thread: the next chained step, unless this output ends the generation for certain
        (``Generation.ends_for_certain``). Stop strings are the loop's to find; it then stops the chain."""
        token = out.token
        if token is None:
            return None
        port = self._port
        assert port is not None
        generation = port.choices.first.generation
        assert generation is not None
        prompt = len(port.request.prompt_tokens)
        if generation.ends_for_certain(token, item.start_position + 2 - prompt, position=item.start_position + 2):
            return None
        return StepInput(port.id, item.start_position + 1, tokens=[token], sample=True, top_k=_top_k(port))

    @staticmethod
    def _step(port: HeadPort, token: int) -> StepInput:
        step = port.choices.first.decode_step(token, sample=True)
        return dataclasses.replace(step, top_k=_top_k(port))

    async def _next(self, port: HeadPort, token: int) -> tuple[StepOutput, StepTiming]:
        first = port.choices.first
        while True:
            if self._chain is None:
                self._chain = port.rt.engine.chain(self._step(port, token), self._follow)
            timeout = port.token_timeout()
            try:
                async with asyncio.timeout(timeout):  # no task per token, unlike wait_for
                    result = await self._chain.next()
            except TimeoutError:
                raise port.failed_here("timeout", f"no token from node {port.rt.node_id} for {timeout:g}s") from None
            except SwarmrouteError:
                raise
            except Exception as exc:
                raise port.backend_failed(exc) from exc
            if result is not None:
                out, timing = result
                start = first.position
                port.advance(first, StepInput(port.id, start, tokens=[token]), timing)
                if port.spot is not None:
                    port.spot.answered(start, True, out.top, out.token)
                return out, timing
            # The chain ended although the generation goes on (its rules differ from ``Generation``'s): restart it.
            self._chain = None


def _top_k(port: HeadPort) -> int:
    """A sampled session's receipt keeps each step's largest logits (issue #28)."""
    return port.spot.top_k_for(True) if port.spot is not None else 0
