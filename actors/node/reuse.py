"""Prefix reuse on one node (issue #18): keep a completed session's KV, and start a new session from the longest
kept prefix of its prompt, or from a snapshot chain this node holds as a standby for the same layers (a node that
never saw the session then reuses it too).

The KV moves through the backend's ``export_kv`` / ``import_kv`` one chunk at a time, each on the worker between
forward passes, so keeping or reusing a long conversation never stalls other sessions for more than a chunk.
"""

from __future__ import annotations

import logging

from actors.backend import KvBackend
from actors.node.engine import StepEngine
from actors.node.prefix_cache import Kept, PrefixCache, reusable
from actors.node.recovery.snapshot_store import SnapshotStore
from schemas.node import LayerRange
from schemas.snapshot import SnapshotSegment, prefix_hash

log = logging.getLogger(__name__)


class Reuse:
    def __init__(self, engine: StepEngine, cache: PrefixCache, held: SnapshotStore, *, model_id: str,
                 layers: LayerRange) -> None:
        self._engine = engine
        self.cache = cache
        self._held = held
        self._model_id = model_id
        self._layers = layers

    @property
    def _kv(self) -> KvBackend | None:
        backend = self._engine.backend
        return backend if isinstance(backend, KvBackend) else None

    @property
    def enabled(self) -> bool:
        return self.cache.enabled and self._kv is not None

    async def keep(self, session_id: str, tokens: list[int], position: int, chunk: int, token: str | None) -> None:
        """Export a completed session's KV (positions ``[0, position)``) into the cache, before it is freed."""
        kv = self._kv
        if kv is None or not self.cache.enabled or position <= 0 or len(tokens) < position:
            return
        pieces = [await self._engine.call(kv.export_kv, session_id, start, min(start + chunk, position))
                  for start in range(0, position, chunk)]
        self.cache.keep(session_id, Kept(tokens=tokens[:position], pieces=pieces, chunk=chunk, token=token))

    def reusable(self, prompt: list[int], chunk: int) -> int:
        """How many positions of ``prompt`` this node could give a new session (nothing is imported)."""
        if self._kv is None or not self.cache.enabled:
            return 0
        kept = self.cache.match(prompt, chunk)
        seeded = self._seed(prompt, chunk)
        return max(kept[1] if kept is not None else 0, seeded[1] if seeded is not None else 0)

    async def start(self, session_id: str, prompt: list[int], chunk: int, limit: int | None) -> int:
        """Give a just-opened session (at position 0) the longest prefix of ``prompt`` this node can rebuild, at
        most ``limit`` positions; returns how many (0: it prefills from the start)."""
        kv = self._kv
        if kv is None or not self.cache.enabled:
            return 0
        kept = self.cache.match(prompt, chunk)
        seeded = self._seed(prompt, chunk)
        n_kept = kept[1] if kept is not None else 0
        n_seed = seeded[1] if seeded is not None else 0
        want = max(n_kept, n_seed)
        if limit is not None:
            want = min(want, limit) // chunk * chunk if chunk else 0
        if want <= 0:
            return 0
        if kept is not None and n_kept >= want:
            entry = kept[0]
            await self._engine.call(kv.import_kv, session_id, entry.pieces[:want // chunk], want)
        else:
            assert seeded is not None
            segments, end = seeded[0], seeded[2]
            blobs = [self._held.blob(s.digest)[1] for s in segments]
            await self._engine.call(kv.import_kv, session_id, blobs, end)
            if end > want:
                await self._engine.call(kv.truncate, session_id, want)
        if not await self._engine.call(kv.kv_continues, session_id):
            log.info("session %s: the reused KV lacks windowed cells; prefilling from the start", session_id[:8])
            await self._engine.call(kv.truncate, session_id, 0)
            return 0
        return want

    def _seed(self, prompt: list[int], chunk: int) -> tuple[list[SnapshotSegment], int, int] | None:
        """The held snapshot chain of this node's layers whose tokens ``prompt`` extends the furthest: its
        segments to import, the positions that reuses, and where those segments end."""
        best: tuple[list[SnapshotSegment], int, int] | None = None
        for chain in self._held.chains_of(self._model_id, self._layers):
            usable: list[SnapshotSegment] = []
            for segment in chain:
                if segment.end > len(prompt) or prefix_hash(prompt[:segment.end]) != segment.prefix_hash:
                    break
                usable.append(segment)
            if not usable:
                continue
            n = reusable(usable[-1].end, len(prompt), chunk)
            if n > 0 and (best is None or n > best[1]):
                best = (usable, n, usable[-1].end)
        return best
