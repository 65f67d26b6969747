"""Prefix reuse on one node (issue #18; token-exact and resident since issue #26): keep a completed session's KV,
and start a new session from the longest kept token prefix of its prompt, or from a snapshot chain this node holds
as a standby for the same layers (a node that never saw the session then reuses it too).

A backend that can keep a finished session's sequence in its context (``ResidentKv``: llama.cpp) parks it there:
keeping costs no copy, and a new session adopts the cells of its common prefix in one call, as llama-server's slots
reuse theirs. When every slot is taken the least recently used resident entry is demoted: its KV is exported into
host pieces and its sequence freed. Host pieces (any ``KvBackend``) move through ``export_kv`` / ``import_kv`` one
chunk at a time, each on the worker between forward passes, so keeping or reusing a long conversation never stalls
other sessions for more than a chunk; a prefix that ends inside a piece imports that piece and cuts the rest off.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from actors.backend import KvBackend
from actors.node.engine import StepEngine
from actors.node.prefix_cache import Kept, PrefixCache, piece_digest, reusable
from actors.node.recovery.snapshot_store import SnapshotStore
from schemas.errors import SnapshotError
from schemas.node import LayerRange
from schemas.snapshot import SnapshotSegment, prefix_hash


@runtime_checkable
class ResidentKv(Protocol):
    """A backend that keeps finished sessions' KV in place (``actors.backends.llamacpp.resident``)."""

    @property
    def resident_slots(self) -> int: ...

    def park_session(self, session_id: str, handle: str) -> bool: ...

    def parked_prefixes(self) -> dict[str, int]: ...

    def adopt_parked(self, handle: str, session_id: str, n: int) -> None: ...

    def export_parked(self, handle: str, start: int, end: int) -> bytes: ...

    def drop_parked(self, handle: str) -> None: ...


log = logging.getLogger(__name__)

MIN_TOKEN_REUSE = 16
"""Fewest positions reused down to the token: a prompt that shares only its first few tokens with a kept one (the
BOS, a chat template's opening) saves nothing worth its rounding (its rest then computes after adopted cells, in
another batch shape than a cold run's) and computes cold instead."""


@dataclasses.dataclass(frozen=True)
class Shared:
    """What this node gives a puller of a prefix (issue #26, prefixes across routes): ``reusable`` positions of its
    prompt, as KV pieces of positions ``bounds`` (each piece's sha256 in ``digests``: a host piece's as it was
    kept, so a piece that changed since fails at the puller), and the kept tokens they hold."""

    reusable: int
    tokens: list[int]
    bounds: list[tuple[int, int]]
    blobs: list[bytes]
    digests: list[str]


