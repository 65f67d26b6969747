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
from schemas.telemetry import GenerationTelemetry

FETCH_SHOWN_S = 60.0
"""A fetch's last progress stays on screen this long (its "done" line shows what it downloaded)."""


def render(nodes: dict[str, NodeAdvertisement], sessions: dict[str, GenerationTelemetry],
           fetches: dict[str, FetchProgress] | None = None) -> str:
    lines = [f"{'NODE':<16} {'MODEL':<24} {'LAYERS':<10} {'SESSIONS':<9} ENDPOINT"]
    for n in sorted(nodes.values(), key=lambda a: (a.model_id, a.layers.start)):
        where = n.endpoint if n.state == NODE_SERVING else f"({n.state}: not routed yet)"
        lines.append(f"{n.node_id:<16} {n.model_id[:24]:<24} {str(n.layers):<10} "
                     f"{n.capacity.active_sessions}/{n.capacity.max_sessions:<7} {where}")
    recent = [p for p in (fetches or {}).values() if time.time() - p.sent_at < FETCH_SHOWN_S]
    if recent:
        lines += ["", f"{'FETCHING':<16} {'PROGRESS'}"]
        lines += [f"{p.node_id:<16} {format_progress(p)}" for p in sorted(recent, key=lambda p: p.node_id)]
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

    async def on_telemetry(msg: Msg) -> None:
        with contextlib.suppress(codec.DecodeError):
            snap = codec.decode(msg.data, GenerationTelemetry)
            sessions[snap.session_id] = snap

    async def on_progress(msg: Msg) -> None:
        with contextlib.suppress(codec.DecodeError):
            p = codec.decode(msg.data, FetchProgress)
            fetches[p.node_id] = p

    await nc.subscribe(subjects.telemetry_all, cb=on_telemetry)
    await nc.subscribe(subjects.artifact_progress("*"), cb=on_progress)
    await registry.start()
    started = time.monotonic()
    try:
        while True:
            if once:
                print(render(registry.all(), sessions, fetches))
                return 0
            print("\x1b[2J\x1b[H" + render(registry.all(), sessions, fetches), flush=True)
            if duration is not None and time.monotonic() - started > duration:
                return 0
            await asyncio.sleep(1.0)
    finally:
        await registry.stop()
