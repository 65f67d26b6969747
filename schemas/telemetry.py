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
    sent_at: float = Field(default_factory=time.time)