class Reuse:
    def __init__(self, engine: StepEngine, cache: PrefixCache, held: SnapshotStore, *, model_id: str,
                 layers: LayerRange, by_token: bool = True) -> None:
        self.by_token = by_token
        """Down to the token, resident where the backend can park (``prefix_reuse = token``); else whole chunks of
        host pieces (``chunk``)."""
        self._engine = engine
        self.cache = cache
        self._held = held
        self._model_id = model_id
        self._layers = layers
        self.rejected = 0
        """Kept prefixes dropped because they failed their hashes."""

    @property
    def _kv(self) -> KvBackend | None:
        backend = self._engine.backend
        return backend if isinstance(backend, KvBackend) else None

    @property
    def enabled(self) -> bool:
        return self.cache.enabled and self._kv is not None

    @property
    def _resident(self) -> ResidentKv | None:
        backend = self._engine.backend
        if self.by_token and isinstance(backend, ResidentKv) and backend.resident_slots > 0:
            return backend
        return None

    async def keep(self, session_id: str, tokens: list[int], position: int, chunk: int, token: str | None, *,
                   invariant: bool = False) -> None:
        """Keep a completed session's KV (positions ``[0, position)``) before it is freed: parked in the backend
        where it can, else (and for a batch-invariant session, ``invariant``, which later ones of its kind reuse)
        exported into host pieces."""
        kv = self._kv
        if kv is None or not self.cache.enabled or position <= 0 or len(tokens) < position:
            return
        entry = Kept(tokens=tokens[:position], pieces=[], chunk=chunk, token=token)
        resident = self._resident
        if resident is not None and not invariant:
            await self._make_room(resident)
            entry.resident = await self._engine.call(resident.park_session, session_id, session_id)
        if not entry.resident:
            entry.with_pieces([await self._engine.call(kv.export_kv, session_id, start, min(start + chunk, position))
                               for start in range(0, position, chunk)])
        await self._forget(self.cache.keep(session_id, entry))

    async def _make_room(self, resident: ResidentKv) -> None:
        """Every resident slot taken: demote the least recently used resident entry to host pieces."""
        names = self.cache.resident()
        parked = await self._engine.call(resident.parked_prefixes)
        for name in names:
            if name not in parked:  # the backend evicted it under memory pressure
                self._lost(name)
        names = [n for n in names if n in parked]
        if len(parked) < resident.resident_slots or not names:
            return
        name = names[0]
        entry = self.cache.get(name)
        assert entry is not None
        try:
            end = len(entry.tokens)
            entry.with_pieces([await self._engine.call(resident.export_parked, name, start, min(start + entry.chunk,
                                                                                                  end))
                               for start in range(0, end, entry.chunk)])
        except SnapshotError:
            self.cache.discard(name)
        await self._engine.call(resident.drop_parked, name)
        await self._forget(self.cache.fit())

    def _lost(self, name: str) -> None:
        entry = self.cache.get(name)
        if entry is not None and entry.resident:
            entry.resident = False
            if not entry.pieces:
                self.cache.discard(name)

    async def _forget(self, gone: list[tuple[str, Kept]]) -> None:
        """Free the resident sequences of entries the cache dropped."""
        resident = self._resident
        for name, entry in gone:
            if entry.resident and resident is not None:
                await self._engine.call(resident.drop_parked, name)

    def _whole(self, n: int, chunk: int, invariant: bool = False) -> int:
        """``n`` reusable positions as this node reuses them for a session: all (``_by_token``), or whole chunks."""
        if self._by_token(invariant):
            return n if n >= MIN_TOKEN_REUSE else 0
        return n if chunk <= 0 else n // chunk * chunk

    def _match(self, prompt: list[int], invariant: bool) -> tuple[str, Kept, int] | None:
        """The kept entry to start ``prompt`` from. A session that must compute as a cold run does (``invariant``:
        batch invariant) takes no parked sequence: its cells lie elsewhere than a cold run's would."""
        kept = self.cache.match(prompt)
        if kept is not None and kept[1].resident and not self._by_token(invariant):
            return None
        return kept

    def _by_token(self, invariant: bool) -> bool:
        """Reuse down to the token: this node does (``prefix_reuse = token``) and the session may (it is not
        batch ``invariant``)."""
        return self.by_token and not invariant

    def reusable(self, prompt: list[int], chunk: int, *, invariant: bool = False) -> int:
        """How many positions of ``prompt`` this node could give a new session (nothing is imported);
        ``invariant``: a batch-invariant session, which takes whole chunks of host pieces only."""
        if self._kv is None or not self.cache.enabled:
            return 0
        kept = self._match(prompt, invariant)
        seeded = self._seed(prompt)
        return self._whole(max(kept[2] if kept is not None else 0, seeded[1] if seeded is not None else 0), chunk,
                           invariant)

    async def start(self, session_id: str, prompt: list[int], chunk: int, limit: int | None, *,
                    invariant: bool = False) -> int:
        """Give a just-opened session (at position 0) the longest prefix of ``prompt`` this node can rebuild, at
        most ``limit`` positions; returns how many (0: it prefills from the start). A kept entry that fails its
        hashes is dropped, never used. ``invariant`` as for ``reusable``."""
        kv = self._kv
        if kv is None or not self.cache.enabled:
            return 0
        kept = self._match(prompt, invariant)
        seeded = self._seed(prompt)
        n_kept = kept[2] if kept is not None else 0
        n_seed = seeded[1] if seeded is not None else 0
        want = max(n_kept, n_seed)
        if limit is not None:
            want = min(want, limit)
        want = self._whole(want, chunk, invariant)
        if want <= 0:
            return 0
        took = 0
        if kept is not None and n_kept >= want:
            took = await self._from_entry(session_id, kept[0], kept[1], want)
        if not took and seeded is not None and n_seed >= want:
            segments, end = seeded[0], seeded[2]
            blobs = [self._held.blob(s.digest)[1] for s in segments]
            took = want if await self._engine.call(self._place, session_id,
                                                   lambda: kv.import_kv(session_id, blobs, end), end, want) else 0
        return took

    async def share(self, prompt: list[int], have: int) -> Shared | None:
        """The KV this node kept of the longest prefix of ``prompt``, from the piece holding position ``have`` on
        (a resident entry's exported from ``have`` exactly, in pieces of its chunk); None if it holds no more than
        ``have`` positions of it."""
        if self._kv is None or not self.cache.enabled:
            return None
        kept = self.cache.match(prompt)
        if kept is None or kept[2] <= have:
            return None
        name, entry, n = kept
        resident, chunk = self._resident, max(entry.chunk, 1)
        if entry.resident and resident is not None:
            bounds = [(a, min(a + chunk, n)) for a in range(have, n, chunk)]
            try:
                blobs = [await self._engine.call(resident.export_parked, name, a, b) for a, b in bounds]
                return Shared(n, entry.tokens, bounds, blobs, [piece_digest(b) for b in blobs])
            except SnapshotError:
                self._lost(name)  # evicted under memory pressure since
        first, last = have // chunk, -(-n // chunk)
        if not entry.pieces or last > len(entry.pieces):
            return None
        bounds = [(i * chunk, min((i + 1) * chunk, len(entry.tokens))) for i in range(first, last)]
        return Shared(n, entry.tokens, bounds, entry.pieces[first:last], entry.digests[first:last])

    async def _from_entry(self, session_id: str, name: str, entry: Kept, want: int) -> int:
        """Positions ``[0, want)`` of kept ``entry`` into the session: adopted from its parked sequence, or imported
        from its host pieces; 0 when it cannot be used (the session is then still at 0)."""
        kv = self._kv
        assert kv is not None
        if not entry.intact(want):
            log.warning("session %s: kept prefix %s fails its hash; recomputing it", session_id[:8], name[:8])
            self.rejected += 1
            await self._forget([(name, entry)] if self.cache.discard(name) is not None else [])
            return 0
        resident = self._resident
        if entry.resident and resident is not None:
            try:
                adopt = lambda: resident.adopt_parked(name, session_id, want)  # noqa: E731
                return want if await self._engine.call(self._place, session_id, adopt, want, want) else 0
            except SnapshotError:
                self._lost(name)  # evicted under memory pressure since
                if not entry.pieces:
                    return 0
        pieces = -(-want // entry.chunk)
        end = min(pieces * entry.chunk, len(entry.tokens))
        try:
            load = lambda: kv.import_kv(session_id, entry.pieces[:pieces], end)  # noqa: E731
            return want if await self._engine.call(self._place, session_id, load, end, want) else 0
        except SnapshotError as exc:  # the backend refused it (import_kv leaves the session as it was)
            log.warning("session %s: kept prefix %s not imported (%s); recomputing it", session_id[:8], name[:8], exc)
            self.cache.discard(name)
            return 0

    async def place_pulled(self, session_id: str, blobs: list[bytes], start: int, end: int, want: int) -> bool:
        """Pulled pieces of positions ``[start, end)`` into the session (issue #26), which holds ``start`` or more
        positions (it is cut back to ``start`` first), then cut to ``want``; False, with the session back at 0, when
        the result lacks windowed cells its next position attends to. ``SnapshotError`` if the backend refuses the
        pieces (the session then holds ``[0, start)``)."""
        kv = self._kv
        assert kv is not None

        def load() -> None:
            kv.truncate(session_id, start)
            kv.import_kv(session_id, blobs, end)

        return await self._engine.call(self._place, session_id, load, end, want)

    async def cut(self, session_id: str, position: int, want: int) -> int:
        """Cut a session holding ``position`` positions back to ``want``; its new position (0 when what is left
        lacks windowed cells its next position attends to)."""
        if want >= position:
            return position
        return want if await self._engine.call(self._place, session_id, lambda: None, position, want) else 0

    def whole(self, n: int, chunk: int) -> int:
        return self._whole(n, chunk)

    def _place(self, session_id: str, load: Callable[[], None], end: int, want: int) -> bool:
        """On the worker, in one call (no other step between): ``load`` positions ``[0, end)`` into the session,
        cut them to ``want``, and check the result continues; False, with the session back at 0, when it lacks
        windowed cells its next position attends to."""
        kv = self._kv
        assert kv is not None
        load()
        if end > want:
            kv.truncate(session_id, want)
        if kv.kv_continues(session_id):
            return True
        log.info("session %s: the reused KV lacks windowed cells; prefilling from the start", session_id[:8])
        kv.truncate(session_id, 0)
        return False

    def _seed(self, prompt: list[int]) -> tuple[list[SnapshotSegment], int, int] | None:
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
            n = reusable(usable[-1].end, len(prompt))
            if n > 0 and (best is None or n > best[1]):
                best = (usable, n, usable[-1].end)
        return best
