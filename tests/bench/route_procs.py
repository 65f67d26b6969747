"""A llama.cpp route of real processes for the benchmarks: nats-server, ``swarmroute tracker``, one ``swarmroute node``
per layer range and ``swarmroute gateway``, each its own process, as ``swarmroute up`` runs them; and a Prometheus
scraper to read what one request cost from the difference of two scrapes.

Not a benchmark itself (the runner only picks up ``bench_*.py``): ``bench_ttft`` and ``bench_pipeline`` use it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from bus.server import EmbeddedNats, NatsServerConfig
from swarmroute.fleet_members import split_layers
from tests.bench.bench_llamacpp import _routable, free_port, stop, wait_http
from tests.support.waiting import eventually_sync

MODEL_ID = "gemma"
N_LAYERS = 18
"""Gemma 3 270M's blocks."""


class ProcessRoute:
    """``threads[i]`` is node i's ``--threads``; the nodes split the 18 layers near-evenly in order, or as ``layers``
    says (node 0 is the
    head, the last one the tail). ``env``: extra environment (``SWARMROUTE_*`` settings) for every process."""

    def __init__(self, model: Path, threads: Sequence[int], home: Path, *, max_sessions: int = 4, ctx: int = 1024,
                 env: Mapping[str, str] | None = None, layers: Sequence[tuple[int, int]] | None = None) -> None:
        import os

        self.nats = EmbeddedNats(NatsServerConfig(store_dir=home / "nats")).start()
        self.port = free_port()
        environment = {**os.environ, **(env or {})}
        common = ["--nats", self.nats.url, "--home", str(home), "--log-level", "warning"]
        swarm = [sys.executable, "-m", "swarmroute"]
        self.procs: list[subprocess.Popen[bytes]] = [subprocess.Popen([*swarm, "tracker", *common], env=environment)]
        self.node_urls: list[str] = []
        self.layers = list(layers) if layers is not None else split_layers(N_LAYERS, len(threads))
        try:
            for i, ((a, b), n_threads) in enumerate(zip(self.layers, threads, strict=True)):
                port = free_port()
                self.node_urls.append(f"http://127.0.0.1:{port}")
                self.procs.append(subprocess.Popen(
                    [*swarm, "node", *common, "--backend", "llamacpp", "--model", str(model), "--model-id", MODEL_ID,
                     "--layers", f"{a}:{b}", "--threads", str(n_threads), "--ctx", str(ctx), "--max-sessions",
                     str(max_sessions), "--node-id", f"bench-{i}", "--port", str(port)],
                    stdout=subprocess.DEVNULL, env=environment))
            self.procs.append(subprocess.Popen([*swarm, "gateway", *common, "--port", str(self.port)],
                                               stdout=subprocess.DEVNULL, env=environment))

            def routed() -> bool:
                wait_http(f"{self.url}/models", _routable, self.procs, 600)
                with urllib.request.urlopen(f"{self.url}/models", timeout=10) as r:
                    models = [m for m in json.load(r)["data"] if m.get("complete")]
                return bool(models) and len(models[0]["nodes"]) == len(threads)

            eventually_sync(routed, timeout=600, interval=0.5, what=f"a complete route over {len(threads)} nodes")
        except BaseException:
            self.close()
            raise

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI API's base URL."""
        return f"{self.gateway_url}/v1"

    def close(self) -> None:
        stop(self.procs)
        self.nats.stop()


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
