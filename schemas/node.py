"""What a node tells the swarm about itself: its shard, its backend and its free capacity."""

from __future__ import annotations

import time
from typing import Final, Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from schemas.base import WireModel


class LayerRange(WireModel):
    """A contiguous, half-open range of transformer layers ``[start, end)``."""

    start: int = Field(ge=0)
    end: int = Field(gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> LayerRange:
        if self.end <= self.start:
            raise ValueError(f"layer range end ({self.end}) must be greater than start ({self.start})")
        return self

    def __len__(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"

    @classmethod
    def parse(cls, text: str) -> LayerRange:
        """``START:END`` (half-open, e.g. ``0:12``); ``ValueError`` naming the expected form otherwise."""
        start, sep, end = text.strip().partition(":")
        if not sep or not start.strip().isdigit() or not end.strip().isdigit():
            raise ValueError(f"{text!r} is not a layer range START:END (half-open, e.g. 0:12)")
        if int(end) <= int(start):
            raise ValueError(f"layer range {text!r} is empty: END must be greater than START")
        return cls(start=int(start), end=int(end))


AllLayers = Literal["all"]
ALL_LAYERS: Final[AllLayers] = "all"
"""``--layers all``: every layer of the model, whatever their count. Kept apart from no range at all (``None``, for
which a node joining from the swarm asks the tracker) until the layer count is known, then ``(0, n_layers)``."""


def resolve_layers(layers: tuple[int, int] | AllLayers, n_layers: int) -> tuple[int, int]:
    """An explicit range as ``(start, end)`` of a model of ``n_layers`` layers."""
    return (0, n_layers) if layers == ALL_LAYERS else layers


class BackendInfo(WireModel):
    """Backend metadata shown in advertisements, telemetry and ``/v1/models``."""

    kind: str = Field(description="stub | llamacpp | torch")
    model_name: str = ""
    architecture: str = ""
    file_type: str = Field(default="", description="quantization / dtype, e.g. Q4_K_M")
    n_layers: int = Field(ge=1, description="layers of the whole model, not of this shard")
    hidden_size: int = Field(ge=1)
    hidden_shape: list[int] = Field(description="shape of one position's hidden state on the wire, e.g. [640]")
    n_vocab: int = 0
    context_length: int = Field(ge=1, description="context per session this node serves")
    threads: int = 0
    version: str = Field(default="", description="backend library version, e.g. llama.cpp build")
    artifact_sha256: str = ""
    wire_dtype: str = Field(default="f32", description="dtype of activation frames this node emits: f32 or f16")


class Capacity(WireModel):
    """How many sessions a node can take and how many it holds now."""

    max_sessions: int = Field(ge=1)
    active_sessions: int = Field(default=0, ge=0)
    max_context: int = Field(ge=1, description="tokens of context per session")
    kv_bytes_in_use: int = 0
    sessions_opened: int = Field(default=0, ge=0, description="sessions opened since the node started: tells a "
                                                                  "tracker which of the routes it handed out arrived")
    sessions_refused: int = Field(default=0, ge=0, exclude_if=lambda v: v == 0,
                                  description="sessions routed here that settled without opening: refused at open, "
                                              "or closed before they opened (issue #30)")
    snapshot_free_bytes: int = Field(default=0, ge=0, exclude_if=lambda v: v == 0,
                                     description="room for other nodes' snapshots: the tracker may name this node "
                                                 "a standby holder (issue #18)")
    prefix_keys: list[str] = Field(default_factory=list, exclude_if=lambda v: not v,
                                   description="prefix keys of the finished sessions whose KV this node keeps "
                                               "(schemas.prefix), most recent first: routes prefer them")

    @property
    def free_sessions(self) -> int:
        return max(0, self.max_sessions - self.active_sessions)

    @property
    def sessions_settled(self) -> int:
        """Routes that reached this node and settled, opened or refused: a tracker's reservation ends with them."""
        return self.sessions_opened + self.sessions_refused


class FetchSummary(WireModel):
    """Where a node that is coming up stands: shown in its advertisement while ``state`` is ``fetching``."""

    phase: str = Field(description="checking | fetching | verifying | writing | loading (the shard into the backend)")
    fraction: float = Field(default=0.0, ge=0.0, le=1.0, description="wanted pieces held")
    bytes_downloaded: int = Field(default=0, ge=0)
    bytes_needed: int = Field(default=0, ge=0, description="bytes of the model file the range needs")
    rate_bps: float = Field(default=0.0, ge=0.0)
    peers: int = Field(default=0, ge=0)
    eta_s: float | None = Field(default=None, description="seconds left at the current rate; None while unknown")
    message: str = Field(default="", description="e.g. which layers nobody seeds, or a banned peer")


NODE_SERVING = "serving"
NODE_FETCHING = "fetching"


class NodeAdvertisement(WireModel):
    """A node's heartbeat: republished every few seconds into the registry, which expires it when it stops."""

    node_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")
    endpoint: str = Field(description="base URL of the node's binary HTTP API, e.g. http://127.0.0.1:9101")
    model_id: str = Field(min_length=1, description="content-derived model id (or a name for the stub)")
    layers: LayerRange
    is_head: bool
    is_tail: bool
    backend: BackendInfo
    capacity: Capacity
    verified: bool = Field(default=True, description="the node checked its shard against the artifact manifest")
    manifest_id: str = ""
    aliases: list[str] = Field(default_factory=list, description="other names clients may request the model by")
    state: str = Field(default=NODE_SERVING, description="serving, or fetching: the node is still downloading and "
                                                         "verifying its range (never routed to; its endpoint may be "
                                                         "empty). A string, so a reader tolerates states it does not "
                                                         "know (and routes only to serving)")
    fetch: FetchSummary | None = Field(default=None, description="progress while fetching")
    link_rtt_ms: dict[str, float] = Field(default_factory=dict, exclude_if=lambda v: not v,
                                          description="data-plane round trip (ms) to each node this one routes to or "
                                                      "from, by node id: GET /health on a kept-alive connection, the "
                                                      "least of a few tries (actors.node.link_probe)")
    fingerprint: str = Field(default="", exclude_if=lambda v: not v, pattern=r"^([0-9a-f]{64})?$",
                             description="SHA-256 of the node's data-plane public key (issue #29), pinned in its "
                                         "https endpoint: peers accept only this key for this node id")
    certificate: str = Field(default="", exclude_if=lambda v: not v, max_length=8192,
                             description="the node's certificate (PEM) for that key: node servers trust it")
    build_id: str = Field(default="", exclude_if=lambda v: not v,
                          description="the backend build (issue #28): library version and build flags / CPU "
                                      "features, e.g. llama.cpp's system info, or torch's version; nodes of one "
                                      "build must agree exactly in spot checks")
    kernels_id: str = Field(default="", exclude_if=lambda v: not v,
                            description="the backend's kernel family (issue #28): the same library version and "
                                        "kernels, any CPU features; nodes of one family agree within the narrow "
                                        "band of spot checks, nodes of different families only within the wide one")
    rss_bytes: int = Field(default=0, ge=0, exclude_if=lambda v: v == 0,
                           description="resident memory of the node's process: weights, KV, everything")
    started_at: float = Field(default_factory=time.time)
    sent_at: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _pinned(self) -> NodeAdvertisement:
        """An endpoint's pin (``https://<fingerprint>@host:port``) is the advertised fingerprint, or there is none."""
        user, at, _ = urlsplit(self.endpoint).netloc.rpartition("@")
        if at and user != self.fingerprint:
            raise ValueError("the endpoint's key pin differs from the advertised fingerprint")
        return self
