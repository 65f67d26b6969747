"""Prefix Snapshots (issue #18): one node's KV of a range of a session's positions, as a content-addressed segment.

A session's snapshot on one hop is a chain of segments: the first covers the prompt (taken at the end of prefill),
each next one the positions decoded since (taken every ``Settings.snapshot_every`` positions). Each segment holds
only the positions it adds, so the chain costs the session's KV once. A segment names what it belongs to (model,
manifest, layer range, session) and the tokens it covers (``prefix_hash`` chains the hashes of every token up to
its ``end``), and its ``digest`` is the sha256 of its bytes: a holder refuses a segment whose bytes do not hash to
it, and a node rebuilding a session refuses a chain that does not link up.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from pydantic import Field

from schemas.base import WireModel
from schemas.node import LayerRange

_PREFIX_DOMAIN = b"swarmroute-prefix-v1"


def prefix_hash(tokens: Sequence[int]) -> str:
    """sha256 over the token ids as little-endian u32: equal token sequences (and only those, up to sha256) hash
    equal. ~10 us for 2,000 tokens."""
    return hashlib.sha256(_PREFIX_DOMAIN + struct.pack(f"<{len(tokens)}I", *tokens)).hexdigest()


class SnapshotSegment(WireModel):
    """The metadata of one segment; its bytes (the backend's KV blob) travel beside it (``bus.snapshot``)."""

    session_id: str = Field(min_length=1, max_length=64)
    model_id: str = Field(min_length=1)
    manifest_id: str = ""
    layers: LayerRange
    index: int = Field(ge=0, description="0 for the prompt's segment, then one more per segment")
    start: int = Field(ge=0, description="first position the segment holds")
    end: int = Field(gt=0, description="one past its last position")
    prefix_hash: str = Field(min_length=64, max_length=64, description="hash of the tokens of positions [0, end)")
    parent: str = Field(default="", description="digest of the previous segment of the chain; empty for index 0")
    backend: str = Field(default="", description="backend kind and version that wrote the KV bytes")
    size: int = Field(ge=0, description="bytes of the KV blob")
    digest: str = Field(min_length=64, max_length=64, description="sha256 of the KV blob: the content address")


class SnapshotList(WireModel):
    """What a holder keeps of one session's hop (``GET /v1/snapshots``): its chain, oldest first."""

    segments: list[SnapshotSegment] = Field(default_factory=list)

    @property
    def end(self) -> int:
        return self.segments[-1].end if self.segments else 0


class StandbyRef(WireModel):
    """Where a hop's snapshots go: a node holding them for the hop (ideally one serving the same range, which can
    then take the hop over without moving a byte). ``capability`` is its signed grant when the swarm has a secret."""

    node_id: str
    endpoint: str
    capability: str = ""
    layers: LayerRange | None = Field(default=None, description="the layers the standby serves itself (issue #31: "
                                                                "a head snapshots only to a spare that can take it "
                                                                "over)")
