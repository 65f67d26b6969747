"""A hop's snapshot chain for one session (issue #18): at every boundary of the session's schedule (the end of
prefill, then every ``snapshot_every`` decoded positions) the positions added since the last segment are exported
from the backend and handed to the hop's standby holder, off the per-token path.

The export runs on the backend's worker between two forward passes (``StepEngine.call``), so it reads exactly the
positions of its range whatever steps follow; hashing and sending run on the loop, one segment at a time, in order.
A segment the standby did not take breaks the chain: the next boundary starts a new one from position 0, so what
the standby holds always rebuilds one consistent KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from actors.node.recovery.journal import SnapshotSchedule
from actors.node.runtime import NodeRuntime
from bus import snapshot as blobs
from schemas.errors import SwarmrouteError
from schemas.node import LayerRange
from schemas.snapshot import SnapshotSegment, StandbyRef, prefix_hash

log = logging.getLogger(__name__)


class SnapshotWriter:
    def __init__(self, rt: NodeRuntime, session_id: str, *, schedule: SnapshotSchedule, standby: StandbyRef,
                 layers: LayerRange, model_id: str, manifest_id: str, tokens: Callable[[], Sequence[int]],
                 session_token: Callable[[], str | None]) -> None:
        self._rt = rt
        self._session_id = session_id
        self.schedule = schedule
        self.standby = standby
        self._layers = layers
        self._model_id = model_id
        self._manifest_id = manifest_id
        self._tokens = tokens
        """The token ids of the session's KV positions so far (prefix hashes)."""
        self._session_token = session_token
        self._queue: asyncio.Queue[int] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._queued_to = 0
        """The end position of the last segment queued."""
        self._last: SnapshotSegment | None = None
        """The last segment the standby took (None: the next one starts a new chain)."""
        self.segments_sent = 0
        self.bytes_sent = 0
        self.failures = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"snapshots-{self._session_id[:8]}")

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    @property
    def end(self) -> int:
        """Where the chain the standby holds ends."""
        return self._last.end if self._last is not None else 0

    def after_step(self, position: int) -> None:
        """The session's KV now ends at ``position``: queue a segment if a boundary was reached."""
        if position > self._queued_to and self.schedule.due(position):
            self._queued_to = position
            self._queue.put_nowait(position)

    def seed(self, position: int) -> None:
        """The session starts from ``position`` reused positions (prefix reuse): hand them to the standby now, as
        the chain's first segment, since no journal can rebuild what this session never computed."""
        if position > self._queued_to:
            self._queued_to = position
            self._queue.put_nowait(position)

    def restart_from(self, position: int) -> None:
        """The session's KV was cut back to ``position`` (a repair truncated it): segments beyond are void."""
        if self._last is not None and self._last.end > position:
            self._last = None
        self._queued_to = min(self._queued_to, position)

    async def _run(self) -> None:
        while True:
            end = await self._queue.get()
            try:
                await self._send(end)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a lost snapshot costs a fallback later, never the session
                self.failures += 1
                self._last = None
                self._rt.metrics.snapshot_failures.inc()
                log.warning("session %s: snapshot up to position %d not taken by %s: %s", self._session_id[:8],
                            end, self.standby.node_id, exc if isinstance(exc, SwarmrouteError) else repr(exc))

    async def _send(self, end: int) -> None:
        last = self._last
        start = last.end if last is not None else 0
        if end <= start:
            return
        kv = await self._rt.engine.call(self._export, start, end)
        tokens = self._tokens()
        segment = SnapshotSegment(
            session_id=self._session_id, model_id=self._model_id, manifest_id=self._manifest_id, layers=self._layers,
            index=last.index + 1 if last is not None else 0, start=start, end=end,
            prefix_hash=prefix_hash(tokens[:end]), parent=last.digest if last is not None else "",
            backend=self._rt.engine.backend.info.version, size=len(kv), digest=blobs.digest_of(kv))
        body = blobs.encode(segment, kv)
        await self._rt.client.put_snapshot(self.standby.node_id, self.standby.endpoint, body,
                                           capability=self.standby.capability if segment.index == 0 else "",
                                           session_token=self._session_token(),
                                           timeout=self._rt.settings.hop_timeout_s)
        self._last = segment
        self.segments_sent += 1
        self.bytes_sent += len(kv)
        self._rt.metrics.snapshot_bytes.inc(len(kv))

    def _export(self, start: int, end: int) -> bytes:
        backend = self._rt.engine.backend
        export = getattr(backend, "export_kv", None)
        if export is None:
            raise SwarmrouteError(f"the {backend.info.kind} backend cannot export KV")
        data: bytes = export(self._session_id, start, end)
        return data

    async def close(self) -> None:
        """Stop, and have the standby forget the chain: a session that ended is never repaired."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._queued_to:  # a segment may have reached the standby even if its answer did not come back
            with contextlib.suppress(Exception):
                await self._rt.client.drop_snapshots(self.standby.node_id, self.standby.endpoint, self._session_id,
                                                     session_token=self._session_token(), timeout=1.0)
