"""The snapshots a node holds for other nodes' sessions (it is their standby holder), within a byte budget.

One chain per (session, layer range): segments are accepted only in order, each continuing the last one held
(``parent`` is its digest, ``start`` its ``end``), so what a holder serves always rebuilds one consistent KV. The
least recently written or read chains go first when the budget is full; a chain is never half evicted.
"""

from __future__ import annotations

import collections
import dataclasses

from bus import snapshot as blobs
from schemas.errors import CapacityError, NotFoundError, SnapshotError
from schemas.node import LayerRange
from schemas.snapshot import SnapshotSegment

ChainKey = tuple[str, int, int]
"""(session id, first layer, end layer)."""


def chain_key(session_id: str, layers: LayerRange) -> ChainKey:
    return session_id, layers.start, layers.end


@dataclasses.dataclass
class _Chain:
    segments: list[SnapshotSegment] = dataclasses.field(default_factory=list)
    blobs: list[bytes] = dataclasses.field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(len(b) for b in self.blobs)


class SnapshotStore:
    """Not thread-safe: used from the node's event loop."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._chains: collections.OrderedDict[ChainKey, _Chain] = collections.OrderedDict()
        self._by_digest: dict[str, tuple[ChainKey, int]] = {}
        self.bytes_used = 0
        self.evicted_chains = 0

    def put(self, segment: SnapshotSegment, kv: bytes) -> None:
        """Keep one segment (its bytes already checked against its digest, ``bus.snapshot.decode``)."""
        blobs.check(segment, kv)
        key = chain_key(segment.session_id, segment.layers)
        chain = self._chains.get(key)
        if segment.index == 0:
            if segment.start != 0 or segment.parent:
                raise SnapshotError("a chain's first segment starts at position 0 and has no parent")
            if chain is not None:
                self._forget(key)  # the hop started over (a session rebuilt from scratch)
            chain = _Chain()
        else:
            last = chain.segments[-1] if chain is not None and chain.segments else None
            if last is None or last.index != segment.index - 1 or last.digest != segment.parent \
                    or last.end != segment.start:
                held = f"segment {last.index} ending at {last.end}" if last else "nothing"
                raise SnapshotError(f"segment {segment.index} of session {segment.session_id} (from position "
                                    f"{segment.start}) does not continue the chain held here ({held})")
        if len(kv) > self.budget_bytes:
            raise CapacityError(f"a {len(kv)}-byte snapshot segment exceeds this node's snapshot budget of "
                                f"{self.budget_bytes} bytes")
        assert chain is not None
        self._make_room(len(kv), keep=key)
        chain.segments.append(segment)
        chain.blobs.append(kv)
        self._chains[key] = chain
        self._chains.move_to_end(key)
        self._by_digest[segment.digest] = (key, len(chain.blobs) - 1)
        self.bytes_used += len(kv)

    def chain(self, session_id: str, layers: LayerRange) -> list[SnapshotSegment]:
        key = chain_key(session_id, layers)
        chain = self._chains.get(key)
        if chain is None:
            return []
        self._chains.move_to_end(key)
        return list(chain.segments)

    def blob(self, digest: str) -> tuple[SnapshotSegment, bytes]:
        where = self._by_digest.get(digest)
        if where is None:
            raise NotFoundError(f"no snapshot segment {digest[:16]}... is held here", code="snapshot_not_found")
        key, i = where
        chain = self._chains[key]
        self._chains.move_to_end(key)
        return chain.segments[i], chain.blobs[i]

    def drop(self, session_id: str) -> int:
        """Forget every chain of a session; returns how many."""
        keys = [k for k in self._chains if k[0] == session_id]
        for key in keys:
            self._forget(key)
        return len(keys)

    def chains_of(self, model_id: str, layers: LayerRange) -> list[list[SnapshotSegment]]:
        """Every chain held of ``model_id``'s ``layers`` (prefix reuse seeded from snapshots)."""
        return [list(c.segments) for k, c in self._chains.items()
                if (k[1], k[2]) == (layers.start, layers.end) and c.segments and c.segments[0].model_id == model_id]

    def sessions(self) -> set[str]:
        return {k[0] for k in self._chains}

    def _make_room(self, size: int, *, keep: ChainKey) -> None:
        while self.bytes_used + size > self.budget_bytes:
            victim = next((k for k in self._chains if k != keep), None)
            if victim is None:
                raise CapacityError(f"the session's snapshot chain outgrew this node's snapshot budget of "
                                    f"{self.budget_bytes} bytes")
            self._forget(victim)
            self.evicted_chains += 1

    def _forget(self, key: ChainKey) -> None:
        chain = self._chains.pop(key)
        for segment in chain.segments:
            self._by_digest.pop(segment.digest, None)
        self.bytes_used -= chain.size
