"""Generation Telemetry: the live view of one Route Session, published on NATS and relayed in the SSE stream."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from schemas.base import WireModel
from schemas.node import LayerRange
from schemas.session import FailureReason, SessionPhase

HopHealth = Literal["ok", "slow", "failed", "unknown"]
RouteHealth = Literal["healthy", "degraded", "failed", "unknown"]


class RouteHopView(WireModel):
    node_id: str
    layers: LayerRange
    health: HopHealth = "ok"
    last_compute_ms: float | None = None
    mean_compute_ms: float | None = None


class PrefillProgress(WireModel):
    done: int = 0
    total: int = 0
    reused: int = Field(default=0, ge=0, exclude_if=lambda v: v == 0,
                        description="prompt positions taken from kept KV instead of computed (prefix reuse)")


RepairSource = Literal["snapshot", "journal", "prefill"]
"""Where a repaired hop's KV came from: a snapshot plus the upstream journal, the journal alone (no snapshot yet),
or the whole prompt and output computed again."""


class RepairView(WireModel):
    """The session's latest route repair (issue #18)."""

    lost_node: str
    layers: LayerRange
    replacement: list[str] = Field(default_factory=list, description="the node(s) that took the layers over; "
                                                                       "empty while the head still looks for one")
    source: RepairSource | None = None
    snapshot_positions: int = 0
    replayed_positions: int = 0
    repairs: int = Field(default=1, ge=1, description="repairs of this session so far")
    duration_ms: float | None = Field(default=None, description="from the loss being found to decode going on")


class SpeculationView(WireModel):
    """How the session's verify windows fare (issue #20)."""

    source: str
    windows: int = 0
    drafts_offered: int = 0
    drafts_accepted: int = 0
    acceptance: float = Field(default=0.0, description="accepted / offered drafts so far")
    mean_accepted: float = Field(default=0.0, description="drafts accepted per window")
    in_flight: int = Field(default=0, description="windows going round the ring now")
    next_k: int = Field(default=0, description="drafts the head will put in its next window (0: plain decoding)")


class QueuePosition(WireModel):
    """Where a request waiting for capacity stands (phase ``queued``, issue #30)."""

    position: int = Field(ge=1, description="1 = admitted at the next free slot")
    waiting: int = Field(ge=1, description="requests waiting for this model on this gateway, this one included")
    eta_s: float | None = Field(default=None, description="position / the measured service rate (sessions "
                                                          "finished per second); None until one has finished")
    waited_s: float = Field(default=0.0, ge=0, description="since the request joined the queue")
    max_wait_s: float = Field(default=0.0, ge=0, description="when the wait reaches it, the request is refused "
                                                             "with 429 queue_timeout")


class QueueStats(WireModel):
    """A gateway's admission queue, published every second while it is in use (``Subjects.gateway_queue``) for
    ``swarmroute watch``; the same figures are Prometheus series at the gateway's ``/metrics``."""

    gateway: str
    waiting: int = 0
    by_model: dict[str, int] = Field(default_factory=dict)
    oldest_wait_s: float = 0.0
    admitted: int = Field(default=0, description="requests admitted after waiting, since the gateway started")
    dropped: dict[str, int] = Field(default_factory=dict, description="requests refused by the queue, by reason: "
                                                                      "full | timeout | displaced | left")
    service_rate: float | None = Field(default=None, description="sessions finished per second, recent")
    sent_at: float = Field(default_factory=time.time)


class GenerationTelemetry(WireModel):
    """One snapshot; ``seq`` increases per session so a subscriber can order and de-duplicate."""

    session_id: str
    seq: int = 0
    phase: SessionPhase
    model: str = ""
    route: list[RouteHopView] = Field(default_factory=list)
    route_health: RouteHealth = "unknown"
    prefill: PrefillProgress = Field(default_factory=PrefillProgress)
    generated_tokens: int = 0
    tokens_per_s: float = Field(default=0.0, description="rolling decode rate over the last few seconds")
    ttft_ms: float | None = None
    hop_overhead_ms: float | None = Field(
        default=None, description="mean per-link cost of a decode step: (step wall time - compute on every hop) / links"
    )
    elapsed_ms: float = 0.0
    failure: FailureReason | None = None
    finish_reason: str | None = None
    repair: RepairView | None = Field(default=None, exclude_if=lambda v: v is None)
    speculation: SpeculationView | None = Field(default=None, exclude_if=lambda v: v is None)
    queue: QueuePosition | None = Field(default=None, exclude_if=lambda v: v is None)
    sent_at: float = Field(default_factory=time.time)
