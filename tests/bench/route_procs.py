"""A llama.cpp route of real processes for the benchmarks: nats-server, ``swarmroute tracker``, one ``swarmroute node``
per layer range and one or more ``swarmroute gateway``, each its own process, as ``swarmroute up`` runs them
(tests.support.actors.ActorProcess / tests.support.swarm.NodeProcess, configured from a Settings); optionally every
node behind a proxy of its own; and a Prometheus scraper to read what one request cost from the difference of two
scrapes.

Not a benchmark itself (the runner only picks up ``bench_*.py``): ``bench_ttft``, ``bench_pipeline``,
``bench_speculation``, ``bench_gguf_route`` and ``bench_llamacpp`` use it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bus.server import EmbeddedNats, NatsServerConfig
from schemas.settings import Settings
from swarmroute.fleet_members import split_layers
from tests.support.actors import ActorProcess, ChildProcess
from tests.support.swarm import NodeProcess
from tests.support.up import free_port
from tests.support.waiting import eventually_sync

MODEL_ID = "gemma"
N_LAYERS = 18
"""Gemma 3 270M's blocks."""
READY_S = 600.0
"""How long a process may take to come up, and the route to become complete: llama.cpp on a loaded 2-core machine."""

Layers = tuple[int, int] | None
"""A node's layer range; None: the whole model (no ``--layers``)."""
AdvertiseUrl = Callable[[int], str]
"""Given a node's listen port, the URL it advertises instead (a proxy in front of it, which the caller owns)."""


def _with(settings: Settings, overrides: Mapping[str, Any] | None) -> Settings:
    """``settings`` with ``overrides`` on top, validated (``model_copy`` would take any value)."""
    return Settings(**{**settings.model_dump(), **(overrides or {})})


class DelayProxyProcess(ChildProcess):
    """tests/support/delay_proxy.py in its own process, forwarding to ``target_port`` ``delay_ms`` later each way."""

    def __init__(self, target_port: int, delay_ms: float, timeout: float = 60.0) -> None:
        super().__init__([sys.executable, "-m", "tests.support.delay_proxy", "--target-port", str(target_port),
                          "--delay-ms", str(delay_ms)])
        try:
            port = self.wait_for(r"^ready (\d+)$", timeout).group(1)
        except BaseException:
            self.kill()
            raise
        self.url = f"http://127.0.0.1:{port}"


