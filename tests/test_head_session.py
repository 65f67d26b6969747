"""actors.node.head_session: the head drives prefill and decode and owns the session's fate, without processes. A
real ``StepEngine`` over the stub backend computes; the test plays the rest of the route (tests/support/sessions.py):
it reads the frames the head writes and feeds the tail's tokens back through ``on_token``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from actors.backend import StepInput
from actors.node.head_session import HeadSession
from schemas.errors import FrameError
from schemas.frame import FrameKind, HopStamp, SampledToken
from schemas.session import FailureReason, FinishReason, SessionPhase
from schemas.telemetry import GenerationTelemetry
from tests.support.sessions import Rig, header, hidden_rows, new_session_id, reference, rig, route, stub

PREFILL, DECODE = FrameKind.PREFILL, FrameKind.DECODE
PROMPT = [ord(c) for c in "the ring!!"]  # 10 tokens of the stub's byte vocabulary


@pytest.fixture
async def head(tmp_path: Path) -> AsyncIterator[Rig]:
    """The head of route a(0:3) -> b(3:8): b is the tail."""
    async with rig(stub(0, 3), tmp_path) as r:
        yield r


async def open_head(r: Rig, *ranges: tuple[int, int], **kw: Any) -> tuple[str, HeadSession]:
    sid = new_session_id()
    session = await r.open(route(sid, *(ranges or ((0, 3), (3, 8)))), 0, PROMPT, **kw)
    assert isinstance(session, HeadSession)
    return sid, session


def token(s: HeadSession, seq: int, value: int, finish: FinishReason | None = None) -> SampledToken:
    """What the tail (hop 1) posts for ``seq``."""
    return SampledToken(session_id=s.raw_id, seq=seq, token=value, text=chr(value), finish_reason=finish,
                        stamps=(HopStamp(1, 1500, 20),))


def phases(r: Rig, sid: str) -> list[SessionPhase]:
    return [m.phase for m in r.published.on(r.subjects.telemetry(sid)) if isinstance(m, GenerationTelemetry)]


async def prefilled(r: Rig, s: HeadSession, n_frames: int) -> None:
    await r.until(lambda: len(r.peers.frames) >= n_frames, f"{n_frames} prefill frames to the next hop")


async def test_prefill_in_chunks_then_a_decode_step_per_token_then_the_end(head: Rig) -> None:
    sid, s = await open_head(head, max_tokens=3, prefill_chunk=4)
    await prefilled(head, s, 3)
    sent = head.peers.frames
    assert [(n, h.kind, h.start_position, h.n_positions, h.sample) for n, h, _ in sent] == [
        ("b", PREFILL, 0, 4, False), ("b", PREFILL, 4, 4, False), ("b", PREFILL, 8, 2, True)]  # the tail samples last

    fed = [ord("x"), ord("y"), ord("z")]
    for seq, value in enumerate(fed[:2]):
        s.on_token(token(s, seq, value))
        frames = 4 + seq
        await head.until(lambda: len(head.peers.frames) == frames, f"the decode frame of token {seq}")  # noqa: B023
    s.on_token(token(s, 2, fed[2], "length"))
    # the end is published last: after the session closed here and was freed on the other hops
    await head.until(lambda: head.published.ends(head.subjects.tokens(sid)), "the session's end")

    decode = head.peers.frames[3:]
    assert [(h.kind, h.start_position, h.n_positions, h.sample, h.step) for _, h, _ in decode] == [
        (DECODE, 10, 1, True, 1), (DECODE, 11, 1, True, 2)]  # no step after the last token
    expected = reference(stub(0, 3), sid, [StepInput(sid, 0, tokens=PROMPT[:4]), StepInput(sid, 4, tokens=PROMPT[4:8]),
                                           StepInput(sid, 8, tokens=PROMPT[8:]), StepInput(sid, 10, tokens=fed[:1]),
                                           StepInput(sid, 11, tokens=fed[1:2])])
    for (_, _, hidden), want in zip(head.peers.frames, expected, strict=True):
        np.testing.assert_array_equal(hidden, want)

    tokens = head.subjects.tokens(sid)
    events = head.published.token_events(tokens)
    assert [(e.seq, e.token, e.text, e.finish_reason) for e in events] == [
        (0, fed[0], "x", None), (1, fed[1], "y", None), (2, fed[2], "z", "length")]
    assert [(t.node_id, t.compute_ms) for t in events[0].hop_timings] == [("b", 1.5)]  # the tail's stamp, named
    ends = head.published.ends(tokens)
    assert len(ends) == 1 and head.published.on(tokens)[-1] is ends[0]  # the end comes after every token
    end = ends[0]
    assert (end.phase, end.finish_reason, end.prompt_tokens, end.completion_tokens) == (
        SessionPhase.COMPLETE, "length", len(PROMPT), 3)
    assert phases(head, sid)[0] is SessionPhase.PREFILL and phases(head, sid)[-1] is SessionPhase.COMPLETE
    assert head.closed == [s] and head.peers.closed == ["b"]  # freed here, and on every other hop
    assert not head.backend.open_sessions


async def test_a_hops_failure_report_ends_the_session_as_failed(head: Rig) -> None:
    sid, s = await open_head(head)
    await prefilled(head, s, 1)
    s.on_failure_report(FailureReason(node_id="b", phase=SessionPhase.DECODE, kind="backend_error",
                                      message="b's backend failed"))
    await head.until(lambda: head.published.ends(head.subjects.tokens(sid)), "the session's end")
    (end,) = head.published.ends(head.subjects.tokens(sid))
    assert end.phase is SessionPhase.FAILED and end.failure is not None
    assert (end.failure.node_id, end.failure.kind, end.failure.message) == ("b", "backend_error",
                                                                             "b's backend failed")
    assert phases(head, sid)[-1] is SessionPhase.FAILED
    await head.until(lambda: head.peers.closed == ["b"], "the route freed")
    assert head.closed == [s]


async def test_its_own_outbox_failing_ends_the_session_naming_the_next_hop(head: Rig) -> None:
    sid, s = await open_head(head)
    head.peers.refuse("b", "connection refused by b")
    await head.until(lambda: head.published.ends(head.subjects.tokens(sid)), "the session's end")
    (end,) = head.published.ends(head.subjects.tokens(sid))
    assert end.phase is SessionPhase.FAILED and end.failure is not None
    assert (end.failure.node_id, end.failure.kind, end.failure.phase) == ("b", "unreachable", SessionPhase.PREFILL)


async def test_cancel_ends_the_session_once_and_frees_the_route(head: Rig) -> None:
    sid, s = await open_head(head)
    await prefilled(head, s, 1)
    s.on_token(token(s, 0, ord("x")))
    await head.until(lambda: head.published.token_events(head.subjects.tokens(sid)), "the first token published")
    await s.cancel("its client went away")
    await s.cancel("again")
    (end,) = head.published.ends(head.subjects.tokens(sid))
    assert (end.phase, end.completion_tokens) == (SessionPhase.CANCELLED, 1)
    assert phases(head, sid)[-1] is SessionPhase.CANCELLED
    assert head.closed == [s] and head.peers.closed == ["b"]
    frames = len(head.peers.frames)
    s.on_token(token(s, 1, ord("y")))  # a token still on its way: no step, no event
    await asyncio.sleep(0.05)
    assert len(head.peers.frames) == frames and len(head.published.token_events(head.subjects.tokens(sid))) == 1


async def test_a_client_that_stopped_listening_cancels_the_session(tmp_path: Path) -> None:
    asked: list[str] = []

    async def gone(session_id: str) -> bool:
        asked.append(session_id)
        return False

    async with rig(stub(0, 3), tmp_path, client_probe_s=0.01, client_present=gone) as r:
        sid, s = await open_head(r)
        await r.until(lambda: r.published.ends(r.subjects.tokens(sid)), "the session cancelled")
        (end,) = r.published.ends(r.subjects.tokens(sid))
        assert end.phase is SessionPhase.CANCELLED and len(asked) >= 3 and set(asked) == {sid}


async def test_head_and_tail_on_one_node_decode_in_a_chain(tmp_path: Path) -> None:
    async with rig(stub(0, 8), tmp_path) as r:
        sid, s = await open_head(r, (0, 8), max_tokens=6, prefill_chunk=4)
        await r.until(lambda: r.published.ends(r.subjects.tokens(sid)), "the session's end")
        events = r.published.token_events(r.subjects.tokens(sid))
        ref = stub(0, 8)
        chain = reference(ref, sid, [StepInput(sid, 0, tokens=PROMPT[:4]), StepInput(sid, 4, tokens=PROMPT[4:8]),
                                     StepInput(sid, 8, tokens=PROMPT[8:], sample=True)])[-1:]
        for i in range(5):  # greedy: each sampled token is the next step's input
            chain.append(ref.step([StepInput(sid, len(PROMPT) + i, tokens=[chain[-1]], sample=True)])[0].token)
        assert [e.token for e in events] == chain
        assert [e.finish_reason for e in events] == [None] * 5 + ["length"]
        (end,) = r.published.ends(r.subjects.tokens(sid))
        assert (end.phase, end.completion_tokens) == (SessionPhase.COMPLETE, 6)
        assert not r.peers.frames and not r.peers.closed  # nobody else on the route


async def test_the_head_takes_tokens_not_frames(head: Rig) -> None:
    sid, s = await open_head(head)
    with pytest.raises(FrameError, match="the head takes tokens"):
        s.on_frame(header(sid, PREFILL, 0, 1), hidden_rows(1), 256)
