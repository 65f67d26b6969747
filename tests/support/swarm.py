"""Starting real swarms for tests: a real nats-server, real uvicorn servers on loopback, real child processes.

A test gets them from the ``swarms`` fixture (``Swarms``), which stops everything it started when the test ends,
passed or failed: ``swarm = await swarms.start(settings, [stub(0, 4), stub(4, 8)], model_id=MODEL)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from actors.backend import Backend
from actors.backends.stub import StubBackend, StubConfig
from actors.node import Node, NodeConfig
from actors.tracker import Tracker
from bus.actor import NatsActor
from gateway.app import Gateway
from schemas.settings import Settings
from tests.support.actors import ActorProcess
from tests.support.proxy import CountingProxy
from tests.support.waiting import eventually

STUB_MODEL = "stub-model"
"""The stub backend's model id (``StubConfig``'s default)."""

A = TypeVar("A", bound=NatsActor)


def stub(start: int = 0, end: int | None = None, **kw: Any) -> StubBackend:
    """A stub backend holding layers ``[start, end)`` of the 8-layer ``stub-model`` (``kw``: other ``StubConfig``
    fields: ``model``, ``n_layers``, ``delay_s``, ``max_sessions``, ...)."""
    return StubBackend(StubConfig(layer_start=start, layer_end=end, **kw))


@dataclasses.dataclass
class Swarm:
    settings: Settings
    tracker: Tracker
    nodes: list[Node]
    gateway: Gateway
    backends: Sequence[Backend] = ()
    """The backends the swarm was started on, when a helper loaded them (``gemma_route``)."""

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def base_url(self) -> str:
        return self.gateway.url + "/v1"

    async def wait_model(self, model: str, timeout: float = 10.0) -> None:
        await wait_model(self.tracker, model, timeout)

    def held(self) -> dict[str, list[str]]:
        """What is still open: each node's sessions and its backend's (every choice's fork included), and the
        gateway's live sessions; empty lists dropped."""
        held = {n.config.node_id: [*n.sessions, *getattr(n.backend, "open_sessions", [])] for n in self.nodes}
        serving = self.gateway.serving
        held["gateway"] = list(serving.sessions.live) if serving is not None else []
        return {k: v for k, v in held.items() if v}

    async def freed(self, timeout: float = 10.0) -> None:
        """Until no node, backend or the gateway holds a session any more."""
        await eventually(lambda: not self.held(), timeout=timeout, interval=0.02,
                         what=lambda: f"every session freed (still open: {self.held()})")

    async def route_through(self, node: Node, url: str, timeout: float = 10.0) -> None:
        """Have ``node`` advertise ``url`` (a proxy in front of it) and wait until the tracker routes there."""
        await node.advertise_at(url)
        registry = self.tracker.registry
        assert registry is not None
        await eventually(lambda: url in {a.endpoint for a in registry.live()}, timeout=timeout,
                         what=f"the tracker routing to {node.config.node_id} through {url}")

    async def stop(self) -> None:
        """The gateway, the nodes, then the tracker; each is stopped even if stopping another fails."""
        async with contextlib.AsyncExitStack() as stops:
            for actor in (self.tracker, *reversed(self.nodes), self.gateway):
                stops.push_async_callback(actor.stop)


async def wait_model(tracker: Tracker, model: str, timeout: float = 10.0, n_nodes: int | None = None) -> None:
    """Until the tracker sees a complete route for ``model`` (and ``n_nodes`` nodes serving it, if given)."""
    def routable() -> bool:
        return any(model in (m.id, m.name, *m.aliases) and m.complete and (n_nodes is None or len(m.nodes) >= n_nodes)
                   for m in tracker.models().models)

    await eventually(routable, timeout=timeout, what=f"model {model} becoming routable")


async def start_swarm(settings: Settings, backends: Sequence[Backend], *, model_id: str,
                      wire_dtype: str = "f32") -> Swarm:
    """A tracker, a node per backend (``n1``, ``n2``, ...) and a gateway, once the model is routable over all the
    nodes; whatever started is stopped again if that fails. Tests use ``Swarms.start``, which also stops it."""
    async with Swarms() as starting:
        tracker = await starting.actor(Tracker(settings))
        nodes = [await starting.actor(Node(NodeConfig(node_id=f"n{i + 1}", model_id=model_id, wire_dtype=wire_dtype),
                                           b, settings)) for i, b in enumerate(backends)]
        gateway = await starting.actor(Gateway(settings, port=0))
        await wait_model(tracker, model_id, n_nodes=len(nodes))
        starting.pop_all()  # the Swarm stops them
    return Swarm(settings, tracker, nodes, gateway)


@contextlib.asynccontextmanager
async def gemma_route(nats_url: str, gemma_path: Path, work: Path, *, namespace: str, max_sessions: int,
                      threads: int = 2, model_id: str = "gemma", cuts: Sequence[int] = (0, 12, 18),
                      n_ctx: int = 1024, batch_invariant: bool | str = False, **settings: Any) -> AsyncIterator[Swarm]:
    """The bundled Gemma 3 270M as a real llama.cpp route (one shard per pair of ``cuts``, ``n_ctx`` per session),
    served as ``model_id`` with generous timeouts (llama.cpp on a 2-core machine shared with other test processes)
    and ``settings`` on top (``batch_invariant``: the backends' option); stopped, and its backends closed, at the end
    (``Swarm.backends``)."""
    from actors.backends import load_backend

    (work / "shards").mkdir(parents=True, exist_ok=True)
    backends = [load_backend("llamacpp", model_path=gemma_path, n_ctx=n_ctx, max_sessions=max_sessions,
                             threads=threads, layer_start=a, layer_end=b, shard_dir=work / "shards",
                             batch_invariant=batch_invariant)
                for a, b in itertools.pairwise(cuts)]
    config = make_settings(nats_url, work / "home", namespace=namespace, **{
        "token_timeout_s": 60.0, "first_token_timeout_s": 120.0, "hop_timeout_s": 60.0, **settings})
    try:
        swarm = await start_swarm(config, backends, model_id=model_id)
        swarm.backends = backends
        try:
            yield swarm
        finally:
            await swarm.stop()
    finally:
        for backend in backends:
            backend.close()


class NodeProcess(ActorProcess):
    """``swarmroute node`` as a real child process (so a test can SIGKILL it), configured like the test's Settings."""

    def __init__(self, settings: Settings, node_id: str, args: list[str], *, ready_timeout: float = 180.0,
                 prefix: Sequence[str] = (), wait: bool = True) -> None:
        """``wait``: false returns at once (``ready()`` then waits), to start several side by side."""
        self.node_id = node_id
        super().__init__("node", settings, ["--node-id", node_id, *args], ready_timeout=ready_timeout,
                         prefix=prefix, log_level="warning", name=node_id, wait=wait)

    @property
    def endpoint(self) -> str:
        return self.url


class Swarms:
    """Everything one test starts (swarms, actors, proxies, node processes), stopped in reverse order when the test
    ends, passed or failed: the ``swarms`` fixture. Stopping something early (``swarm.stop()``) is fine: every stop
    is idempotent."""

    def __init__(self) -> None:
        self._stack = contextlib.AsyncExitStack()

    async def start(self, settings: Settings, backends: Sequence[Backend], *, model_id: str = STUB_MODEL,
                    wire_dtype: str = "f32") -> Swarm:
        """``start_swarm``: a tracker, a node per backend and a gateway, with ``model_id`` routable."""
        swarm = await start_swarm(settings, backends, model_id=model_id, wire_dtype=wire_dtype)
        self._stack.push_async_callback(swarm.stop)
        return swarm

    async def actor(self, actor: A) -> A:
        """``actor`` (a Tracker, Node or Gateway of the test's own making), started."""
        return await self._stack.enter_async_context(actor)

    async def proxy(self, swarm: Swarm, node: Node) -> CountingProxy:
        """A ``CountingProxy`` in front of ``node``, once the tracker routes to ``node`` through it."""
        proxy = await CountingProxy.start(node.server.port)
        self._stack.push_async_callback(proxy.stop)
        await swarm.route_through(node, proxy.url)
        return proxy

    async def node_process(self, settings: Settings, node_id: str, args: list[str], **kw: Any) -> NodeProcess:
        """A ``NodeProcess`` (``swarmroute node`` as a child), started off the event loop: the test's in-process
        actors keep serving while it loads."""
        proc = await asyncio.to_thread(NodeProcess, settings, node_id, args, **kw)
        self._stack.push_async_callback(asyncio.to_thread, proc.close)
        return proc

    def on_teardown(self, callback: Callable[[], object]) -> None:
        """Run ``callback`` (and await what it returns, if anything) at teardown, before whatever was started
        earlier is stopped."""
        async def run() -> None:
            result = callback()
            if inspect.isawaitable(result):
                await result

        self._stack.push_async_callback(run)

    def pop_all(self) -> Swarms:
        """Hand everything started so far to a new ``Swarms`` (this one then stops nothing): start several things in
        ``async with Swarms() as starting`` and keep them with ``starting.pop_all()`` once all are up."""
        kept = Swarms()
        kept._stack = self._stack.pop_all()
        return kept

    async def aclose(self) -> None:
        """Stop everything started, newest first."""
        await self._stack.aclose()

    async def __aenter__(self) -> Swarms:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def make_settings(nats_url: str, home: Path, **overrides: object) -> Settings:
    """A test swarm's settings. Prefix reuse is ``chunk`` unless a test asks for the product's default, ``token``
    (the reuse suites do: test_llamacpp_reuse, test_reuse, test_prefix_pull, test_shared_prefill, ...): most suites
    compare a request with an earlier one of the same prompt, token for token or at 1e-4, which token reuse keeps
    only within llama.cpp's batch-shape rounding (docs/architecture.md, "Prefix reuse")."""
    base: dict[str, object] = dict(nats_url=nats_url, home=home, gateway_port=0, heartbeat_s=0.5, registry_ttl_s=2.0,
                                   hop_timeout_s=5.0, token_timeout_s=5.0, first_token_timeout_s=20.0,
                                   session_idle_ttl_s=60.0, telemetry_interval_s=0.05,
                                   client_probe_s=0.5,  # every test's sessions are probed, and must survive it
                                   prefix_reuse="chunk")
    base.update(overrides)
    return Settings(**base)  # type: ignore[arg-type]
