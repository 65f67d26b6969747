"""Processes of a swarm that provisions itself: ``swarmroute artifact seed`` seeders and ``swarmroute node
--model-id`` nodes that start empty, as real child processes (``tests.support.actors``, configured like the test's
Settings; optionally inside a network namespace), and a watcher of the artifact subjects on NATS."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import nats
from nats.aio.msg import Msg

from bus.codec import decode
from bus.subjects import Subjects
from schemas.artifact import FetchProgress
from schemas.settings import Settings
from tests.support.actors import ActorProcess, ChildProcess, settings_env, swarmroute

READY = r"node \S+ ready at (\S+) serving"


def seeder(settings: Settings, name: str, home: Path, model_id: str, *, host: str = "127.0.0.1",
           prefix: Sequence[str] = (), extra: Sequence[str] = ()) -> ChildProcess:
    """``swarmroute artifact seed`` of a store that holds the model; ready once it printed its ``seeding`` line."""
    child = ChildProcess([*prefix, *swarmroute("artifact", "seed", model_id, "--home", str(home), "--nats-url",
                                               settings.nats_url, "--node-id", name, "--listen-host", host, *extra)],
                         env=settings_env(settings))
    child.wait_for(r'"event": "seeding"', 120)
    return child


def empty_node(settings: Settings, node_id: str, home: Path, model_id: str, *args: str,
               prefix: Sequence[str] = ()) -> ActorProcess:
    """``swarmroute node --model-id MODEL_ID`` with an empty store of its own: it provisions itself (not waited
    for: ``ready`` when the test wants it serving)."""
    return ActorProcess("node", settings, ["--home", str(home), "--node-id", node_id, "--model-id", model_id, *args],
                        prefix=prefix, name=node_id, wait=False)


class ProgressWatch:
    """Every ``FetchProgress`` published on NATS, decoded, in arrival order."""

    def __init__(self) -> None:
        self.events: list[FetchProgress] = []

    async def start(self, url: str, subjects: Subjects | None = None) -> ProgressWatch:
        self.nc = await nats.connect(url)

        async def on_progress(msg: Msg) -> None:
            self.events.append(decode(msg.data, FetchProgress))

        await self.nc.subscribe((subjects or Subjects()).artifact_progress("*"), cb=on_progress)
        return self

    def of(self, node_id: str) -> list[FetchProgress]:
        return [p for p in self.events if p.node_id == node_id]

    def last(self, node_id: str, phase: str) -> FetchProgress:
        found = [p for p in self.of(node_id) if p.phase == phase]
        assert found, f"no {phase!r} progress from {node_id}: {[p.phase for p in self.of(node_id)]}"
        return found[-1]

    async def close(self) -> None:
        await self.nc.drain()
