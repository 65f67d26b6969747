"""The chaos matrix's fleet (issue #31 item 4): a real 3-server NATS cluster, a tracker, llama.cpp node processes
serving the bundled Gemma 3 270M as a 3-node route (head, middle, tail) with a spare for every range, and gateways,
each its own ``swarmroute`` process so that any of them can be SIGKILLed and started again.

Who sits on which NATS server is fixed (each actor lists the three servers in its own order, shuffling off), so a
test knows whose connections a server's death takes with it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from pathlib import Path
from typing import Any

import httpx

from schemas.settings import Settings
from tests.support.actors import ActorProcess, orphans
from tests.support.nats_cluster import NatsCluster
from tests.support.waiting import eventually

LAYOUT = [("h1", "0:6"), ("h2", "0:6"), ("m1", "6:12"), ("m2", "6:12"), ("t1", "12:18"), ("t2", "12:18")]
"""Two nodes per range: whichever a route takes, the other is its spare (and its standby)."""


class ChaosFleet:
    """The actor processes; each role started again under the same name after a kill (``restart``)."""

    def __init__(self, settings: Settings, cluster: NatsCluster, gemma_path: Path, *, max_sessions: int) -> None:
        self.settings = settings
        self.cluster = cluster
        self.gemma_path = gemma_path
        self.max_sessions = max_sessions
        self.procs: dict[str, ActorProcess] = {}
        self.started: list[int] = []
        """Every pid this fleet started, killed ones included: none may outlive it."""
        self.pending: str | None = None
        """The actor a test killed and the next one starts again (a NATS server: ``nats-<index>``)."""
        self.node_log_level = os.environ.get("SWARMROUTE_CHAOS_NODE_LOG", "warning")

    # ---- who connects where -------------------------------------------------------------------------------------

    def _urls(self, first: int) -> str:
        urls = self.cluster.urls
        return ",".join(urls[(first + i) % len(urls)] for i in range(len(urls)))

    def _settings(self, name: str, **update: Any) -> Settings:
        """Gateways on s0, the tracker on s1, nodes alternating s1 and s2 (the spares on the other one)."""
        first = 1 if name == "tracker" else 0 if name.startswith("gateway") else 1 + LAYOUT_INDEX[name] % 2
        return self.settings.model_copy(update={"nats_url": self._urls(first), "nats_randomize": False, **update})

    # ---- starting -------------------------------------------------------------------------------------------------

    def _start(self, name: str, role: str, args: list[str], settings: Settings, timeout: float) -> ActorProcess:
        # Nodes at warning (their per-session info lines would flood the test's memory); the others say "ready" at info.
        level = self.node_log_level if role == "node" else "info"
        proc = ActorProcess(role, settings, args, ready_timeout=timeout, log_level=level, name=name)
        self.procs[name] = proc
        self.started.append(proc.pid)
        return proc

    def node_args(self, name: str) -> list[str]:
        layers = dict(LAYOUT)[name]
        return ["--node-id", name, "--backend", "llamacpp", "--model", str(self.gemma_path), "--model-id", "gemma",
                "--layers", layers, "--threads", "1", "--ctx", "256", "--max-sessions", str(self.max_sessions)]

    def start_node(self, name: str) -> ActorProcess:
        return self._start(name, "node", self.node_args(name), self._settings(name), 240)

    def start_tracker(self) -> ActorProcess:
        return self._start("tracker", "tracker", [], self._settings("tracker"), 60)

    def start_gateway(self, name: str, **update: Any) -> ActorProcess:
        return self._start(name, "gateway", ["--port", "0"], self._settings(name, **update), 60)

    def start_all(self) -> None:
        self.start_tracker()
        with concurrent.futures.ThreadPoolExecutor(len(LAYOUT)) as pool:  # the nodes load side by side
            list(pool.map(self.start_node, [name for name, _ in LAYOUT]))
        self.start_gateway("gateway")
        self.start_gateway("gateway-spec", speculation="ngram")

    def restart(self, name: str) -> ActorProcess:
        """``name`` started again (after a kill), under the same name and settings."""
        if name == "tracker":
            return self.start_tracker()
        if name.startswith("gateway"):
            return self.start_gateway(name, **({"speculation": "ngram"} if name == "gateway-spec" else {}))
        return self.start_node(name)

    # ---- looking ----------------------------------------------------------------------------------------------------

    def nodes(self) -> list[ActorProcess]:
        return [p for name, p in self.procs.items() if name in LAYOUT_INDEX and p.proc.poll() is None]

    def url(self, name: str) -> str:
        return self.procs[name].url

    async def sessions(self) -> dict[str, int | None]:
        """What every live node's ``/health`` says it holds (None: it did not answer)."""
        async def held(p: ActorProcess) -> int | None:
            try:
                async with httpx.AsyncClient(timeout=5) as http:
                    return int((await http.get(f"{p.url}/health")).json()["sessions"])
            except httpx.HTTPError:
                return None

        nodes = self.nodes()
        counts = await asyncio.gather(*(held(p) for p in nodes))
        return {p.name: c for p, c in zip(nodes, counts, strict=True)}

    async def freed(self, timeout: float = 60.0) -> None:
        """Until every live node holds no session."""
        seen: dict[str, int | None] = {}

        async def none_held() -> bool:
            seen.clear()
            seen.update(await self.sessions())
            return all(c == 0 for c in seen.values())

        freed: bool = await eventually(none_held, timeout=timeout, interval=0.25,
                                       what=lambda: f"every node freeing its sessions (they hold: {seen})")
        assert freed

    def nats_member_of(self, name: str) -> int:
        """The index of the NATS server ``name``'s connection sits on."""
        connection = "gateway" if name.startswith("gateway") else name if name == "tracker" else f"node-{name}"
        for i, member in enumerate(self.cluster.members):
            if member.server.pid is not None and connection in member.connection_names():
                return i
        raise AssertionError(f"{name} ({connection}) is connected to no NATS server")

    def close(self) -> list[int]:
        for p in reversed(list(self.procs.values())):
            p.stop()
        return orphans(self.started)


LAYOUT_INDEX = {name: i for i, (name, _) in enumerate(LAYOUT)}
