"""The control plane under a simulated fleet (issue #28 item 4): one measured load step, shared by the benchmark
(``bench_control_plane.py``) and its CI test at reduced size (``tests/test_control_plane_scale.py``).

Real parts: a real nats-server (JetStream registry), real ``swarmroute tracker`` processes (one or two, the same
queue group), the real codec and registry subjects. Simulated: the nodes (``tests.support.sim_fleet``: their
heartbeats only). The load: ``routes_per_s`` route requests per second, open loop (sent on schedule whether or not
the last one was answered, as independent gateways send them), while ``churn_per_s`` nodes join or leave.

Measured per step: route latency p50/p99 as the requester sees it (NATS round trip included), the answers'
outcomes, routes naming a node that had left longer ago than the registry's TTL (a correctness bug, not a slowness),
the registry's put rate achieved against the one intended, the nats-server's message and byte rates and CPU, each
tracker's CPU, and the time a model takes to become routable once its last range is covered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import statistics
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import nats

from bus import codec
from bus.server import EmbeddedNats, NatsServerConfig
from bus.subjects import Subjects
from schemas.route import RouteReply, RouteRequest
from schemas.settings import Settings
from tests.support.actors import ActorProcess
from tests.support.sim_fleet import SimFleet, SimModel, even_ranges
from tests.support.swarm import make_settings
from tests.support.up import free_port

MODEL = SimModel("sim-model", n_layers=32, ranges=even_ranges(32, 4))
LATE = SimModel("sim-late", n_layers=8, ranges=even_ranges(8, 2))
"""Covered only during the step, to time how soon a newly covered model routes."""
REQUEST_TIMEOUT_S = 5.0


@dataclasses.dataclass
class Load:
    nodes: int
    churn_per_s: float
    routes_per_s: float
    trackers: int = 1
    seconds: float = 10.0
    heartbeat_s: float = 2.0
    registry_ttl_s: float = 6.0


@dataclasses.dataclass
class StepResult:
    load: Load
    latencies_ms: list[float]
    outcomes: dict[str, int]
    stale_routes: int
    puts_per_s: float
    intended_puts_per_s: float
    put_errors: int
    nats: dict[str, float]
    tracker_cpu: list[float]
    routable_after_s: float | None
    churned: dict[str, int]
    generator_cpu: float
    """CPU % of this process (the simulated fleet and the requesters): near 100, the load is what it can make."""

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.latencies_ms) if self.latencies_ms else float("nan")

    @property
    def p99_ms(self) -> float:
        if not self.latencies_ms:
            return float("nan")
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]

    @property
    def sent(self) -> int:
        return sum(self.outcomes.values())

    @property
    def routed(self) -> int:
        return self.outcomes.get("route", 0)

    def row(self) -> str:
        nats_cpu = self.nats.get("cpu_percent", float("nan"))
        trackers = "/".join(f"{c:.0f}" for c in self.tracker_cpu)
        routable = "never" if self.routable_after_s is None else f"{self.routable_after_s * 1000:.0f}"
        failed = self.sent - self.routed
        return (f"| {self.load.nodes} | {self.load.trackers} | {self.p50_ms:.1f} | {self.p99_ms:.1f} | "
                f"{self.routed}/{self.sent} | {failed} | {self.stale_routes} | "
                f"{self.puts_per_s:.0f}/{self.intended_puts_per_s:.0f} | {self.nats.get('in_msgs_per_s', 0):.0f} | "
                f"{self.nats.get('in_mb_per_s', 0):.2f} | {nats_cpu:.0f} | {trackers} | {self.generator_cpu:.0f} | "
                f"{routable} |")


HEADER = ("| nodes | trackers | route p50 ms | route p99 ms | routed/sent | failed | stale | registry puts/s "
          "(got/meant) | NATS msgs in/s | NATS MB in/s | NATS CPU % | tracker CPU % | load generator CPU % | "
          "routable after ms |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def nats_server(store: Path) -> tuple[EmbeddedNats, int]:
    monitor = free_port()
    server = EmbeddedNats(NatsServerConfig(store_dir=store, extra_args=["-m", str(monitor)])).start()
    return server, monitor


def varz(monitor: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/varz", timeout=5) as r:
        data: dict[str, Any] = json.load(r)
        return data


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tracker_settings(server: EmbeddedNats, home: Path, load: Load) -> Settings:
    return make_settings(server.url, home, heartbeat_s=load.heartbeat_s, registry_ttl_s=load.registry_ttl_s)


class Requester:
    """Route requests on schedule; each answer's latency and outcome, and any route naming a node long gone."""

    def __init__(self, nc: Any, subjects: Subjects, fleet: SimFleet, ttl_s: float) -> None:
        self._nc = nc
        self._subjects = subjects
        self._fleet = fleet
        self._ttl = ttl_s
        self.latencies_ms: list[float] = []
        self.outcomes: dict[str, int] = {}
        self.stale = 0

    async def one(self, model: str) -> RouteReply | None:
        request = RouteRequest(model=model, session_id=uuid.uuid4().hex, standby=True)
        started = time.perf_counter()
        try:
            msg = await self._nc.request(self._subjects.route_request, codec.encode(request),
                                         timeout=REQUEST_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a timeout or no responder is an outcome of the load
            self._count(type(exc).__name__)
            return None
        self.latencies_ms.append((time.perf_counter() - started) * 1000)
        reply = codec.decode(msg.data, RouteReply)
        if reply.route is None:
            self._count(f"{reply.status} {reply.code or reply.error}")
            return reply
        self._count("route")
        now = time.monotonic()
        self.stale += sum(1 for h in reply.route.hops
                          if now - self._fleet.gone.get(h.node_id, now) > self._ttl + 1.0)
        return reply

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    async def run(self, model: str, per_s: float, seconds: float) -> None:
        tasks = []
        started = time.monotonic()
        for i in range(int(per_s * seconds)):
            delay = started + i / per_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.one(model)))
        await asyncio.gather(*tasks)


