"""actors.node.hop_session: every hop but the head, without processes. A real ``StepEngine`` over the stub backend
computes; the other nodes of the route are fakes that record what is written to them (tests/support/sessions.py).
What a hop forwards is checked against a fresh stub backend of the same layers fed the same input."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from actors.backend import StepInput
from actors.node.hop_session import HopSession
from schemas.errors import BadRequestError, FrameError, SessionNotFoundError, StaleEpochError
from schemas.frame import FrameKind, SampledToken
from schemas.route import RouteUpdate
from schemas.session import FailureReason, SessionPhase, TokenEvent
from tests.support.sessions import Rig, header, hidden_rows, new_session_id, reference, rig, route, stub

PREFILL, DECODE = FrameKind.PREFILL, FrameKind.DECODE
RANGES = ((0, 3), (3, 6), (6, 8))
"""Head a, middle b, tail c."""


@pytest.fixture
async def middle(tmp_path: Path) -> AsyncIterator[Rig]:
    async with rig(stub(3, 6), tmp_path) as r:
        yield r


@pytest.fixture
async def tail(tmp_path: Path) -> AsyncIterator[Rig]:
    async with rig(stub(6, 8), tmp_path) as r:
        yield r


async def position(answer: int | Awaitable[int]) -> int:
    """``on_frame``'s answer: the new position, at once or once the step ran."""
    return answer if isinstance(answer, int) else await answer


async def hop(r: Rig, index: int, prompt: int, **kw: Any) -> tuple[str, HopSession]:
    sid = new_session_id()
    session = await r.open(route(sid, *RANGES), index, list(range(65, 65 + prompt)), **kw)
    assert isinstance(session, HopSession)
    return sid, session


async def test_a_frame_that_does_not_fit_the_session_is_refused(middle: Rig) -> None:
    sid, s = await hop(middle, 1, prompt=4)
    with pytest.raises(FrameError) as err:
        s.on_frame(header(sid, PREFILL, 2, 2), hidden_rows(2), 512)
    assert err.value.code == "position_mismatch" and "is at 0" in err.value.message
    with pytest.raises(FrameError, match="does not match this model's"):
        s.on_frame(header(sid, PREFILL, 0, 2, shape=(32,)), hidden_rows(2)[:, :32], 256)
    with pytest.raises(FrameError, match="past the context"):
        s.on_frame(header(sid, PREFILL, 0, 5000), hidden_rows(1), 512)
    assert s.position == 0 and s.frames_received == 0 and not middle.peers.frames  # nothing computed or sent


async def test_a_hop_computes_each_frame_and_forwards_it_in_order(middle: Rig) -> None:
    sid, s = await hop(middle, 1, prompt=6)
    chunks = [hidden_rows(4, seed=1), hidden_rows(2, seed=2)]
    assert await position(s.on_frame(header(sid, PREFILL, 0, 4), chunks[0], 1024)) == 4
    assert await position(s.on_frame(header(sid, PREFILL, 4, 2, sample=True), chunks[1], 512)) == 6
    step = hidden_rows(1, seed=3)
    assert await position(s.on_frame(header(sid, DECODE, 6, 1, sample=True, step=1), step, 256)) == 7
    expected = reference(stub(3, 6), sid, [StepInput(sid, 0, hidden=chunks[0]), StepInput(sid, 4, hidden=chunks[1]),
                                           StepInput(sid, 6, hidden=step)])
    sent = middle.peers.frames
    assert [(node, h.kind, h.start_position, h.n_positions, h.sample, h.step) for node, h, _ in sent] == [
        ("c", PREFILL, 0, 4, False, 0), ("c", PREFILL, 4, 2, True, 0), ("c", DECODE, 6, 1, True, 1)]
    for (_, h, hidden), want in zip(sent, expected, strict=True):
        np.testing.assert_array_equal(hidden, want)  # f32 on the wire: bit for bit what the layers computed
        assert [stamp.hop_index for stamp in h.stamps] == [1]  # this hop's compute time rides on
    assert (s.frames_received, s.positions_received, s.bytes_received) == (3, 7, 1792)
    assert s.phase is SessionPhase.DECODE


