"""Prefixes across routes (issue #26): a hop that lacks a prompt's prefix asks a node serving the same layers on
another route what it holds of it (``PrefixOfferRequest``), and pulls the offered pieces (``PrefixOffer``, each a
snapshot segment: ``bus.snapshot``) when pulling is cheaper than computing (``actors.node.prefix_pull``)."""

from __future__ import annotations

from pydantic import Field

from schemas.base import WireModel
from schemas.node import LayerRange
from schemas.session import CONTEXT_CAP
from schemas.snapshot import SnapshotSegment


class PrefixOfferRequest(WireModel):
    """What a puller asks a source (``POST /v1/prefixes``): the KV of the longest prefix of ``tokens`` it holds of
    ``model_id``'s ``layers``, from position ``have`` on (the puller holds ``[0, have)`` already)."""

    session_id: str = Field(min_length=1, max_length=64, description="the puller's session (the tracker's grant "
                                                                       "names it)")
    model_id: str = Field(min_length=1)
    layers: LayerRange
    tokens: list[int] = Field(min_length=1, max_length=CONTEXT_CAP)
    have: int = Field(default=0, ge=0)


class PrefixOffer(WireModel):
    """A source's answer: ``reusable`` positions of the request's tokens (0: nothing to offer), their KV in
    ``segments`` from the piece that holds position ``have`` (host pieces start on their chunk boundaries, so the
    first may start below it, and the last may end past ``reusable``: the puller cuts it back)."""

    offer: str = Field(default="", description="names the offer's pieces, ``GET /v1/prefixes/{offer}/{index}``")
    reusable: int = Field(default=0, ge=0)
    token_hash: str = Field(default="", description="schemas.snapshot.prefix_hash of the source's tokens of "
                                                    "[0, reusable): the puller checks them against its prompt")
    segments: list[SnapshotSegment] = Field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(s.size for s in self.segments)

    @property
    def start(self) -> int:
        return self.segments[0].start if self.segments else 0

    @property
    def end(self) -> int:
        return self.segments[-1].end if self.segments else 0
