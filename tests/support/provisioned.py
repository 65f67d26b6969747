"""Processes of a swarm that provisions itself: ``swarmroute artifact seed`` seeders and ``swarmroute node
--model-id`` nodes that start empty, as real child processes (optionally inside a network namespace), and a
watcher of the artifact subjects on NATS."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import nats
from nats.aio.msg import Msg

from bus.codec import decode
from bus.subjects import Subjects
from schemas.artifact import FetchProgress
from schemas.settings import Settings

REPO = Path(__file__).resolve().parents[2]


def child_env(settings: Settings) -> dict[str, str]:
    """The children's settings: the test's heartbeat and TTL (the lease bucket's TTL must match the renewals)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO),
            "SWARMROUTE_HEARTBEAT_S": str(settings.heartbeat_s),
            "SWARMROUTE_REGISTRY_TTL_S": str(settings.registry_ttl_s)}


class Child:
    """A child process whose output (stdout and stderr together) is collected line by line."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], *, prefix: Sequence[str] = ()) -> None:
        self.name = name
        self.proc = subprocess.Popen([*prefix, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                     cwd=REPO, start_new_session=True)
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with self._changed:
                self.lines.append(raw.decode(errors="replace").rstrip())
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first output line matching ``pattern``; AssertionError with the output's tail when it does not come
        (or the process exits first)."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    if (m := regex.search(line)) is not None:
                        return m
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and seen == len(self.lines)):
                    tail = "\n".join(self.lines[-40:])
                    raise AssertionError(f"{self.name}: no line matching {pattern!r} within {timeout}s "
                                         f"(exit status {self.proc.poll()}):\n{tail}")
                self._changed.wait(min(left, 0.5))

    async def wait_for_async(self, pattern: str, timeout: float) -> re.Match[str]:
        return await asyncio.to_thread(self.wait_for, pattern, timeout)

    def kill(self) -> None:
        """SIGKILL: a crash, no goodbye."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode


def swarmroute(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarmroute", *args]


def seeder(settings: Settings, name: str, home: Path, model_id: str, *, host: str = "127.0.0.1",
           prefix: Sequence[str] = (), extra: Sequence[str] = ()) -> Child:
    """``swarmroute artifact seed`` of a store that holds the model; ready once it printed its ``seeding`` line."""
    child = Child(name, swarmroute("artifact", "seed", model_id, "--home", str(home), "--nats-url", settings.nats_url,
                                   "--node-id", name, "--listen-host", host, *extra), child_env(settings),
                  prefix=prefix)
    child.wait_for(r'"event": "seeding"', 120)
    return child


def empty_node(settings: Settings, node_id: str, home: Path, model_id: str, *args: str,
               prefix: Sequence[str] = ()) -> Child:
    """``swarmroute node --model-id MODEL_ID`` with an empty store: it provisions itself (not waited for)."""
    return Child(node_id, swarmroute("node", "--nats", settings.nats_url, "--home", str(home), "--namespace",
                                     settings.namespace, "--node-id", node_id, "--model-id", model_id,
                                     "--log-level", "info", *args), child_env(settings), prefix=prefix)


READY = r"node \S+ ready at (\S+) serving"


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

    async def until(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"not seen on NATS within {timeout}s: {what}"
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await self.nc.drain()
