"""``swarmroute watch``: nodes from the registry and live sessions from telemetry, refreshed in the terminal."""

from __future__ import annotations

import asyncio
import contextlib
import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from actors.registry import RegistryView
from artifacts.progress import format_progress
from bus import codec
from bus.connection import connected
from bus.subjects import Subjects
from schemas.artifact import FetchProgress
from schemas.node import NODE_SERVING, NodeAdvertisement
from schemas.settings import Settings
from schemas.telemetry import GenerationTelemetry, QueueStats

FETCH_SHOWN_S = 60.0
"""A fetch's last progress stays on screen this long (its "done" line shows what it downloaded)."""


QUEUE_SHOWN_S = 10.0
"""A gateway's queue figures stay on screen this long after its last report (it reports every second while
requests wait, and once when the queue empties)."""


def render_queues(queues: dict[str, QueueStats]) -> list[str]:
    """Each gateway's admission queue (issue #30): waiting, the oldest wait, admitted and dropped, the rate."""
    recent = [q for q in queues.values() if time.time() - q.sent_at < QUEUE_SHOWN_S]
    if not recent:
        return []
    lines = ["", f"{'GATEWAY':<16} {'WAITING':<8} {'OLDEST':<8} {'ADMITTED':<9} {'RATE/S':<7} DROPPED"]
    for q in sorted(recent, key=lambda q: q.gateway):
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(q.dropped.items())) or "-"
        rate = f"{q.service_rate:.2f}" if q.service_rate is not None else "-"
        lines.append(f"{q.gateway[:16]:<16} {q.waiting:<8} {q.oldest_wait_s:<8.1f} {q.admitted:<9} {rate:<7} "
                     f"{dropped}")
    return lines


def render(nodes: dict[str, NodeAdvertisement], sessions: dict[str, GenerationTelemetry],
           fetches: dict[str, FetchProgress] | None = None, queues: dict[str, QueueStats] | None = None) -> str:
    lines = [f"{'NODE':<16} {'MODEL':<24} {'LAYERS':<10} {'SESSIONS':<9} ENDPOINT"]
    for n in sorted(nodes.values(), key=lambda a: (a.model_id, a.layers.start)):
        where = n.endpoint if n.state == NODE_SERVING else f"({n.state}: not routed yet)"
        lines.append(f"{n.node_id:<16} {n.model_id[:24]:<24} {str(n.layers):<10} "
                     f"{n.capacity.active_sessions}/{n.capacity.max_sessions:<7} {where}")
    recent = [p for p in (fetches or {}).values() if time.time() - p.sent_at < FETCH_SHOWN_S]
    if recent:
        lines += ["", f"{'FETCHING':<16} {'PROGRESS'}"]
        lines += [f"{p.node_id:<16} {format_progress(p)}" for p in sorted(recent, key=lambda p: p.node_id)]
    lines += render_queues(queues or {})
    lines.append("")
    lines.append(f"{'SESSION':<10} {'PHASE':<9} {'PREFILL':<11} {'TOKENS':<7} {'TOK/S':<7} {'HEALTH':<9} "
                 "ROUTE / FAILURE")
    for s in sorted(sessions.values(), key=lambda t: t.sent_at, reverse=True)[:20]:
        route = " -> ".join(f"{h.node_id}{h.layers}" for h in s.route)
        tail = s.failure.message if s.failure else route
        lines.append(f"{s.session_id[:8]:<10} {s.phase.value:<9} {s.prefill.done:>5}/{s.prefill.total:<5} "
                     f"{s.generated_tokens:<7} {s.tokens_per_s:<7.1f} {s.route_health:<9} {tail}")
    return "\n".join(lines)


async def watch(settings: Settings, *, once: bool = False, duration: float | None = None) -> int:
    async with connected(settings, name="watch") as nc:
        return await _watch(nc, settings, once=once, duration=duration)


async def _watch(nc: NATS, settings: Settings, *, once: bool, duration: float | None) -> int:
    subjects = Subjects(settings.namespace)
    registry = RegistryView(None, settings.registry_ttl_s, nc=nc, subjects=subjects)
    sessions: dict[str, GenerationTelemetry] = {}
    fetches: dict[str, FetchProgress] = {}
    queues: dict[str, QueueStats] = {}

    async def on_telemetry(msg: Msg) -> None:
        with contextlib.suppress(codec.DecodeError):
            snap = codec.decode(msg.data, GenerationTelemetry)
            sessions[snap.session_id] = snap

    async def on_progress(msg: Msg) -> None:
        with contextlib.suppress(codec.DecodeError):
            p = codec.decode(msg.data, FetchProgress)
            fetches[p.node_id] = p

    async def on_queue(msg: Msg) -> None:
        with contextlib.suppress(codec.DecodeError):
            q = codec.decode(msg.data, QueueStats)
            queues[q.gateway] = q

    await nc.subscribe(subjects.telemetry_all, cb=on_telemetry)
    await nc.subscribe(subjects.gateway_queue("*"), cb=on_queue)
    await nc.subscribe(subjects.artifact_progress("*"), cb=on_progress)
    await registry.start()
    started = time.monotonic()
    try:
        while True:
            if once:
                print(render(registry.all(), sessions, fetches, queues))
                return 0
            print("\x1b[2J\x1b[H" + render(registry.all(), sessions, fetches, queues), flush=True)
            if duration is not None and time.monotonic() - started > duration:
                return 0
            await asyncio.sleep(1.0)
    finally:
        await registry.stop()
