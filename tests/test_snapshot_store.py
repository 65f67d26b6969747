"""Snapshot segments (bus.snapshot) and what a standby holds of them (actors.node.recovery.snapshot_store), issue
#18."""

from __future__ import annotations

import pytest

from actors.node.recovery.snapshot_store import SnapshotStore
from bus import snapshot as blobs
from schemas.errors import CapacityError, NotFoundError, SnapshotError
from schemas.node import LayerRange
from schemas.snapshot import SnapshotSegment, prefix_hash

LAYERS = LayerRange(start=3, end=6)


def chain(session: str, sizes: list[int], *, start: int = 0) -> list[tuple[SnapshotSegment, bytes]]:
    """Consecutive segments of 10 positions each, with KV blobs of the given sizes."""
    out: list[tuple[SnapshotSegment, bytes]] = []
    parent, at = "", start
    for i, size in enumerate(sizes):
        kv = bytes([i % 251]) * size
        segment = SnapshotSegment(session_id=session, model_id="m", layers=LAYERS, index=i, start=at, end=at + 10,
                                  prefix_hash=prefix_hash(list(range(at + 10))), parent=parent, size=size,
                                  digest=blobs.digest_of(kv))
        out.append((segment, kv))
        parent, at = segment.digest, at + 10
    return out


def test_a_segment_round_trips_and_any_flipped_byte_is_refused() -> None:
    segment, kv = chain("s", [64])[0]
    body = blobs.encode(segment, kv)
    assert blobs.decode(body) == (segment, kv)
    for at in (len(body) - 1, len(body) - 64):
        bad = bytearray(body)
        bad[at] ^= 0x01
        with pytest.raises(SnapshotError, match="fails its sha256"):
            blobs.decode(bytes(bad))
    with pytest.raises(SnapshotError, match="magic"):
        blobs.decode(b"XXXX" + body[4:])
    with pytest.raises(SnapshotError, match="KV bytes"):
        blobs.decode(body[:-1])


def test_prefix_hashes_equal_only_for_equal_token_sequences() -> None:
    assert prefix_hash([1, 2, 3]) == prefix_hash([1, 2, 3]) != prefix_hash([1, 2, 4])
    assert prefix_hash([1, 2]) != prefix_hash([1, 2, 0]) and prefix_hash([256]) != prefix_hash([0, 1])


def test_a_chain_is_taken_only_in_order() -> None:
    store = SnapshotStore(10_000)
    segments = chain("s", [100, 100, 100])
    with pytest.raises(SnapshotError, match="does not continue"):
        store.put(*segments[1])
    for segment, kv in segments:
        store.put(segment, kv)
    assert [s.index for s in store.chain("s", LAYERS)] == [0, 1, 2] and store.bytes_used == 300
    other = chain("s", [50, 50])
    with pytest.raises(SnapshotError, match="does not continue"):
        store.put(*other[1])  # another chain's second segment: its parent is not what is held
    store.put(*other[0])  # a new first segment starts over (the hop's chain restarted)
    assert [s.size for s in store.chain("s", LAYERS)] == [50] and store.bytes_used == 50
    assert store.blob(other[0][0].digest) == other[0]
    with pytest.raises(NotFoundError):
        store.blob(segments[0][0].digest)


def test_the_least_recently_used_chain_goes_first_and_never_half() -> None:
    store = SnapshotStore(1_000)
    for segment, kv in chain("a", [300, 100]):
        store.put(segment, kv)
    for segment, kv in chain("b", [300]):
        store.put(segment, kv)
    store.chain("a", LAYERS)  # read: "a" is the most recent now
    for segment, kv in chain("c", [400]):
        store.put(segment, kv)
    assert store.sessions() == {"a", "c"} and store.evicted_chains == 1 and store.bytes_used == 800
    with pytest.raises(CapacityError, match="exceeds"):
        store.put(*chain("d", [2_000])[0])
    assert store.drop("a") == 1 and store.sessions() == {"c"}
    assert store.chains_of("m", LAYERS)[0][0].session_id == "c" and not store.chains_of("x", LAYERS)
