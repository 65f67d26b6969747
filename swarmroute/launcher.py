"""``swarmroute up``: embedded NATS, a tracker, N nodes splitting the layers, and the gateway, as child processes.

Each actor is its own process (as on a real fleet), so a node can be killed without taking the others with it;
``swarmroute.supervisor`` names a child that dies and restarts it; Ctrl-C (or SIGTERM) stops every child.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

from bus.server import EmbeddedNats, NatsServerConfig
from schemas.settings import Settings
from swarmroute.supervisor import ChildSpec, Supervisor, run_supervised


def split_layers(n_layers: int, n_nodes: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal ranges covering [0, n_layers)."""
    if not 1 <= n_nodes <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers over {n_nodes} nodes")
    base, extra = divmod(n_layers, n_nodes)
    ranges, start = [], 0
    for i in range(n_nodes):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def _model_layers(args: argparse.Namespace, settings: Settings) -> tuple[str, int]:
    if args.backend == "stub":
        return args.model or "stub-model", args.n_layers
    if args.backend == "torch" and args.model:
        from actors.backends.torch.models import TINY_MODELS

        if args.model in TINY_MODELS:
            return args.model_id or args.model, int(TINY_MODELS[args.model]().num_hidden_layers)
    from artifacts.gguf_layout import read_layout
    from swarmroute.backends import default_model_path

    path = Path(args.model) if args.model else default_model_path(settings)
    args.model = str(path)
    if args.backend == "llamacpp":
        from swarmroute.artifact_prep import import_model

        import_model(settings.home, path)  # once here, rather than racing in every node
    layout = read_layout(path)  # the header only: gguf's GGUFReader takes ~20 s on a 262k vocabulary
    n_layers = int(layout.n_layers)
    name = str(layout.value("general.name") or path.stem)
    return args.model_id or slug(name), n_layers


def slug(name: str) -> str:
    """A model name clients can type: 'Gemma 3 270m' -> 'gemma-3-270m' (nodes advertise it as an alias)."""
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split()) or "model"


def child_argv(args: argparse.Namespace, settings: Settings, nats_url: str, role: str, extra: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "swarmroute", role, "--nats", nats_url, "--home", str(settings.home),
            "--namespace", settings.namespace, "--log-level", args.log_level or "warning"]
    return argv + extra


def _node_extra(args: argparse.Namespace, model_id: str, index: int, layers: tuple[int, int],
                n_local: int) -> list[str]:
    extra = ["--backend", args.backend, "--node-id", f"node-{index + 1}", "--layers", f"{layers[0]}:{layers[1]}",
             "--model-id", model_id, "--max-sessions", str(args.max_sessions), "--wire-dtype", args.wire_dtype,
             "--threads", str(args.threads or local_threads(n_local))]
    if args.model:
        extra += ["--model", args.model]
    if args.ctx:
        extra += ["--ctx", str(args.ctx)]
    if args.allow_unproven_architecture:
        extra.append("--allow-unproven-architecture")
    if args.backend == "stub":
        extra += ["--n-layers", str(args.n_layers), "--hidden-shape", "x".join(map(str, args.hidden_shape))]
    return extra


def wait_ready(url: str, model_id: str, supervisor: Supervisor, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not supervisor.check():
            raise RuntimeError(supervisor.failed or "a child process exited during start-up")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
                models = json.load(r)["data"]
            if any(model_id in (m["id"], m.get("name"), *m.get("aliases", [])) for m in models if m.get("complete")):
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the swarm did not become ready within {timeout:g}s")


def local_threads(n_local: int) -> int:
    """Compute threads of each of ``n_local`` nodes sharing this machine: an equal share of its cores, at least one
    (an explicit ``--threads`` wins). A single session computes on one node at a time, so every core per node looks
    free; measured, it is not: the other actors (the idle node, gateway, tracker, NATS) wake on every token, a
    descheduled thread stalls ggml's barriers, and a node with every core decoded no faster than one with its share
    and with far more spread (tests/bench/bench_up.py, docs/operations.md "Cores on one machine")."""
    try:
        cores = len(os.sched_getaffinity(0))  # what this process may run on (a container's CPU set)
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, n_local))


LOCAL_NODE_ENV = {"OMP_WAIT_POLICY": "passive"}
"""Nodes sharing one machine: OpenMP threads sleep as soon as a graph ends instead of spinning (its default), so a
node with several threads leaves the cores to the node that computes next (and so would an event loop polling for
its next frame, which is off by default) (tests/bench/bench_up.py measures both). The operator's own environment
wins (for OpenMP, either of its wait settings)."""


def local_node_env() -> dict[str, str]:
    own = set(os.environ) | ({"OMP_WAIT_POLICY"} if "GOMP_SPINCOUNT" in os.environ else set())
    return {k: v for k, v in LOCAL_NODE_ENV.items() if k not in own}


def _specs(args: argparse.Namespace, settings: Settings, nats_url: str, model_id: str,
           ranges: list[tuple[int, int]], host: str) -> list[ChildSpec]:
    specs = [ChildSpec("tracker", child_argv(args, settings, nats_url, "tracker", []), essential=True)]
    specs += [ChildSpec(f"node-{i + 1}", child_argv(args, settings, nats_url, "node",
                                                     _node_extra(args, model_id, i, layers, len(ranges))),
                       env=local_node_env())
              for i, layers in enumerate(ranges)]
    specs.append(ChildSpec("gateway", child_argv(args, settings, nats_url, "gateway",
                                                  ["--host", host, "--port", str(args.port)]), essential=True))
    return specs


def run_up(args: argparse.Namespace, settings: Settings) -> int:
    if getattr(args, "from_swarm", False):  # one seeder + N empty nodes: the provisioning path, on one machine
        from swarmroute.swarm_up import run_up_from_swarm

        return run_up_from_swarm(args, settings)
    n_nodes = args.nodes or 2  # the distributed route is the product, so it is the default (--nodes 1 for one)
    model_id, n_layers = _model_layers(args, settings)
    ranges = split_layers(n_layers, n_nodes)
    host = args.host or settings.bind_host
    if args.port is None:
        args.port = settings.gateway_port
    settings.home.mkdir(parents=True, exist_ok=True)
    nats = EmbeddedNats(NatsServerConfig(store_dir=settings.home / "nats-up", host=settings.bind_host))
    nats.start()
    url = f"http://{host}:{args.port}"

    def ready(supervisor: Supervisor) -> str:
        wait_ready(url, model_id, supervisor, timeout=600)
        route = " -> ".join(f"node-{i + 1}[{a},{b})" for i, (a, b) in enumerate(ranges))
        return f"""
swarmroute is up: {args.backend} backend, model {model_id!r}, route {route}
  NATS      {nats.url}
  gateway   {url}/v1   (OpenAI-compatible)

  curl {url}/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model": "{model_id}", "messages": [{{"role": "user", "content": "Hello!"}}], "stream": true}}'

  python -c "import openai; c = openai.OpenAI(base_url='{url}/v1', api_key='none'); \\
print(c.chat.completions.create(model='{model_id}', \\
messages=[{{'role': 'user', 'content': 'Hello!'}}]).choices[0].message.content)"

  swarmroute watch --nats {nats.url}     (live sessions and telemetry)
Ctrl-C stops everything."""

    return run_supervised("up", _specs(args, settings, nats.url, model_id, ranges, host), ready, nats=nats)
