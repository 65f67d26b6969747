"""actors.node.head_session: the head drives prefill and decode and owns the session's fate, without processes. A
real ``StepEngine`` over the stub backend computes; the test plays the rest of the route (tests/support/sessions.py):
it reads the frames the head writes and feeds the tail's tokens back through ``on_token``.

Each decode strategy the head may run (``decode.relay``, ``decode.local_chain``, ``decode.rounds``, the verify
windows of ``speculation.verify_loop``) is also driven on its own, after the real prefill, against a fake head
(tests/support/head_port.py): the test plays the route and checks which steps it computed, which frames it queued,
what it announced and when it completed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest

from actors.backend import StepInput
from actors.node.decode.local_chain import LocalChain
from actors.node.decode.relay import Relay
from actors.node.decode.rounds import Rounds
from actors.node.head_session import HeadSession, decode_strategy
from actors.node.prefill import prefill
from actors.node.speculation.verify_loop import VerifyWindows
from schemas.errors import FrameError
from schemas.frame import FrameKind, HopStamp, SampledToken
from schemas.session import FailureReason, FinishReason, SessionOpen, SessionPhase, Speculation
from schemas.telemetry import GenerationTelemetry
from tests.support.head_port import FakePort, Frame
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


# ---- the decode strategies, each driven on its own against a fake head (tests/support/head_port.py) -------------

async def opened_port(r: Rig, *ranges: tuple[int, int], prompt: list[int] = PROMPT, **kw: Any) -> FakePort:
    """A fake head of a route over ``ranges`` whose backend session is open and whose prompt is prefilled."""
    port = FakePort(r, route(new_session_id(), *ranges), prompt, **kw)
    await r.engine.call(lambda: r.backend.open_session(port.id, prompt_tokens=prompt,
                                                       sampling=port.request.sampling))
    first = await prefill(port)
    assert first is not None, "every later hop opened"
    port.put_events(first)  # head and tail on one node: the first tokens, sampled here (else none)
    return port


async def test_relay_computes_a_step_per_token_and_forwards_its_frame_until_the_last_token(head: Rig) -> None:
    port = await opened_port(head, (0, 3), (3, 8), max_tokens=3)
    sid = port.id
    assert [(f.start, f.positions) for f in port.decode_frames(PREFILL)] == [(0, len(PROMPT))]
    run = asyncio.ensure_future(Relay().run(port))
    fed = [ord(c) for c in "xyz"]
    for seq, value in enumerate(fed[:2]):
        port.send(port.token(seq, value))
        await head.until(lambda: len(port.decode_frames()) == seq + 1, f"the frame of token {seq}")  # noqa: B023
    port.send(port.token(2, fed[2], finish="length"))
    await asyncio.wait_for(run, 10)

    assert [(i.session_id, i.start_position, i.tokens) for i in port.computed] == [
        (sid, 0, PROMPT), (sid, 10, fed[:1]), (sid, 11, fed[1:2])]  # no step for the last token
    decode = port.decode_frames()
    assert [(f.start, f.positions, f.step, f.tokens) for f in decode] == [(10, 1, 1, (fed[0],)), (11, 1, 2, (fed[1],))]
    expected = reference(stub(0, 3), sid, [StepInput(sid, 0, tokens=PROMPT), StepInput(sid, 10, tokens=fed[:1]),
                                           StepInput(sid, 11, tokens=fed[1:2])])
    for frame, want in zip([*port.decode_frames(PREFILL), *decode], expected, strict=True):
        np.testing.assert_array_equal(frame.hidden, want)
    assert [(e.seq, e.token, e.finish_reason) for e in port.announced] == [
        (0, fed[0], None), (1, fed[1], None), (2, fed[2], "length")]
    assert port.completed is port.announced[-1] and port.kept == 12
    assert (port.choices.first.finish_reason, port.choices.first.tokens) == ("length", 3)


async def test_relay_takes_the_step_on_token_started_instead_of_computing_it_again(head: Rig) -> None:
    port = await opened_port(head, (0, 3), (3, 8), max_tokens=3)
    sid, choice = port.id, port.choices.first
    run = asyncio.ensure_future(Relay().run(port))
    first = port.token(0, ord("x"))
    # What HeadSession.on_token does for a token: the step it feeds queued at once (here: not run inline).
    queued = head.engine.enqueue(choice.decode_step(first.token), handoff=True)
    choice.prefetched = (0, queued, False)
    port.send(first)
    await head.until(lambda: len(port.decode_frames()) == 1, "the frame of token 0")
    port.send(port.token(1, ord("y"), finish="length"))
    await asyncio.wait_for(run, 10)

    assert [(i.start_position, i.tokens) for i in port.computed] == [(0, PROMPT), (10, [ord("x")])]
    (frame,) = port.decode_frames()
    assert (frame.start, frame.step, frame.tokens, port.position) == (10, 1, (ord("x"),), 11)  # the step ran once
    want = reference(stub(0, 3), sid, [StepInput(sid, 0, tokens=PROMPT), StepInput(sid, 10, tokens=[ord("x")])])
    np.testing.assert_array_equal(frame.hidden, want[-1])
    assert choice.prefetched is None and [e.seq for e in port.announced] == [0, 1] and port.completed is not None


async def test_local_chain_announces_each_token_the_engine_chained_and_completes_at_max_tokens(tmp_path: Path) -> None:
    async with rig(stub(0, 8), tmp_path) as r:
        port = await opened_port(r, (0, 8), max_tokens=5)
        sid = port.id
        chain = LocalChain()
        await asyncio.wait_for(chain.run(port), 10)
        chain.stop()  # at close, after it ended: nothing left to stop

        ref = stub(0, 8)
        tokens = reference(ref, sid, [StepInput(sid, 0, tokens=PROMPT, sample=True)])
        for i in range(4):  # greedy: each sampled token is the next step's input
            tokens.append(ref.step([StepInput(sid, len(PROMPT) + i, tokens=[tokens[-1]], sample=True)])[0].token)
        assert [e.token for e in port.announced] == tokens
        assert [e.finish_reason for e in port.announced] == [None] * 4 + ["length"]
        assert port.completed is port.announced[-1] and port.phase is SessionPhase.COMPLETE
        # The prefill was computed through the port, every decode step by the engine's chain on its own.
        assert [(i.start_position, i.tokens) for i in port.computed] == [(0, PROMPT)]
        assert [(i.start_position, i.tokens) for i in port.advanced] == [(10 + i, [tokens[i]]) for i in range(4)]
        assert not port.frames and port.kept == 14


async def test_rounds_step_every_live_choice_together_and_name_the_rounds_size(head: Rig) -> None:
    port = await opened_port(head, (0, 3), (3, 8), n=2, max_tokens=3)
    sid = port.id
    assert [c.backend_id for c in port.choices.all] == [sid, f"{sid}/1"]  # the prefill forked choice 1
    run = asyncio.ensure_future(Rounds(local=False).run(port))
    a, b, c, d, e = (ord(ch) for ch in "abcde")
    port.send(port.token(0, b, choice=1))  # a round waits for every live choice, in whatever order they come
    port.send(port.token(0, a, choice=0))
    await head.until(lambda: len(port.decode_frames()) == 2, "round 1's frames")
    port.send(port.token(1, d, choice=1, finish="length"))
    port.send(port.token(1, c, choice=0))
    await head.until(lambda: len(port.decode_frames()) == 3, "round 2's frame")
    port.send(port.token(2, e, choice=0, finish="length"))
    await asyncio.wait_for(run, 10)

    assert [(i.session_id, i.start_position, i.tokens) for i in port.computed[1:]] == [
        (sid, 10, [a]), (f"{sid}/1", 10, [b]), (sid, 11, [c])]
    assert [(f.choice, f.start, f.step, f.group, f.tokens) for f in port.decode_frames()] == [
        (0, 10, 1, 2, (a,)), (1, 10, 1, 2, (b,)),  # one round of two: one pass on every hop
        (0, 11, 2, 1, (c,))]  # choice 1 ended: a round of one
    assert [(ev.index, ev.token) for ev in port.announced] == [(0, a), (1, b), (0, c), (1, d), (0, e)]
    assert port.completed is port.announced[-1]
    assert [(ch.finish_reason, ch.tokens) for ch in port.choices.all] == [("length", 3), ("length", 2)]


async def test_verify_windows_send_drafts_announce_verdicts_and_cut_back_what_the_tail_rejected(head: Rig) -> None:
    prompt = [ord(ch) for ch in "abcabcabcabc"]  # prompt lookup finds drafts in a text that repeats
    port = await opened_port(head, (0, 3), (3, 8), prompt=prompt, max_tokens=32,
                             speculate=Speculation(source="ngram", max_k=3, windows=1))
    run = asyncio.ensure_future(VerifyWindows(port.request.speculate).run(port))  # type: ignore[arg-type]
    seq = 0

    def tail(*values: int, finish: Literal["stop", "length"] | None = None) -> list[SampledToken]:
        nonlocal seq
        out = [port.token(seq + i, v, finish=finish if i == len(values) - 1 else None) for i, v in enumerate(values)]
        seq += len(values)
        return out

    def windows() -> list[Frame]:
        return port.decode_frames(FrameKind.VERIFY)

    port.send(tail(ord("a"))[0])  # the prefill's token comes as a plain token
    await head.until(lambda: len(windows()) == 1, "the first window")
    w1 = windows()[0]
    assert (w1.start, w1.tokens and w1.tokens[0]) == (12, ord("a")) and w1.positions == len(w1.tokens or ())
    drafts = list((w1.tokens or ())[1:])
    assert drafts == [ord(ch) for ch in "bca"[:len(drafts)]] and drafts, "prompt lookup continues the pattern"

    # The tail accepts every draft and samples the next token itself: the next window starts after all of them.
    own = ord("abc"[(len(drafts) + 1) % 3])
    port.send(port.window(w1.step, len(drafts), tail(*drafts, own)))
    await head.until(lambda: len(windows()) == 2, "the second window")
    w2 = windows()[1]
    assert (w2.start, w2.tokens and w2.tokens[0]) == (12 + len(w1.tokens or ()), own)
    assert [ev.token for ev in port.announced] == [ord("a"), *drafts, own]
    assert len(w2.tokens or ()) > 1, "the pattern goes on: drafts again"

    # The tail rejects every draft of it: the head cuts its KV back to the window's first position.
    port.send(port.window(w2.step, 0, tail(ord("q"))))
    await head.until(lambda: len(windows()) == 3, "the third window")
    w3 = windows()[2]
    assert (w3.start, w3.tokens and w3.tokens[0]) == (w2.start + 1, ord("q"))
    assert port.recovery.tokens[len(prompt):w3.start] == [ord("a"), *drafts, own]

    port.send(port.window(w3.step, 0, tail(ord("z"), finish="stop")))
    await asyncio.wait_for(run, 10)
    assert [ev.token for ev in port.announced] == [ord("a"), *drafts, own, ord("q"), ord("z")]
    assert port.completed is port.announced[-1] and port.completed.finish_reason == "stop"
    assert port.kept == w3.start + 1  # the window's first position came true; its drafts did not
    assert len(port.computed) == 4 and [i.start_position for i in port.computed[1:]] == [w1.start, w2.start, w3.start]


@pytest.mark.parametrize(("ranges", "kw", "strategy"), [
    (((0, 3), (3, 8)), {}, Relay),
    (((0, 8),), {}, LocalChain),
    (((0, 3), (3, 8)), {"n": 2}, Rounds),
    (((0, 8),), {"n": 2}, Rounds),
    (((0, 3), (3, 8)), {"speculate": Speculation(source="ngram", max_k=2, windows=1)}, VerifyWindows),
    (((0, 8),), {"speculate": Speculation(source="ngram", max_k=2, windows=1)}, LocalChain),  # no ring to verify on
])
def test_the_open_settles_the_decode_strategy(ranges: tuple[tuple[int, int], ...], kw: dict[str, Any],
                                              strategy: type) -> None:
    sid = new_session_id()
    request = SessionOpen(session_id=sid, route=route(sid, *ranges), hop_index=0, prompt_tokens=PROMPT,
                          max_tokens=4, **kw)
    chosen = decode_strategy(request, is_tail=len(ranges) == 1)
    assert type(chosen) is strategy
    if isinstance(chosen, Rounds):
        assert chosen.local == (len(ranges) == 1)  # head and tail on one node: the round's steps sample
