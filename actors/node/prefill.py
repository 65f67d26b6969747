"""The head's prefill: its layers run on the prompt in chunks (from where prefix reuse left off; a short prompt on a
route in sub-chunks, so the hops overlap), each chunk's frame sent on as it is computed; the last one asks the tail
to sample (n > 1: it forks the prompt's KV into every choice first). The first chunk starts computing before the
head knows that the hops after it opened (issue #20): nothing leaves, and nothing is published, until they have. It
drives the head through its port (``actors.node.head_port.HeadPort``), as the decode strategies that follow it do.
"""

from __future__ import annotations

from actors.backend import StepInput
from actors.node.head_port import HeadPort
from schemas.frame import FrameKind, SampledToken
from schemas.session import SessionPhase

ROW_GROUP = 4
"""Sub-chunks start a whole number of these rows into the step they split: ggml's CPU matrix kernels multiply rows
in groups of four (CPU_REPACK's gemm; the rest of a batch one by one), so the weights' products of every row are
those of the unsplit step. Some other op still rounds differently (not traced; attention over the fewer cells a
first sub-chunk sees is the likely one): measured, the greedy text of 1 of 4 short prompts differed from llama.cpp's
in one process at a near-tie (2 of 4 with unaligned sub-chunks), so ``prefill_subchunks`` is 1 by default."""
MIN_SUBCHUNK = 4
"""Fewest positions of a sub-chunk: below, a pass costs about as much as for one position more, and the overlap
cannot pay for the extra pass and link."""


def step_starts(first: int, total: int, chunk: int, hops: int, subchunks: int) -> list[int]:
    """Where each prefill step of positions ``[first, total)`` starts. After a reused prefix the first step ends
    where a cold prefill's chunk does, so the chunks after it compute exactly what a cold run's compute (issue #26).
    A route's prompt that is one step (a short prompt, or the rest after a reused prefix) is split into up to
    ``subchunks`` sub-chunks (at most one per hop, ``MIN_SUBCHUNK`` positions or more each) of near-equal size, the
    later ones never smaller: hop ``i`` computes sub-chunk ``k`` while hop ``i + 1`` computes ``k - 1`` (issue #26).
    The tail's output layer runs once, after the last sub-chunk's last row, so it adds the same to every split and
    only the layers are balanced; a longer prompt pipelines its chunks already and is left as it is."""
    starts = [first, *range((first // chunk + 1) * chunk, total, chunk)] if first < total else []
    if len(starts) == 1 and hops > 1:
        k = min(subchunks, hops, (total - first) // MIN_SUBCHUNK)
        if k > 1:
            starts = [first + (total - first) * i // k // ROW_GROUP * ROW_GROUP for i in range(k)]
    return starts


PREFILL_SHARE = 0.25
"""The share of the hop timeout a head's sessions' prefill under way may take a hop to compute (``prefill_gate``):
a frame then waits at most that behind the prefill of others, beside its own step and the pass running."""


async def prefill(head: HeadPort) -> list[SampledToken] | None:
    """Prefill the prompt; None if the hops after the head could not be opened. With head and tail on one node:
    the first token of every choice, sampled here (else the tail posts them)."""
    tokens = head.request.prompt_tokens
    announced = False
    sampled: list[SampledToken] = []
    starts = step_starts(head.position, len(tokens), head.request.prefill_chunk, len(head.route.hops),
                         head.rt.settings.prefill_subchunks)
    first_chunk = min(head.request.prefill_chunk, len(tokens) - head.position)
    if starts and not head.is_tail and not await _admitted(head, first_chunk):
        return None
    # Nothing left to compute (a replacement head whose snapshots hold the whole prompt): no step at all.
    stops = [*starts[1:], len(tokens)] if starts else []
    # A replacement head that is its own tail (issue #31, a 1-node route) samples no first token the client has.
    known = head.request.resume is not None and bool(head.request.resume.generated)
    for start, stop in zip(starts, stops, strict=True):
        part = tokens[start:stop]
        last = start + len(part) >= len(tokens)
        first = head.choices.first
        # n > 1: the last chunk forks the prompt's KV into every choice (on the tail: their first tokens too).
        sample = last and head.is_tail and not known
        item = StepInput(head.id, start, tokens=part, sample=sample, forks=head.choices.fork_ids() if last else (),
                         top_k=head.spot.top_k_for(sample) if head.spot is not None and head.is_tail else 0)
        queued = head.rt.engine.enqueue(item, handoff=True, prefill=True)
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
            if head.spot is not None:
                head.spot.answered(start, item.sample, out.top, out.token)
            if last and item.sample:
                stamps = (head.stamp(timing),)
                sampled.append(head.sampled(first, out, stamps))
                for fork, fork_out in zip(forks, out.forks, strict=True):
                    sampled.append(head.sampled(fork, fork_out, stamps))
        else:
            assert out.hidden is not None
            head.queue_frame(FrameKind.PREFILL, start, out.hidden, last, 0, (head.stamp(timing),))
        await head.telemetry.prefill_progress(start + len(part), len(tokens))
    return sampled


async def _admitted(head: HeadPort, positions: int) -> bool:
    """A burst of sessions prefills a share of the hop timeout's work at a time, not all at once on every hop
    (issue #30, ``actors.node.prefill_gate``). A session that has to wait for earlier prefills lets its route open
    and says it is prefilling meanwhile (its gateway takes a silent session for a lost one); False if the hops
    after the head could not be opened."""
    gate, settings = head.rt.engine.prefills, head.rt.settings
    within = settings.hop_timeout_s * PREFILL_SHARE
    if gate.try_admit(head.id, positions, within):
        return True
    if not await head.route_ready():
        return False
    await head.telemetry.set_phase(SessionPhase.PREFILL)

    async def keepalive() -> None:
        head.touch()  # not idle: the node frees sessions idle for ``session_idle_ttl_s``
        await head.telemetry.set_phase(SessionPhase.PREFILL)

    await gate.admit(head.id, positions, within, keepalive=keepalive, every_s=settings.hop_timeout_s / 2,
                     max_wait_s=settings.session_idle_ttl_s / 2)
    head.touch()
    return True
