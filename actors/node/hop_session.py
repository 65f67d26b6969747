"""A Route Session on every hop but the head: receive a frame, compute it, forward the hidden state (or, on the tail,
sample and post the token to the head).

Frames of one choice (n > 1: each choice decodes as a backend session of its own, ``actors.node.choices``) are
computed in arrival order: a frame that comes while the previous one is still computing waits for it. When the step
of a frame runs inline (a lone session's decode position on an idle engine), computing and writing its forward both
happen before ``on_frame`` returns. A failure downstream, or of this node's backend, is reported to the head (the
session's owner), or on NATS if the head cannot be reached.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable

from actors.backend import Hidden, StepInput, StepOutput
from actors.node.choices import Choice
from actors.node.session import NodeSession, SessionFailed, StepFuture, settled
from actors.node.speculation.policy import Target, verify
from actors.node.speculation.windows import WindowOrder
from bus import frame as frames
from schemas.errors import (
    BackendError,
    BadRequestError,
    FrameError,
    HopError,
    SessionNotFoundError,
    StaleEpochError,
    SwarmrouteError,
)
from schemas.frame import FrameHeader, FrameKind, HopStamp, SampledToken, SampledWindow
from schemas.route import HopPosition, RouteUpdate
from schemas.session import FailureReason, SessionEnd, SessionPhase


class HopSession(NodeSession):
    _rounds: dict[int, list[tuple[Choice, FrameHeader, Hidden, int, asyncio.Future[int]]]] | None = None
    """n > 1: decode frames of a round (by step) waiting for the rest of their group."""
    _expect: int | None = None
    """Tail, speculative: the token the next good window starts with (the one it sampled last)."""

    @functools.cached_property
    def _order(self) -> WindowOrder:
        return WindowOrder()

    def on_frame(self, header: FrameHeader, hidden: Hidden, nbytes: int) -> int | Awaitable[int]:
        """Validate, compute and queue the forward of one frame; returns the new KV position of its choice, or an
        awaitable of it when the step had to queue for the backend's worker. Frames of one choice run in arrival
        order; different choices' frames queue side by side, so the engine batches them."""
        self._check_epoch(header)
        if header.position_shape != self.hidden_shape:
            raise FrameError(f"frame position shape {list(header.position_shape)} does not match this model's "
                             f"{list(self.hidden_shape)}")
        choice = self.choices.get(header.choice)
        if header.kind is FrameKind.VERIFY:
            return self._window(choice, header, hidden, nbytes)
        if header.kind is FrameKind.DECODE:
            self._spinner.arrived()
            if header.group > 1:
                return self._join_round(choice, header, hidden, nbytes)
        if choice.frame_step is not None:
            return self._on_frame_later(choice, header, hidden, nbytes)
        return self._run_frame(choice, header, hidden, nbytes)

    def _check_epoch(self, header: FrameHeader) -> None:
        """Refuse a frame of an older epoch than this hop's: its sender was routed around. An evicted node is still
        alive (issue #28), and a frame it computed after the cut below would put this hop a position ahead of
        the replacement's replay (checked again when the frame's step starts: the cut may land while it waits)."""
        if header.epoch < self.recovery.epoch:
            raise StaleEpochError(f"frame of epoch {header.epoch}; session {self.id} is at epoch "
                                  f"{self.recovery.epoch} (its sender was routed around)")

    async def _on_frame_later(self, choice: Choice, header: FrameHeader, hidden: Hidden, nbytes: int) -> int:
        while choice.frame_step is not None:
            await asyncio.wait([choice.frame_step])
        ran = self._run_frame(choice, header, hidden, nbytes)
        return ran if isinstance(ran, int) else await ran

    def _join_round(self, choice: Choice, header: FrameHeader, hidden: Hidden, nbytes: int) -> Awaitable[int]:
        """n > 1: hold a decode frame until its whole round (``header.group`` frames of this step) is in, then
        queue the round's steps together: one forward pass carries them all, in choice order, every time."""
        rounds = self._rounds if self._rounds is not None else {}
        self._rounds = rounds
        waiting = rounds.setdefault(header.step, [])
        answer: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        waiting.append((choice, header, hidden, nbytes, answer))
        if len(waiting) >= header.group:
            del rounds[header.step]
            self._run_round(sorted(waiting, key=lambda w: w[0].index))
        return answer

    def _run_round(self, frames: list[tuple[Choice, FrameHeader, Hidden, int, asyncio.Future[int]]]) -> None:
        accepted, items = [], []
        for choice, header, hidden, nbytes, answer in frames:
            try:
                items.append(self._frame_step_input(choice, header, hidden, nbytes))
            except SwarmrouteError as exc:
                answer.set_exception(exc)
                continue
            accepted.append((choice, header, answer))
        steps = self.rt.engine.enqueue_group(items) if items else []
        for (choice, header, answer), item, step in zip(accepted, items, steps, strict=True):
            asyncio.ensure_future(self._round_member(choice, header, item, step, answer))

    async def _round_member(self, choice: Choice, header: FrameHeader, item: StepInput, step: StepFuture,
                            answer: asyncio.Future[int]) -> None:
        await settled(step)
        try:
            answer.set_result(self._frame_computed(choice, header, item, step))
        except SwarmrouteError as exc:
            answer.set_exception(exc)
        except BaseException:  # its step was cancelled: the session closed under it
            answer.set_exception(SessionNotFoundError(f"session {self.id} closed on node {self.rt.node_id}"))
            raise

    # ---- verify windows (issue #20) -----------------------------------------------------------------------------

    def _window(self, choice: Choice, header: FrameHeader, hidden: Hidden, nbytes: int) -> int | Awaitable[int]:
        """A verify window: taken in window order, after the one before it has run (the tail judges it then)."""
        if self.request.speculate is None or header.tokens is None or len(header.tokens) != header.n_positions:
            raise FrameError("a verify window needs a speculative session and one token id per position")
        order = self._order
        if order.seen(header.step):
            return choice.position  # sent twice: taken already
        if order.next == header.step and choice.frame_step is None:
            return self._window_now(choice, header, hidden, nbytes)
        return self._window_later(choice, header, hidden, nbytes)

    async def _window_later(self, choice: Choice, header: FrameHeader, hidden: Hidden, nbytes: int) -> int:
        await self._order.turn(header.step)
        while choice.frame_step is not None:
            await asyncio.wait([choice.frame_step])
        ran = self._window_now(choice, header, hidden, nbytes)
        return ran if isinstance(ran, int) else await ran

    def _window_now(self, choice: Choice, header: FrameHeader, hidden: Hidden, nbytes: int) -> int | Awaitable[int]:
        assert header.tokens is not None
        try:
            generation = choice.generation
            if self.is_tail and (header.start_position != choice.position or (generation and generation.done)
                                 or (self._expect is not None and header.tokens[0] != self._expect)):
                return choice.position  # built on drafts the tail rejected (or past the end): dropped unread
            if header.start_position < choice.position:  # the window before it was not accepted whole
                self.rt.engine.call_soon(self._kv().truncate, self.id, header.start_position)
                choice.position = header.start_position
                self.recovery.truncate(header.start_position)
            return self._run_frame(choice, header, hidden, nbytes)
        finally:
            self._order.taken(header.step)

    def _judge(self, choice: Choice, header: FrameHeader, out: StepOutput, stamps: tuple[HopStamp, ...]) -> None:
        """Tail: accept the window's drafts the model agrees with (``speculation.verify``), emit them and its own
        next token, cut the rejected positions out of the KV, and send the verdict to the head in one message."""
        assert header.tokens is not None and out.rows is not None
        sampling = self.request.sampling
        target = Target(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                        min_p=sampling.min_p)
        verdict = verify(out.rows, header.tokens[1:], target, start=header.start_position, seed=sampling.seed)
        emitted: list[SampledToken] = []
        for token in verdict.tokens:
            emitted.append(self._sampled_token(choice, token, stamps))
            if emitted[-1].finish_reason is not None:
                self.phase = SessionPhase.COMPLETE
                break
        keep = header.start_position + verdict.accepted + 1
        if keep < choice.position:
            self.rt.engine.call_soon(self._kv().truncate, self.id, keep)
            choice.position = keep
            self.recovery.truncate(keep)
        self._expect = verdict.tokens[-1]
        data = frames.encode_window(SampledWindow(self.raw_id, header.step, verdict.accepted, tuple(emitted)))
        head, timeout = self.route.head, self.rt.settings.hop_timeout_s
        assert self.outbox is not None
        self.outbox.send(lambda: self.rt.client.send_window(head.node_id, head.endpoint, self.id, data,
                                                            timeout=timeout, session_token=self.session_token),
                         causal=True)

    def _stopping(self) -> None:
        self._order.close()
        for waiting in (self._rounds or {}).values():  # a round that never filled: its frames are answered
            for *_, answer in waiting:
                if not answer.done():
                    answer.set_exception(SessionNotFoundError(f"session {self.id} closed on node {self.rt.node_id}"))

    def _run_frame(self, choice: Choice, header: FrameHeader, hidden: Hidden, nbytes: int) -> int | Awaitable[int]:
        item = self._frame_step_input(choice, header, hidden, nbytes)
        step = self.rt.engine.enqueue(item, handoff=True, prefill=header.kind is FrameKind.PREFILL)
        if step.done():
            return self._frame_computed(choice, header, item, step)
        choice.frame_step = step
        return self._frame_awaited(choice, header, item, step)

    def _frame_step_input(self, choice: Choice, header: FrameHeader, hidden: Hidden, nbytes: int) -> StepInput:
        """Check a frame against its choice and count it; the step that computes it."""
        if self.closed:  # a frame that waited for its predecessor while the session closed
            raise SessionNotFoundError(f"session {self.id} closed on node {self.rt.node_id}")
        self._check_epoch(header)
        if header.start_position < choice.position and self.reused and not self.frames_received:
            # Prefix reuse: the head reused less than this hop could (the least any hop had), so this hop drops
            # the rest first; the worker runs the cut before the step (calls go ahead of steps).
            self.rt.engine.call_soon(self._kv().truncate, self.id, header.start_position)
            choice.position = self.reused = header.start_position
        if self.reused and not self.frames_received and self.recovery.writer is not None:
            self.recovery.writer.seed(header.start_position)  # the reused prefix, now that the head said how much
        if header.start_position != choice.position:
            raise FrameError(f"frame starts at position {header.start_position}; session {self.id} (choice "
                             f"{choice.index}) is at {choice.position}", code="position_mismatch")
        context = self.rt.engine.backend.info.context_length
        if choice.position + header.n_positions > context:
            raise FrameError(f"frame would grow the session past the context of {context} tokens")
        self.touch()
        self.frames_received += 1
        self.bytes_received += nbytes
        asyncio.get_running_loop().call_soon(self.rt.metrics.frame_bytes.inc, nbytes)
        self.positions_received += header.n_positions
        if header.kind is not FrameKind.PREFILL:
            self.phase = SessionPhase.DECODE
        else:
            asyncio.get_running_loop().call_soon(self.rt.metrics.prefill_positions.inc, header.n_positions)
        # n > 1: the last prefill chunk (the one the tail samples after) forks the prompt's KV into every choice.
        forks = self.choices.fork_ids() if header.kind is FrameKind.PREFILL and header.sample else ()
        window = header.kind is FrameKind.VERIFY and self.is_tail  # the tail judges it from every row's logits
        # A frame a repair replays below ``quiet_below`` has its token already: the tail computes it without
        # sampling (no logits over the vocabulary, and the sampler's penalty window and draws stay as they are).
        sample = header.sample and self.is_tail and not window and self.recovery.forwards(header.start_position)
        # A tail recording a spot-check receipt keeps the largest logits of each row it samples from (issue #28).
        top_k = self.spot.top_k_for(sample) if choice.index == 0 and self.spot is not None else 0
        return StepInput(choice.backend_id, header.start_position, hidden=hidden, sample=sample, rows=window,
                         top_k=top_k, forks=forks)

    async def _frame_awaited(self, choice: Choice, header: FrameHeader, item: StepInput, step: StepFuture) -> int:
        try:
            await settled(step)
        finally:
            choice.frame_step = None
        return self._frame_computed(choice, header, item, step)

    def _frame_computed(self, choice: Choice, header: FrameHeader, item: StepInput, step: StepFuture) -> int:
        """The frame's step has run: advance, then send its forward (or the token) on."""
        try:
            out, timing = self._step_result(choice, item, step, header.tokens)
        except SessionFailed as failed:
            asyncio.create_task(self._report(failed.reason))
            raise BackendError(failed.reason.message) from None
        forks = self.fork(choice.position) if item.forks else []
        stamps = (*header.stamps, self.stamp(timing))
        if self.is_tail and header.kind is FrameKind.VERIFY:
            self._judge(choice, header, out, stamps)
        elif self.is_tail:
            if self.spot is not None and choice.index == 0:
                self.spot.answered(header.start_position, item.sample, out.top, out.token)
            if header.sample and self.recovery.forwards(header.start_position):
                self._send_token(choice, out, stamps)
                for fork, first in zip(forks, out.forks, strict=True):
                    self._send_token(fork, first, stamps)
        else:
            assert out.hidden is not None
            self.queue_frame(header.kind, header.start_position, out.hidden, header.sample, header.step, stamps,
                             choice.index, header.group, header.tokens)
        if header.kind is FrameKind.DECODE and self.phase is SessionPhase.DECODE:
            self._spinner.idle()
        return choice.position

    def _send_token(self, choice: Choice, out: StepOutput, stamps: tuple[HopStamp, ...]) -> None:
        sampled = self.sampled(choice, out, stamps)
        head = self.route.head
        timeout = self.rt.settings.hop_timeout_s
        data = frames.encode_token(sampled)
        assert self.outbox is not None
        self.outbox.send(lambda: self.rt.client.send_token(head.node_id, head.endpoint, self.id, data,
                                                           timeout=timeout, session_token=self.session_token),
                         causal=True)
        if sampled.finish_reason is not None and (self.request.n == 1 or self.choices.tail_done()):
            self.phase = SessionPhase.COMPLETE

    async def _report(self, reason: FailureReason) -> None:
        """Tell the head, which owns the session's fate; if the head cannot be reached, say it on NATS. A session
        that repairs keeps its KV when another node was lost: the head may route around it (issue #18)."""
        head = self.route.head
        try:
            await self.rt.client.report_failure(head.node_id, head.endpoint, self.id, reason,
                                                session_token=self.session_token)
        except HopError:
            if (self.request.repair or self.request.n > 1) and reason.node_id == head.node_id:
                # The head itself is lost: the gateway finds it and a replacement head re-binds (issue #31), or,
                # for sampled choices (n > 1, opened without repair), fails it saying why and frees every hop.
                return
            end = SessionEnd(session_id=self.id, phase=SessionPhase.FAILED, failure=reason)
            await self.rt.publish(self.rt.subjects.tokens(self.id), end)
        else:
            if self.request.repair and reason.node_id not in (None, self.rt.node_id):
                return
        await self.close()

    # ---- repair (issue #18): the head re-routes the session around a lost node -------------------------------

    async def update_route(self, update: RouteUpdate) -> HopPosition:
        """Go on as hop ``update.hop_index`` of the repaired route, once the steps under way have run: cut the KV
        back (``truncate_to``), start the tail's sampler and stop rules over from ``generated``. Answers where the
        KV ends then. An update of the current epoch again only answers (the head may ask twice)."""
        if self.request.n > 1:
            raise BadRequestError("sessions with n > 1 are not repaired")
        choice = self.choices.first
        while choice.frame_step is not None:
            await asyncio.wait([choice.frame_step])
        if update.epoch < self.recovery.epoch:
            raise StaleEpochError(f"route update of epoch {update.epoch}; session {self.id} is at epoch "
                                  f"{self.recovery.epoch}")
        if update.epoch > self.recovery.epoch:
            self.recovery.epoch = update.epoch
            self.retarget(update.route, update.hop_index)
            if update.truncate_to is not None and update.truncate_to < choice.position:
                await self.rt.engine.call(self._kv().truncate, self.id, update.truncate_to)
                choice.position = update.truncate_to
                self.recovery.truncate(update.truncate_to)
            if self.is_tail and update.generated is not None:
                await self.restart_generation(update.generated)
            # Verify windows (issue #20) are numbered afresh by the head that drives the new epoch, and its first
            # one follows a plain frame: the old epoch's order and expected token would drop them all.
            if self.request.speculate is not None:
                self._order.close()
                self.__dict__.pop("_order", None)
                self._expect = None
            self.recovery.quiet_below = update.quiet_below if self.is_tail else None
        journal = self.recovery.journal
        return HopPosition(session_id=self.id, node_id=self.rt.node_id, position=choice.position,
                           journal_start=journal.start if journal is not None else None)
