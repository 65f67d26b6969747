"""The head's prefill: its layers run on the prompt in chunks (from where prefix reuse left off), each chunk's
frame sent on as it is computed; the last one asks the tail to sample (n > 1: it forks the prompt's KV into every
choice first). The first chunk starts computing before the head knows that the hops after it opened (issue #20):
nothing leaves, and nothing is published, until they have. It drives the head through its port
(``actors.node.head_port.HeadPort``), as the decode strategies that follow it do.
"""

from __future__ import annotations

from actors.backend import StepInput
from actors.node.head_port import HeadPort
from schemas.frame import FrameKind, SampledToken
from schemas.session import SessionPhase


async def prefill(head: HeadPort) -> list[SampledToken] | None:
    """Prefill the prompt; None if the hops after the head could not be opened. With head and tail on one node:
    the first token of every choice, sampled here (else the tail posts them)."""
    tokens = head.request.prompt_tokens
    chunk = head.request.prefill_chunk
    announced = False
    sampled: list[SampledToken] = []
    # After a reused prefix the first chunk ends where a cold prefill's does: the chunks after it then compute
    # exactly what a cold run's compute (issue #26).
    starts = [head.position, *range((head.position // chunk + 1) * chunk, len(tokens), chunk)]
    for start, stop in zip(starts, [*starts[1:], len(tokens)], strict=True):
        if start >= len(tokens):
            break
        part = tokens[start:stop]
        last = start + len(part) >= len(tokens)
        first = head.choices.first
        # n > 1: the last chunk forks the prompt's KV into every choice (on the tail: their first tokens too).
        item = StepInput(head.id, start, tokens=part, sample=last and head.is_tail,
                         forks=head.choices.fork_ids() if last else ())
        queued = head.rt.engine.enqueue(item, handoff=True)
        if not announced:
            announced = True
            if not await head.route_ready():
                queued.cancel()
                return None
            await head.telemetry.set_phase(SessionPhase.PREFILL)
            if head.reused:  # prefix reuse: every hop holds the first ``reused`` positions already
                await head.telemetry.prefill_progress(head.reused, len(tokens), reused=head.reused)
        out, timing = await head.compute(first, item, queued)
        forks = head.fork(first.position) if item.forks else []
        head.touch()
        head.rt.metrics.prefill_positions.inc(len(part))
        if head.is_tail:
            if last:
                stamps = (head.stamp(timing),)
                sampled.append(head.sampled(first, out, stamps))
                for fork, fork_out in zip(forks, out.forks, strict=True):
                    sampled.append(head.sampled(fork, fork_out, stamps))
        else:
            assert out.hidden is not None
            head.queue_frame(FrameKind.PREFILL, start, out.hidden, last, 0, (head.stamp(timing),))
        await head.telemetry.prefill_progress(start + len(part), len(tokens))
    return sampled
