"""Layer assignment: a node joining with only a model id asks a tracker which range to serve, and the range is held
as a lease in JetStream KV while the node fetches and serves it (docs/artifacts.md, "Joining with a model id")."""

from __future__ import annotations

import time

from pydantic import Field

from schemas.base import WireModel
from schemas.node import LayerRange

_HEX64 = r"^[0-9a-f]{64}$"
_NODE_ID = r"^[A-Za-z0-9_-]+$"


class AssignmentRequest(WireModel):
    """Sent by a node on ``Subjects.assign_request``: who it is, which model, and what it can hold."""

    node_id: str = Field(min_length=1, max_length=128, pattern=_NODE_ID)
    model_id: str = Field(pattern=_HEX64, description="sha256 of the GGUF (the artifact's content id)")
    manifest_id: str = Field(pattern=_HEX64, description="the manifest the node verified; the tracker fetches the "
                                                         "same one from the swarm and checks its content hash")
    memory_bytes: int = Field(ge=1, description="memory the node gives the model: weights plus KV")
    max_sessions: int = Field(default=4, ge=1, description="KV slots the node will hold (sizes the KV share)")
    context: int = Field(default=4096, ge=1, description="tokens of context per session")
    allow_unproven: bool = Field(default=False, description="the node accepts cuts of an unproven architecture")
    prefer: list[LayerRange] = Field(default_factory=list, description="ranges the node already holds (a verified "
                                                                       "shard) or was given before: chosen among "
                                                                       "equally good ranges, so a restart resumes")


class AssignmentReply(WireModel):
    """The tracker's answer: a range and the lease that holds it, or an error (status + message)."""

    layers: LayerRange | None = None
    lease_key: str = ""
    lease_revision: int = Field(default=0, ge=0, description="the lease entry's KV revision: the node renews it "
                                                             "with an update against this revision")
    reason: str = Field(default="", description="complete (finishes a route), extend (covers uncovered layers, a "
                                                "route needs more nodes), replica (adds capacity)")
    detail: str = Field(default="", description="the decision in words, for the node's log")
    uncovered: list[LayerRange] = Field(default_factory=list, description="layers no live node or lease covered "
                                                                          "before this assignment")
    error: str | None = None
    status: int = 200


class RangeLease(WireModel):
    """The value of a lease key ``<model_id>.<start>-<end>.<slot>`` in the lease bucket: this node brings up, or
    serves, ``[start, end)``. It expires with the bucket's TTL unless the node renews it."""

    node_id: str = Field(min_length=1, max_length=128, pattern=_NODE_ID)
    model_id: str = Field(pattern=_HEX64)
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    slot: int = Field(default=0, ge=0, description="replica slot: several nodes may lease one range, one per slot")
    granted_at: float = Field(default_factory=time.time)
    renewed_at: float = Field(default_factory=time.time)

    @property
    def layers(self) -> LayerRange:
        return LayerRange(start=self.start, end=self.end)
