"""``swarmroute up``: embedded NATS, a tracker, N nodes splitting the layers, and the gateway, as child processes.

``up`` builds a fleet in memory from its options (``schemas.fleet``: one tracker, nodes ``node-1``..``node-N``
splitting the layers evenly, one gateway) and runs it with the launcher of ``fleet up``
(``swarmroute.fleet_members.LocalFleet``): the same node command lines, the same supervisor. Each actor is its own
process (as on a real fleet), so a node can be killed without taking the others with it; ``swarmroute.supervisor``
names a child that dies and restarts it; Ctrl-C (or SIGTERM) stops every child.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import ValidationError

from bus.server import EmbeddedNats, NatsServerConfig
from schemas.errors import SwarmrouteError, validation_message
from schemas.fleet import Fleet, GatewaySpec, ModelSpec, NodeSpec, SeederSpec, TrackerSpec
from schemas.settings import Settings
from swarmroute.backends import DEFAULT_CTX, DEFAULT_SESSIONS
from swarmroute.core_share import MAX_MODEL_BYTES, CoreShare, choose, operator_chose_wait
from swarmroute.fleet_members import LocalFleet
from swarmroute.supervisor import Supervisor


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


def wait_ready(url: str, model_id: str, supervisor: Supervisor, timeout: float, *,
               api_key: str | None = None) -> None:
    """Until the gateway at ``url`` lists ``model_id`` complete (asking with ``api_key`` when the gateway has keys:
    without it every answer is a 401 and the swarm never looks ready)."""
    deadline = time.monotonic() + timeout
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    while time.monotonic() < deadline:
        if not supervisor.check():
            raise RuntimeError(supervisor.failed or "a child process exited during start-up")
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/models", headers=headers), timeout=2) as r:
                models = json.load(r)["data"]
            if any(model_id in (m["id"], m.get("name"), *m.get("aliases", [])) for m in models if m.get("complete")):
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the swarm did not become ready within {timeout:g}s")


def first_key(settings: Settings) -> str | None:
    """One of the gateway's API keys, for the launcher's own requests to it."""
    return settings.api_keys[0].get_secret_value() if settings.api_keys else None


def machine_cores() -> int:
    """The cores this process may run on (a container's CPU set), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def local_threads(n_local: int) -> int:
    """Compute threads of each of ``n_local`` nodes sharing this machine: an equal share of its cores, at least one
    (an explicit ``--threads`` wins). A single session computes on one node at a time, so every core per node looks
    free; measured, it is not: the other actors (the idle node, gateway, tracker, NATS) wake on every token, a
    descheduled thread stalls ggml's barriers, and a node with every core decoded no faster than one with its share
    and with far more spread (tests/bench/bench_up.py, docs/operations.md "Cores on one machine")."""
    return max(1, machine_cores() // max(1, n_local))


PASSIVE_WAIT = {"OMP_WAIT_POLICY": "passive"}
"""OpenMP threads sleep as soon as a graph ends instead of spinning (libgomp's default spins ~300,000 times first)."""


def local_node_env(n_local: int, threads: int) -> dict[str, str]:
    """The environment of ``n_local`` nodes of ``threads`` compute threads each on this machine: OpenMP's passive
    wait only where their threads outnumber the cores. There the idle node's spinning threads take the cores from
    the node that computes next; where every thread has a core of its own, passive only adds a wake-up to every
    barrier: one node with both cores of an AMD EPYC decoded 89 tok/s with libgomp's default and 44 with passive
    (issue #26; docs/operations.md "Cores on one machine"). The operator's own environment wins (for OpenMP, either
    of its wait settings)."""
    if n_local * threads <= machine_cores() or operator_chose_wait():
        return {}
    return dict(PASSIVE_WAIT)


def measured_share(args: argparse.Namespace, settings: Settings, n_local: int) -> CoreShare | None:
    """The threads of ``up``'s local llama.cpp nodes as measured on this CPU (``swarmroute.core_share``), or None
    for the equal share: not llama.cpp, one node, the measurement turned off, the operator's own OpenMP wait (it
    wins), a model too large to measure at start, or a measurement that failed (said on stderr)."""
    if args.backend != "llamacpp" or n_local < 2 or not settings.up_measure_cores or not args.model:
        return None
    if operator_chose_wait():
        return None
    model = Path(args.model)
    if not model.is_file() or model.stat().st_size > MAX_MODEL_BYTES:
        return None
    try:
        return choose(model, n_local, machine_cores(), cache=settings.core_share_cache)
    except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
        print(f"swarmroute up: could not measure how the nodes share the cores ({exc}); an equal share each",
              file=sys.stderr, flush=True)
        return None


def apply_measured_share(args: argparse.Namespace, settings: Settings, n_local: int) -> None:
    """Unless ``--threads`` was given, set it to the measured share (``measured_share``), saying why on stderr."""
    if args.threads:
        return
    share = measured_share(args, settings, n_local)
    if share is not None:
        args.threads = share.threads
        print(f"swarmroute up: {share.why}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class UpSessions:
    """The session count of each of ``up``'s nodes, in route order, and why (``up`` prints it)."""

    counts: list[int]
    why: str


UP_SESSIONS_CAP = 64
"""The most sessions ``up`` gives a node from memory (issue #30). More cost start-up and memory, not speed
(``tests/bench/bench_up_sessions.py``, docs/operations.md): one node of the bundled model took ~50 s to come up
with 32 or 64 sessions and ~80 s with 253, at 1.1, 1.8 and 5.7 GB of RSS (~20 MiB per 4096-token session), and
one stream decodes as fast with any of them. 64 is the issue's burst, admitted at once; ``--max-sessions``
chooses more."""


def up_sessions(args: argparse.Namespace, path: Path | None, n_layers: int, n_nodes: int,
                memory: int | None = None, cap: int | None = None) -> UpSessions:
    """``--max-sessions`` if given; else, for llama.cpp nodes, what ``memory`` (default: this machine's available
    memory, ``swarmroute.provision.available_memory``) split evenly among the ``n_nodes`` local nodes holds for
    each node's layers at ``--ctx``: the planner's weights and KV cost per session, the computation ``swarmroute
    node --memory`` makes (``swarmroute.backends.sessions_in_memory``, issue #30), at most ``cap`` (``up`` gives
    ``UP_SESSIONS_CAP``). Other backends have no such cost model: ``DEFAULT_SESSIONS``."""
    if args.max_sessions:
        return UpSessions([args.max_sessions] * n_nodes, f"{args.max_sessions} sessions per node (--max-sessions)")
    if args.backend != "llamacpp" or path is None:
        return UpSessions([DEFAULT_SESSIONS] * n_nodes, f"{DEFAULT_SESSIONS} sessions per node (the {args.backend} "
                                                        f"backend's default; --max-sessions to choose)")
    from artifacts.plan import load_shape
    from swarmroute.backends import session_limit, sessions_in_memory
    from swarmroute.fleet_members import split_layers
    from swarmroute.provision import available_memory

    shape = load_shape(path)
    total = available_memory() if memory is None else memory
    each = total // n_nodes
    context = args.ctx or DEFAULT_CTX
    ranges = split_layers(n_layers, n_nodes)
    where = f"{_gib(each)} per node ({_gib(total)} available on this machine, split over {n_nodes})"
    counts = [sessions_in_memory(shape, start, end, each, context, what=where) for start, end in ranges]
    capped = f"; llama.cpp holds at most {session_limit()}" if session_limit() in counts else ""
    if cap is not None and max(counts) > cap:
        counts = [min(n, cap) for n in counts]
        capped = f"; up takes at most {cap}: more cost start-up and memory, not speed"
    held = ", ".join(f"node-{i + 1} [{a},{b}) {n}" for i, ((a, b), n) in enumerate(zip(ranges, counts, strict=True)))
    return UpSessions(counts, f"sessions per node from memory: {held} ({where} holds that many {context}-token "
                              f"caches beside the node's layers{capped}; --max-sessions to choose)")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def listen(host: str, port: int) -> str:
    """``host:port`` as a fleet file writes it (``[::1]:0`` for an IPv6 host)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def up_model(args: argparse.Namespace, model_id: str, n_layers: int) -> ModelSpec:
    """The model ``up`` serves (``_model_layers`` has resolved its id, layers and file)."""
    if args.backend == "stub":
        return ModelSpec(backend="stub", id=model_id, n_layers=n_layers, hidden_shape=list(args.hidden_shape),
                         stub_delay=args.stub_delay)
    return ModelSpec(backend=args.backend, id=model_id, path=Path(args.model), n_layers=n_layers,
                     allow_unproven_architecture=args.allow_unproven_architecture)


def up_fleet(args: argparse.Namespace, settings: Settings, model: ModelSpec, *, nodes: int, gateway: str,
             memory: str | None = None, seeders: Sequence[SeederSpec] = (),
             sessions: Sequence[int] | None = None) -> Fleet:
    """The fleet ``up`` runs: one tracker, ``node-1``..``node-N`` as ``up``'s options describe them (listening on
    the bind host, any free port; ``memory`` each, to be assigned their layers; ``sessions[i]`` sessions, else
    ``--max-sessions`` or ``DEFAULT_SESSIONS``; ``--threads`` each, else an equal share of this machine's cores,
    ``local_threads``), one gateway listening on ``gateway``, and ``seeders``; in this process's namespace."""
    threads = args.threads or local_threads(nodes)
    counts = list(sessions) if sessions is not None else [args.max_sessions or DEFAULT_SESSIONS] * nodes
    node_specs = [NodeSpec(name=f"node-{i + 1}", max_sessions=counts[i], ctx=args.ctx,
                           threads=threads, wire_dtype=args.wire_dtype, listen=listen(settings.bind_host, 0),
                           memory=memory)
                  for i in range(nodes)]
    return Fleet(name="up", namespace=settings.namespace, models={"model": model},
                 trackers=[TrackerSpec(name="tracker")], gateways=[GatewaySpec(name="gateway", listen=gateway)],
                 nodes=node_specs, seeders=list(seeders))


def local_fleet(command: str, build: Callable[[], LocalFleet]) -> LocalFleet | None:
    """``build()``, or None with the reason on stderr: options no fleet can be made of (more nodes than layers,
    a context below the fleet's minimum)."""
    try:
        return build()
    except ValidationError as exc:
        print(f"swarmroute {command}: {validation_message(exc)}", file=sys.stderr)
    except SwarmrouteError as exc:
        print(f"swarmroute {command}: {exc.message}", file=sys.stderr)
    return None


def run_up(args: argparse.Namespace, settings: Settings) -> int:
    if getattr(args, "from_swarm", False):  # one seeder + N empty nodes: the provisioning path, on one machine
        from swarmroute.swarm_up import run_up_from_swarm

        return run_up_from_swarm(args, settings)
    n_nodes = args.nodes or 2  # the distributed route is the product, so it is the default (--nodes 1 for one)
    model_id, n_layers = _model_layers(args, settings)
    host = args.host or settings.bind_host
    if args.port is None:
        args.port = settings.gateway_port
    chosen: list[UpSessions] = []
    apply_measured_share(args, settings, n_nodes)

    def fleet() -> LocalFleet:
        path = Path(args.model) if args.backend != "stub" and args.model else None
        chosen.append(up_sessions(args, path, n_layers, n_nodes, cap=UP_SESSIONS_CAP))
        return LocalFleet(
            up_fleet(args, settings, up_model(args, model_id, n_layers), nodes=n_nodes,
                     gateway=listen(host, args.port), sessions=chosen[0].counts),
            home=settings.home, log_level=args.log_level or "warning",
            node_env=local_node_env(n_nodes, args.threads or local_threads(n_nodes)))

    local = local_fleet("up", fleet)
    if local is None:
        return 2
    print(f"swarmroute up: {chosen[0].why}", file=sys.stderr, flush=True)
    settings.home.mkdir(parents=True, exist_ok=True)
    nats = EmbeddedNats(NatsServerConfig(store_dir=settings.home / "nats-up", host=settings.bind_host))
    nats.start()
    url = f"http://{host}:{args.port}"

    def ready(supervisor: Supervisor) -> str:
        wait_ready(url, model_id, supervisor, timeout=600, api_key=first_key(settings))
        route = " -> ".join(f"{name}[{r[0]},{r[1]})" for name, r in local.layers.items() if r is not None)
        return f"""
swarmroute is up: {args.backend} backend, model {model_id!r}, route {route}
  NATS      {nats.url}
  gateway   {url}/v1   (OpenAI-compatible)
  dashboard {url}/dashboard   (live: layer coverage, nodes, sessions, link RTTs, repairs)

  curl {url}/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model": "{model_id}", "messages": [{{"role": "user", "content": "Hello!"}}], "stream": true}}'

  python -c "import openai; c = openai.OpenAI(base_url='{url}/v1', api_key='none'); \\
print(c.chat.completions.create(model='{model_id}', \\
messages=[{{'role': 'user', 'content': 'Hello!'}}]).choices[0].message.content)"

  swarmroute watch --nats {nats.url}     (live sessions and telemetry)
Ctrl-C stops everything."""

    return local.run("up", ready, nats_url=nats.url, nats=nats)