class ProcessRoute:
    """``threads[i]`` is node i's ``--threads``; the nodes split the 18 layers near-evenly in order, or as ``layers``
    says (node 0 is the head, the last one the tail). Every process gets default Settings (on this route's NATS and
    ``home``) with ``settings`` on top; the nodes ``node_settings`` too, and each gateway its own entry of
    ``gateways`` (name -> overrides; one gateway, ``default``, unless given). ``max_sessions``, ``ctx``,
    ``model_id`` and ``wire_dtype`` are the nodes' options of those names (None: left to the node's default).
    ``delay_ms``: every node behind a ``DelayProxyProcess`` of that one-way delay (0 included); ``advertise_url``:
    behind a proxy of the caller's (only one of the two). ``hosts``: node i runs on host ``hosts[i]`` (a network
    namespace and its address, tests/support/netns.py) and NATS listens on ``nats_host`` (the hosts' bridge), so
    every hop crosses a network between hosts; tracker and gateways stay in this namespace. Returns once every
    gateway routes over all the nodes."""

    def __init__(self, model: Path, threads: Sequence[int], home: Path, *, max_sessions: int | None = 4,
                 ctx: int | None = 1024, layers: Sequence[Layers] | None = None, model_id: str | None = MODEL_ID,
                 wire_dtype: str | None = None, settings: Mapping[str, Any] | None = None,
                 node_settings: Mapping[str, Any] | None = None,
                 gateways: Mapping[str, Mapping[str, Any]] | None = None, delay_ms: float | None = None,
                 advertise_url: AdvertiseUrl | None = None, name: str = "bench",
                 hosts: Sequence[tuple[str, str]] | None = None, nats_host: str = "127.0.0.1") -> None:
        if delay_ms is not None and advertise_url is not None:
            raise ValueError("delay_ms and advertise_url both put a proxy in front of the nodes: give one")
        if hosts is not None and (delay_ms is not None or advertise_url is not None or len(hosts) != len(threads)):
            raise ValueError("hosts: one (namespace, address) per node, and no proxies (they listen on loopback)")
        self.nats = EmbeddedNats(NatsServerConfig(store_dir=home / "nats", host=nats_host)).start()
        self.settings = Settings(nats_url=self.nats.url, home=home, **(settings or {}))
        self.layers: list[Layers] = list(layers) if layers is not None else list(split_layers(N_LAYERS, len(threads)))
        self.delay_proxies: list[DelayProxyProcess] = []
        self.tracker: ActorProcess | None = None
        self.nodes: list[NodeProcess] = []
        self.gateways: dict[str, ActorProcess] = {}
        self.node_urls: list[str] = []
        """Each node's own listen URL (not its proxy's), in route order."""
        self.model = ""
        """The id the route serves the model under (a GGUF's is content-derived; ``model_id`` an alias)."""
        self._ports: list[int] = []
        try:
            self.tracker = ActorProcess("tracker", self.settings, [], wait=False)
            node_config = _with(self.settings, node_settings)
            for i, (span, n_threads) in enumerate(zip(self.layers, threads, strict=True)):
                self._node(node_config, f"{name}-{i}", span, n_threads, model, max_sessions, ctx, model_id,
                           wire_dtype, delay_ms, advertise_url, None if hosts is None else hosts[i])
            for gateway, overrides in (gateways or {"default": {}}).items():
                self.gateways[gateway] = ActorProcess(
                    "gateway", _with(self.settings, overrides), ["--port", "0"], log_level="warning",
                    name=f"gateway {gateway}", wait=False)
            for child in self._actors():
                child.ready(READY_S)
            self.node_urls = [node.url if port == 0 else f"http://127.0.0.1:{port}"
                              for node, port in zip(self.nodes, self._ports, strict=True)]
            for url in self.urls.values():
                served = eventually_sync(functools.partial(self._routed, url), timeout=READY_S, interval=0.5,
                                         ignoring=(OSError,),
                                         what=f"a complete route over {len(self.nodes)} nodes at {url}")
                assert served is not None  # eventually_sync returns only a truthy result
                self.model = served
        except BaseException:
            self.close()
            raise

    def _node(self, settings: Settings, node_id: str, span: Layers, threads: int, model: Path,
              max_sessions: int | None, ctx: int | None, model_id: str | None, wire_dtype: str | None,
              delay_ms: float | None, advertise_url: AdvertiseUrl | None, host: tuple[str, str] | None) -> None:
        args = ["--backend", "llamacpp", "--model", str(model), "--threads", str(threads)]
        prefix: list[str] = []
        if host is not None:
            prefix = ["ip", "netns", "exec", host[0]]
            args += ["--host", host[1]]
        for flag, value in (("--layers", None if span is None else f"{span[0]}:{span[1]}"),
                            ("--model-id", model_id), ("--ctx", ctx), ("--max-sessions", max_sessions),
                            ("--wire-dtype", wire_dtype)):
            if value is not None:
                args += [flag, str(value)]
        port = 0
        if delay_ms is not None or advertise_url is not None:
            port = free_port()  # the proxy needs it before the node starts
            if delay_ms is not None:
                self.delay_proxies.append(DelayProxyProcess(port, delay_ms))
                advertised = self.delay_proxies[-1].url
            else:
                assert advertise_url is not None
                advertised = advertise_url(port)
            args += ["--advertise-url", advertised]
        self._ports.append(port)
        self.nodes.append(NodeProcess(settings, node_id, [*args, "--port", str(port)], wait=False, prefix=prefix))

    def _actors(self) -> list[ActorProcess]:
        """The swarmroute processes, in the order they stop: gateways, nodes (tail first), tracker."""
        tracker = [self.tracker] if self.tracker is not None else []
        return [*self.gateways.values(), *reversed(self.nodes), *tracker]

    def _routed(self, url: str) -> str | None:
        """The complete model's id once ``url``'s gateway routes it over every node; None before."""
        for child in [*self._actors(), *self.delay_proxies]:
            if child.proc.poll() is not None:
                what = getattr(child, "name", "a delay proxy")
                raise RuntimeError(f"{what} exited ({child.proc.poll()}) while starting:\n{child.tail()}")
        with urllib.request.urlopen(f"{url}/models", timeout=10) as r:
            models = [m for m in json.load(r)["data"] if m.get("complete")]
        return models[0]["id"] if models and len(models[0]["nodes"]) == len(self.nodes) else None

    @property
    def urls(self) -> dict[str, str]:
        """Each gateway's OpenAI API base URL, by name."""
        return {name: f"{g.url}/v1" for name, g in self.gateways.items()}

    @property
    def gateway_url(self) -> str:
        """The first gateway's base URL (its ``/metrics`` is there)."""
        return next(iter(self.gateways.values())).url

    @property
    def url(self) -> str:
        """The first gateway's OpenAI API base URL."""
        return f"{self.gateway_url}/v1"

    def close(self) -> None:
        """Every process (each stopped even if stopping another fails: ``ChildProcess.stop`` escalates to SIGKILL),
        then NATS."""
        with contextlib.ExitStack() as stops:
            stops.callback(self.nats.stop)
            for child in reversed([*self._actors(), *self.delay_proxies]):  # an ExitStack runs its callbacks last first
                stops.callback(child.stop)


def scrape(url: str) -> dict[str, float]:
    """A Prometheus text page (``url`` + ``/metrics``) as ``{"name{labels}": value}``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            values[name] = float(value)
        except ValueError:
            continue
    return values


def delta(before: Mapping[str, float], after: Mapping[str, float], name: str) -> float:
    """How much one series grew between two scrapes (0 if it is in neither)."""
    return after.get(name, 0.0) - before.get(name, 0.0)


def load_line(load: Sequence[float]) -> str:
    """The load averages a bench sampled, and why its ratios (not its timings) are what to compare."""
    return (f"load average (1 min) at the start, after each round: {', '.join(f'{x:.1f}' for x in load)} on "
            f"{os.cpu_count()} cores (the machine is shared: compare ratios within this run)")