async def time_to_routable(requester: Requester, fleet: SimFleet, timeout_s: float = 20.0) -> float | None:
    """Cover ``LATE`` but for its last range, then add that range's node: seconds until a route comes back."""
    *first, last = LATE.ranges
    for rng in first:
        await fleet.add(LATE, 1, layers=rng)
    await asyncio.sleep(1.0)
    started = time.monotonic()
    await fleet.add(LATE, 1, layers=last)
    while time.monotonic() - started < timeout_s:
        probe = Requester(requester._nc, requester._subjects, fleet, requester._ttl)
        reply = await probe.one(LATE.name)
        if reply is not None and reply.route is not None:
            return time.monotonic() - started
        await asyncio.sleep(0.01)
    return None


async def run_step(load: Load, work: Path) -> StepResult:
    """One load step on its own nats-server and trackers; everything is stopped before it returns."""
    server, monitor = nats_server(work / "nats")
    trackers: list[ActorProcess] = []
    try:
        settings = tracker_settings(server, work / "home", load)
        trackers = [ActorProcess("tracker", settings, [], name=f"tracker-{i}")
                    for i in range(load.trackers)]
        subjects = Subjects(settings.namespace)
        nc = await nats.connect(server.url, max_reconnect_attempts=-1)
        try:
            async with SimFleet(nc, subjects, load.heartbeat_s) as fleet:
                await fleet.add(MODEL, load.nodes)
                await asyncio.sleep(load.heartbeat_s * 2)  # every tracker has seen every node twice
                requester = Requester(nc, subjects, fleet, load.registry_ttl_s)
                await requester.one(MODEL.name)  # warm: the trackers' first route
                requester = Requester(nc, subjects, fleet, load.registry_ttl_s)
                fleet.churn(load.churn_per_s)
                before_v, before_t = varz(monitor), time.monotonic()
                before_cpu = [process_cpu_s(t.proc.pid) for t in trackers]
                own_cpu = time.process_time()
                puts_before = fleet.counters.puts
                await requester.run(MODEL.name, load.routes_per_s, load.seconds)
                elapsed = time.monotonic() - before_t
                after_v = varz(monitor)
                cpu = [(process_cpu_s(t.proc.pid) - c) / elapsed * 100 for t, c in zip(trackers, before_cpu,
                                                                                         strict=True)]
                puts = (fleet.counters.puts - puts_before) / elapsed
                generator_cpu = (time.process_time() - own_cpu) / elapsed * 100
                routable = await time_to_routable(requester, fleet)
                counters = dataclasses.asdict(fleet.counters)
        finally:
            await nc.close()
        return StepResult(load=load, latencies_ms=requester.latencies_ms, outcomes=requester.outcomes,
                          stale_routes=requester.stale, puts_per_s=puts,
                          intended_puts_per_s=load.nodes / load.heartbeat_s, put_errors=counters["put_errors"],
                          nats=nats_rates(before_v, after_v, elapsed), tracker_cpu=cpu,
                          routable_after_s=routable, churned=counters, generator_cpu=generator_cpu)
    finally:
        for t in trackers:
            t.stop()
        server.stop()


def nats_rates(before: dict[str, Any], after: dict[str, Any], elapsed: float) -> dict[str, float]:
    return {"in_msgs_per_s": (after["in_msgs"] - before["in_msgs"]) / elapsed,
            "out_msgs_per_s": (after["out_msgs"] - before["out_msgs"]) / elapsed,
            "in_mb_per_s": (after["in_bytes"] - before["in_bytes"]) / elapsed / 1e6,
            "out_mb_per_s": (after["out_bytes"] - before["out_bytes"]) / elapsed / 1e6,
            "cpu_percent": float(after.get("cpu", 0.0))}