async def test_frames_of_one_choice_wait_for_the_step_before_them(middle: Rig) -> None:
    sid, s = await hop(middle, 1, prompt=8)
    first = s.on_frame(header(sid, PREFILL, 0, 4), hidden_rows(4, seed=1), 1024)
    second = s.on_frame(header(sid, PREFILL, 4, 4), hidden_rows(4, seed=2), 1024)  # before the first has run
    assert not isinstance(first, int) and not isinstance(second, int)
    assert list(await asyncio.gather(first, second)) == [4, 8]
    assert [h.start_position for _, h, _ in middle.peers.frames] == [0, 4]


async def test_the_tail_samples_and_posts_each_token_to_the_head(tail: Rig) -> None:
    sid, s = await hop(tail, 2, prompt=5, max_tokens=2)
    prompt_hidden, step_hidden = hidden_rows(5, seed=4), hidden_rows(1, seed=5)
    await position(s.on_frame(header(sid, PREFILL, 0, 5, sample=True), prompt_hidden, 1280))
    await position(s.on_frame(header(sid, DECODE, 5, 1, sample=True, step=1), step_hidden, 256))
    expected = reference(stub(6, 8), sid, [StepInput(sid, 0, hidden=prompt_hidden, sample=True),
                                           StepInput(sid, 5, hidden=step_hidden, sample=True)])
    sent = tail.peers.tokens
    assert [(node, t.seq, t.token) for node, t in sent] == [("a", 0, expected[0]), ("a", 1, expected[1])]
    assert [t.text for _, t in sent] == [chr(expected[0]), chr(expected[1])]  # printable bytes of the toy vocabulary
    assert [t.finish_reason for _, t in sent] == [None, "length"]  # max_tokens=2: the tail's Generation says so
    assert all([st.hop_index for st in t.stamps] == [2] for _, t in sent)
    assert s.phase is SessionPhase.COMPLETE and not tail.peers.frames  # a tail forwards no frame


async def test_a_hop_takes_no_tokens_or_failure_reports(middle: Rig) -> None:
    sid, s = await hop(middle, 1, prompt=2)
    for token in (TokenEvent(session_id=sid, seq=0, token=66, text="B"), SampledToken(session_id=s.raw_id, seq=0,
                                                                                     token=66)):
        with pytest.raises(BadRequestError, match="tokens go to the session's head"):
            s.on_token(token)
    with pytest.raises(BadRequestError, match="failures are reported to the session's head"):
        s.on_failure_report(FailureReason(phase=SessionPhase.DECODE, kind="internal", message="x"))


async def test_a_successor_failing_is_reported_to_the_head_and_the_session_closes(middle: Rig) -> None:
    sid, s = await hop(middle, 1, prompt=4)
    middle.peers.refuse("c", "connection reset by c")
    await position(s.on_frame(header(sid, PREFILL, 0, 4, sample=True), hidden_rows(4), 1024))
    await middle.until(lambda: middle.closed, "the session closing after its report")
    assert [(node, r.node_id, r.kind, r.message) for node, r in middle.peers.reports] == [
        ("a", "c", "unreachable", "connection reset by c")]
    assert middle.closed == [s] and not middle.backend.open_sessions  # its KV freed


async def test_a_frame_of_an_older_epoch_is_refused_and_computes_nothing(tail: Rig) -> None:
    """A repair cut the tail back to 4 and went on as epoch 1; a frame the routed-around middle still sent (an
    evicted node is alive) would put the tail a position ahead of the replacement's replay."""
    sid, s = await hop(tail, 2, prompt=6)
    await position(s.on_frame(header(sid, PREFILL, 0, 4), hidden_rows(4, seed=1), 1024))
    await s.update_route(RouteUpdate(session_id=sid, epoch=1, route=route(sid, *RANGES), hop_index=2,
                                     truncate_to=4, generated=[], quiet_below=4))
    with pytest.raises(StaleEpochError, match="epoch 0; .* is at epoch 1") as err:
        s.on_frame(header(sid, PREFILL, 4, 2, sample=True), hidden_rows(2, seed=2), 512)
    assert err.value.code == "stale_epoch" and s.position == 4 and s.frames_received == 1
    assert await position(s.on_frame(header(sid, PREFILL, 4, 2, sample=True, epoch=1), hidden_rows(2, seed=2),
                                     512)) == 6  # the replacement's frame of the same positions
    with pytest.raises(StaleEpochError):
        await s.update_route(RouteUpdate(session_id=sid, epoch=1, route=route(sid, *RANGES), hop_index=2)
                             .model_copy(update={"epoch": 0}))


