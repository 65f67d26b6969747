"""Artifact swarm messages on NATS: who seeds what (peer announcements) and how a fetch is going (progress)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from schemas.base import WireModel
from schemas.node import LayerRange


class ArtifactPeer(WireModel):
    """A node that holds (part of) a model artifact and seeds it over BitTorrent at ``host:port``.

    Published on ``artifact_peers(model_id)`` and sent in reply to ``artifact_peer_query(model_id)``. ``ranges``
    lists only layer ranges the node has verified against the manifest; an unverified range is never listed.
    """

    node_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")
    model_id: str
    manifest_id: str
    host: str = Field(description="torrent listen address: loopback or a private address, never public")
    port: int = Field(ge=1, le=65535)
    ranges: list[LayerRange] = Field(default_factory=list, description="verified servable layer ranges")
    complete: float = Field(default=0.0, ge=0.0, le=1.0, description="fraction of the file's pieces held")
    sent_at: float = Field(default_factory=time.time)


FetchPhase = Literal["checking", "fetching", "verifying", "writing", "done", "failed", "seeding"]


class FetchProgress(WireModel):
    """One node's partial fetch of a layer range; published on ``artifact_progress(node_id)``."""

    node_id: str = ""
    model_id: str
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    phase: FetchPhase
    pieces_done: int = 0
    pieces_wanted: int = 0
    bytes_downloaded: int = Field(default=0, description="payload bytes received by this process (all peers)")
    bytes_needed: int = Field(default=0, description="bytes of the file the range needs (tensors + header)")
    bytes_wanted: int = Field(default=0, description="bytes of the pieces holding them (>= needed)")
    rate_bps: float = 0.0
    peers: int = 0
    hash_failures: int = Field(default=0, description="pieces that failed their SHA-1 and were fetched again")
    message: str = ""
    banned_peers: list[str] = Field(default_factory=list, description="peers banned for sending pieces that failed "
                                                                      "their SHA-1: 'node-id (HOST:PORT)' when the "
                                                                      "swarm's announcements name the address, else "
                                                                      "HOST:PORT")
    unseeded_layers: list[LayerRange] = Field(default_factory=list, description="layers with pieces this node still "
                                                                                "needs that no connected peer has")
    unseeded_parts: list[str] = Field(default_factory=list, description="the same for what is not a layer: header "
                                                                        "(tokenizer), token embedding, output, shared")
    eta_s: float | None = Field(default=None, description="seconds left at the current rate; None while unknown")
    sent_at: float = Field(default_factory=time.time)

    @property
    def fraction(self) -> float:
        return self.pieces_done / self.pieces_wanted if self.pieces_wanted else 1.0
