"""What one hop of a session keeps so that the session can survive losing a node (issue #18).

* ``tokens``: the token id of every position its KV holds (the prompt, then one per decode frame), for the prefix
  hashes of its snapshots and for prefix reuse;
* ``journal`` (every hop but the tail, when the session repairs): what it computed for its successor since the
  successor's second most recent snapshot boundary (``actors.node.recovery.journal``);
* ``writer`` (when the session snapshots and the hop has a standby): its snapshot chain
(``actors.node.recovery.snapshots``);
* ``epoch``: how many times the route was repaired; token frames of an older epoch are stale;
* ``quiet_below`` (a hop opened to replace a lost one, or a tail whose KV a repair cut back): frames that start
  below it are computed and kept, not forwarded (the next hop holds those positions already) or sampled (their
  tokens are known).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

from actors.backend import KvBackend
from actors.node.recovery.journal import Entry, Journal, SnapshotSchedule
from actors.node.recovery.snapshots import SnapshotWriter
from actors.node.runtime import NodeRuntime
from schemas.frame import FrameKind
from schemas.route import Hop
from schemas.session import Resume, SessionOpen


class Recovery:
    def __init__(self, rt: NodeRuntime, request: SessionOpen, hop: Hop, *, is_tail: bool,
                 session_token: Callable[[], str | None]) -> None:
        self._rt = rt
        self._session_id = request.session_id
        self._session_token = session_token
        self.epoch = request.epoch
        self.prompt = len(request.prompt_tokens)
        self.tokens: list[int] = list(request.prompt_tokens)
        self.resume: Resume | None = request.resume
        self.quiet_below: int | None = request.resume.quiet_below if request.resume is not None else None
        single = request.n == 1
        self.schedule = SnapshotSchedule(prompt=self.prompt, every=request.snapshot_every if single else 0)
        self.journal = Journal(self.schedule) if request.repair and not is_tail and single else None
        backend = rt.engine.backend
        self.writer: SnapshotWriter | None = None
        # The head too (issue #31: a replacement head takes the session over from them, a 1-node route's included),
        # when its standby is a spare serving its layers (elsewhere a replacement recomputes its KV from the tokens).
        head_spare = hop.standby is not None and hop.standby.layers == hop.layers
        if self.schedule.every and hop.standby is not None and (request.hop_index > 0 or head_spare) and \
                isinstance(backend, KvBackend):
            self.writer = SnapshotWriter(rt, request.session_id, schedule=self.schedule, standby=hop.standby,
                                         layers=hop.layers, model_id=request.route.model_id,
                                         manifest_id=rt.manifest_id, tokens=lambda: self.tokens,
                                         session_token=session_token)

    def start(self) -> None:
        if self.writer is not None:
            self.writer.start()

    async def close(self) -> None:
        if self.writer is not None:
            await self.writer.close()
        resume = self.resume
        if resume is not None and resume.lost_node and resume.standby is not None:
            # A replacement head: the lost head's chain it started from is of no use once the session ended.
            with contextlib.suppress(Exception):
                await self._rt.client.drop_snapshots(resume.standby.node_id, resume.standby.endpoint,
                                                     self._session_id, session_token=self._session_token(),
                                                     timeout=1.0)

    def computed(self, start: int, end: int, tokens: Sequence[int] | None) -> None:
        """A step put positions ``[start, end)`` into the KV; ``tokens`` are theirs when beyond the prompt."""
        if end > self.prompt and tokens is not None:
            self.tokens[max(start, self.prompt):] = list(tokens[max(0, self.prompt - start):])
        if self.writer is not None:
            self.writer.after_step(end)

    def record(self, entry: Entry) -> None:
        if self.journal is None:
            return
        if entry.kind is FrameKind.VERIFY and entry.tokens is not None:
            # A verify window (issue #20) goes in as the decode frames of its positions: a window cut back after
            # a partial verdict keeps its accepted positions, and a replay needs no window order on the
            # replacement. Every position past the prompt is computed one row per pass on a batch-invariant node,
            # so these frames rebuild exactly what the window computed.
            for i, token in enumerate(entry.tokens):
                position = entry.start + i
                self._record(Entry(FrameKind.DECODE, position, entry.hidden[i:i + 1], True,
                                   position - self.prompt + 1, (token,)))
            return
        self._record(entry)

    def _record(self, entry: Entry) -> None:
        assert self.journal is not None
        if entry.start != self.journal.end:
            # A gap (a replacement rebuilt up to here from a snapshot): it can replay from here on only.
            self.journal = Journal(self.schedule)
            self.journal.end = entry.start
        self.journal.record(entry)

    def forwards(self, start: int) -> bool:
        """Whether a frame starting at ``start`` goes on (is sampled, on the tail)."""
        return self.quiet_below is None or start >= self.quiet_below

    def truncate(self, position: int) -> None:
        del self.tokens[max(position, self.prompt):]
        if self.journal is not None:
            self.journal.truncate(position)
        if self.writer is not None:
            self.writer.restart_from(position)