async def test_a_hop_routed_around_closes_without_a_report(middle: Rig) -> None:
    """Its successor refused a frame of an older epoch: the head repaired the route without this node, and a
    report would read as that successor failing."""
    sid, s = await hop(middle, 1, prompt=4)
    middle.peers.refuse("c", "refused", peer_error=StaleEpochError("frame of epoch 0; the session is at epoch 1"))
    await position(s.on_frame(header(sid, PREFILL, 0, 4, sample=True), hidden_rows(4), 1024))
    await middle.until(lambda: middle.closed, "the session closing")
    assert middle.closed == [s] and not middle.backend.open_sessions
    assert not middle.peers.reports


async def test_a_tail_that_cannot_reach_the_head_says_it_on_nats(tail: Rig) -> None:
    sid, s = await hop(tail, 2, prompt=4)
    tail.peers.unreachable_head = True
    tail.peers.refuse("a", "head gone")
    await position(s.on_frame(header(sid, PREFILL, 0, 4, sample=True), hidden_rows(4), 1024))
    await tail.until(lambda: tail.closed, "the session closing")
    ends = tail.published.ends(tail.subjects.tokens(sid))
    assert len(ends) == 1 and ends[0].phase is SessionPhase.FAILED and ends[0].failure is not None
    assert (ends[0].failure.node_id, ends[0].failure.message) == ("a", "head gone")
    assert not tail.peers.reports  # the head was not reached


async def test_n2_decode_frames_of_a_round_run_together_in_one_forward_pass(middle: Rig) -> None:
    sid, s = await hop(middle, 1, prompt=3, n=2, seed=7)
    prompt_hidden = hidden_rows(3, seed=1)
    # the last prefill chunk (the one the tail samples after) forks the prompt's KV into choice 1
    await position(s.on_frame(header(sid, PREFILL, 0, 3, sample=True), prompt_hidden, 768))
    assert [c.position for c in s.choices.all] == [3, 3]
    rows = [hidden_rows(1, seed=10), hidden_rows(1, seed=11)]
    batches = middle.engine.batches_run
    first = s.on_frame(header(sid, DECODE, 3, 1, sample=True, step=1, choice=1, group=2), rows[1], 256)
    await asyncio.sleep(0.05)
    assert not isinstance(first, int)
    assert middle.engine.batches_run == batches and len(middle.peers.frames) == 1  # held for the rest of its round
    second = s.on_frame(header(sid, DECODE, 3, 1, sample=True, step=1, choice=0, group=2), rows[0], 256)
    assert not isinstance(second, int)
    assert list(await asyncio.gather(first, second)) == [4, 4]
    assert middle.engine.batches_run == batches + 1 and middle.engine.max_batch_seen == 2  # one pass for both
    fork = f"{sid}/1"
    expected = reference(stub(3, 6), sid, [StepInput(sid, 0, hidden=prompt_hidden, forks=(fork,)),
                                           StepInput(sid, 3, hidden=rows[0]), StepInput(fork, 3, hidden=rows[1])])
    decoded = sorted(((h.choice, h.group, h.step, hidden) for _, h, hidden in middle.peers.frames[1:]),
                     key=lambda x: x[0])
    assert [(c, g, st) for c, g, st, _ in decoded] == [(0, 2, 1), (1, 2, 1)]
    for (_, _, _, hidden), want in zip(decoded, expected[1:], strict=True):
        np.testing.assert_array_equal(hidden, want)


async def test_closing_answers_a_round_that_never_filled(middle: Rig) -> None:
    sid, s = await hop(middle, 1, prompt=3, n=2, seed=7)
    await position(s.on_frame(header(sid, PREFILL, 0, 3, sample=True), hidden_rows(3), 768))
    waiting = s.on_frame(header(sid, DECODE, 3, 1, sample=True, step=1, choice=0, group=2), hidden_rows(1), 256)
    assert not isinstance(waiting, int)
    await s.close()
    with pytest.raises(SessionNotFoundError):
        await waiting
    assert not middle.backend.open_sessions  # both choices' backend sessions freed
