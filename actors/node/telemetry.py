"""The telemetry publisher: folds what the route's nodes report into Generation Telemetry snapshots on NATS.

One publisher runs per Route Session on the session's head, which sees everything the route reports: prefill
progress as chunks leave, and per-hop compute/queue stamps that ride back with every token. Snapshots are rate
limited during decode; phase changes and terminal states are always sent.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Awaitable, Callable

from schemas.node import LayerRange
from schemas.route import Route
from schemas.session import FailureReason, HopTiming, SessionPhase
from schemas.telemetry import (
    GenerationTelemetry,
    HopHealth,
    PrefillProgress,
    RepairView,
    RouteHealth,
    RouteHopView,
    SpeculationView,
)

Publish = Callable[[GenerationTelemetry], Awaitable[None]]

RATE_WINDOW_S = 3.0
SLOW_FACTOR = 3.0


class _HopStats:
    def __init__(self) -> None:
        self.last: float | None = None
        self.total = 0.0
        self.n = 0

    def add(self, ms: float) -> None:
        self.last = ms
        self.total += ms
        self.n += 1

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None


class TelemetryPublisher:
    def __init__(self, route: Route, publish: Publish, *, interval_s: float = 0.1, first_seq: int = 1) -> None:
        self.route = route
        self._publish = publish
        self._interval = interval_s
        self._seq = first_seq
        self._started = time.monotonic()
        self._last_sent = 0.0
        self._token_times: collections.deque[float] = collections.deque()
        self._hops = {h.node_id: _HopStats() for h in route.hops}
        self._overhead = _HopStats()
        self._failed_node: str | None = None
        self.phase = SessionPhase.ROUTING
        self.prefill = PrefillProgress()
        self.generated = 0
        self.ttft_ms: float | None = None
        self.speculation: SpeculationView | None = None
        self.repair: RepairView | None = None
        """The latest route repair (issue #18), shown from then on."""

    def snapshot(self, *, failure: FailureReason | None = None,
                 finish_reason: str | None = None) -> GenerationTelemetry:
        now = time.monotonic()
        while self._token_times and now - self._token_times[0] > RATE_WINDOW_S:
            self._token_times.popleft()
        rate = 0.0
        if len(self._token_times) >= 2:
            span = self._token_times[-1] - self._token_times[0]
            rate = (len(self._token_times) - 1) / span if span > 0 else 0.0
        hops = [self._hop_view(h.node_id, h.layers) for h in self.route.hops]
        snap = GenerationTelemetry(
            session_id=self.route.session_id, seq=self._seq, phase=self.phase, model=self.route.model_id,
            route=hops, route_health=self._health(hops), prefill=self.prefill.model_copy(),
            generated_tokens=self.generated, tokens_per_s=round(rate, 3), ttft_ms=self.ttft_ms,
            elapsed_ms=round((now - self._started) * 1e3, 3), failure=failure, finish_reason=finish_reason,
            hop_overhead_ms=self._overhead.mean, repair=self.repair, speculation=self.speculation)
        self._seq += 1
        return snap

    def _hop_view(self, node_id: str, layers: LayerRange) -> RouteHopView:
        stats = self._hops[node_id]
        health: HopHealth = "ok"
        if node_id == self._failed_node:
            health = "failed"
        elif stats.last is not None and stats.mean and stats.n > 4 and stats.last > SLOW_FACTOR * stats.mean:
            health = "slow"
        return RouteHopView(node_id=node_id, layers=layers, health=health, last_compute_ms=stats.last,
                            mean_compute_ms=stats.mean)

    def _health(self, hops: list[RouteHopView]) -> RouteHealth:
        if any(h.health == "failed" for h in hops):
            return "failed"
        if any(h.health == "slow" for h in hops):
            return "degraded"
        return "healthy"

    async def _send(self, force: bool, **kw: object) -> None:
        now = time.monotonic()
        if not force and now - self._last_sent < self._interval:
            return
        self._last_sent = now
        await self._publish(self.snapshot(**kw))  # type: ignore[arg-type]

    async def set_phase(self, phase: SessionPhase) -> None:
        self.phase = phase
        await self._send(True)

    async def prefill_progress(self, done: int, total: int, *, reused: int | None = None) -> None:
        """``reused``: prompt positions taken from kept KV (said once, at the start; shown from then on)."""
        reused = self.prefill.reused if reused is None else reused
        self.prefill = PrefillProgress(done=done, total=total, reused=reused)
        await self._send(done >= total or done == reused)

    async def token(self, timings: list[HopTiming], step_wall_ms: float | None) -> None:
        now = time.monotonic()
        if self.generated == 0:
            self.ttft_ms = round((now - self._started) * 1e3, 3)
        self.generated += 1
        self._token_times.append(now)
        for t in timings:
            if t.node_id in self._hops:
                self._hops[t.node_id].add(t.compute_ms)
        links = len(self.route.hops) if len(self.route.hops) > 1 else 0
        if step_wall_ms is not None and links:
            compute = sum(t.compute_ms + t.queue_ms for t in timings)
            self._overhead.add(max(0.0, step_wall_ms - compute) / links)
        if self.phase is not SessionPhase.DECODE:
            self.phase = SessionPhase.DECODE
            await self._send(True)
        else:
            await self._send(False)

    async def repairing(self, view: RepairView) -> None:
        """A hop was lost and the head is rebuilding the route (sent at once, and again as the repair goes on)."""
        self.phase = SessionPhase.REPAIRING
        self.repair = view
        self._failed_node = view.lost_node
        await self._send(True)

    async def repaired(self, route: Route, view: RepairView, phase: SessionPhase) -> None:
        """The session goes on over ``route``: the replacement's stats start from nothing."""
        self.route = route
        for hop in route.hops:
            self._hops.setdefault(hop.node_id, _HopStats())
        self._failed_node = None
        self.repair = view
        self.phase = phase
        await self._send(True)

    async def speculating(self, view: SpeculationView) -> None:
        """How the verify windows fare (issue #20): shown from then on, sent with the next snapshot due."""
        self.speculation = view
        await self._send(False)

    async def complete(self, finish_reason: str) -> None:
        self.phase = SessionPhase.COMPLETE
        await self._send(True, finish_reason=finish_reason)

    async def cancel(self) -> None:
        self.phase = SessionPhase.CANCELLED
        await self._send(True)

    async def fail(self, reason: FailureReason) -> None:
        self.phase = SessionPhase.FAILED
        self._failed_node = reason.node_id
        await self._send(True, failure=reason)
