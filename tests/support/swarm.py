"""Starting real swarms for tests: a real nats-server, real uvicorn servers on loopback, real child processes."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from pathlib import Path

from actors.backend import Backend
from actors.node import Node, NodeConfig
from actors.tracker import Tracker
from gateway.app import Gateway
from schemas.settings import Settings
from tests.support.actors import ActorProcess
from tests.support.waiting import eventually


@dataclasses.dataclass
class Swarm:
    settings: Settings
    tracker: Tracker
    nodes: list[Node]
    gateway: Gateway

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def base_url(self) -> str:
        return self.gateway.url + "/v1"

    async def wait_model(self, model: str, timeout: float = 10.0) -> None:
        await wait_model(self.tracker, model, timeout)

    async def route_through(self, node: Node, url: str, timeout: float = 10.0) -> None:
        """Have ``node`` advertise ``url`` (a proxy in front of it) and wait until the tracker routes there."""
        await node.advertise_at(url)
        registry = self.tracker.registry
        assert registry is not None
        await eventually(lambda: url in {a.endpoint for a in registry.live()}, timeout=timeout,
                         what=f"the tracker routing to {node.config.node_id} through {url}")

    async def stop(self) -> None:
        await self.gateway.stop()
        for node in self.nodes:
            await node.stop()
        await self.tracker.stop()


async def wait_model(tracker: Tracker, model: str, timeout: float = 10.0, n_nodes: int | None = None) -> None:
    """Until the tracker sees a complete route for ``model`` (and ``n_nodes`` nodes serving it, if given)."""
    def routable() -> bool:
        return any(model in (m.id, m.name, *m.aliases) and m.complete and (n_nodes is None or len(m.nodes) >= n_nodes)
                   for m in tracker.models().models)

    await eventually(routable, timeout=timeout, what=f"model {model} becoming routable")


async def start_swarm(settings: Settings, backends: Sequence[Backend], *, model_id: str,
                      wire_dtype: str = "f32") -> Swarm:
    tracker = await Tracker(settings).start()
    nodes = [await Node(NodeConfig(node_id=f"n{i + 1}", model_id=model_id, wire_dtype=wire_dtype), b,
                        settings).start() for i, b in enumerate(backends)]
    gateway = await Gateway(settings, port=0).start()
    swarm = Swarm(settings, tracker, nodes, gateway)
    await wait_model(tracker, model_id, n_nodes=len(nodes))
    return swarm


class NodeProcess(ActorProcess):
    """``swarmroute node`` as a real child process (so a test can SIGKILL it), configured like the test's Settings."""

    def __init__(self, settings: Settings, node_id: str, args: list[str], *, ready_timeout: float = 180.0,
                 prefix: Sequence[str] = ()) -> None:
        self.node_id = node_id
        super().__init__("node", settings, ["--node-id", node_id, *args], ready_timeout=ready_timeout,
                         prefix=prefix, log_level="warning")

    @property
    def endpoint(self) -> str | None:
        return self.url


@contextlib.contextmanager
def node_processes(settings: Settings, specs: Sequence[tuple[str, list[str]]]):  # type: ignore[no-untyped-def]
    procs: list[NodeProcess] = []
    try:
        for node_id, args in specs:
            procs.append(NodeProcess(settings, node_id, args))
        yield procs
    finally:
        for p in procs:
            p.stop()


def make_settings(nats_url: str, home: Path, **overrides: object) -> Settings:
    base: dict[str, object] = dict(nats_url=nats_url, home=home, gateway_port=0, heartbeat_s=0.5, registry_ttl_s=2.0,
                                   hop_timeout_s=5.0, token_timeout_s=5.0, first_token_timeout_s=20.0,
                                   session_idle_ttl_s=60.0, telemetry_interval_s=0.05,
                                   client_probe_s=0.5)  # every test's sessions are probed, and must survive it
    base.update(overrides)
    return Settings(**base)  # type: ignore[arg-type]
