"""``swarmroute up --from-swarm``: the whole provisioning path on one machine. One seeder holds the GGUF; N nodes
start with empty stores and only the model's id, are assigned their layers by the tracker, fetch exactly those
pieces from the seeder (and from each other) over libtorrent, verify them and serve.

Every process has its own home (its own store), as separate machines would. All nodes see the same machine's
memory, so each is given a ``--memory`` that makes the tracker split the model over exactly N of them: the
smallest memory with which N such nodes joining one by one complete a route, when fewer could not (computed with
the tracker's own decision, ``actors.tracker.assignment``), unless ``--node-memory`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

from bus.server import EmbeddedNats, NatsServerConfig
from schemas.errors import BadRequestError
from schemas.fleet import ModelSpec, SeederSpec
from schemas.manifest import ModelManifest
from schemas.settings import Settings
from swarmroute.backends import DEFAULT_SESSIONS
from swarmroute.fleet_members import LocalFleet
from swarmroute.launcher import (
    apply_measured_share,
    first_key,
    listen,
    local_fleet,
    local_node_env,
    local_threads,
    slug,
    up_fleet,
    wait_ready,
)
from swarmroute.supervisor import Supervisor

DEFAULT_CONTEXT = 4096
"""The node's context when ``--ctx`` is not given (``LlamaCppConfig.n_ctx``'s default)."""


def nodes_needed(manifest: ModelManifest, memory: int, *, context: int, sessions: int, limit: int) -> int | None:
    """How many nodes of ``memory`` joining one by one the tracker needs to complete a route (None: more than
    ``limit``, or never)."""
    from actors.tracker.assigner import RESERVE, fit_from_manifest
    from actors.tracker.assignment import AssignmentImpossible, Claim, decide, reachable

    fit = fit_from_manifest(manifest, context=context, sessions=sessions, allow_unproven=False)
    claims: list[Claim] = []
    while len(claims) < limit:
        try:
            d = decide(fit, claims, memory * (1 - RESERVE))
        except AssignmentImpossible:
            return None
        claims.append(Claim(f"n{len(claims)}", d.start, d.end))
        if manifest.n_layers in reachable([(c.start, c.end) for c in claims], manifest.n_layers)[0]:
            return len(claims)
    return None


def memory_for(manifest: ModelManifest, n_nodes: int, *, context: int, sessions: int) -> int:
    """A node memory that makes the tracker use exactly ``n_nodes``: midway between the least memory with which
    ``n_nodes`` complete a route and the least with which fewer do."""
    from actors.tracker.assigner import RESERVE, fit_from_manifest

    whole = fit_from_manifest(manifest, context=context, sessions=sessions, allow_unproven=False).cost(
        0, manifest.n_layers)
    top = int(whole / (1 - RESERVE)) + 1

    def least(k: int) -> int:
        """The least memory with which at most ``k`` nodes complete a route (``top`` holds the whole model)."""
        lo, hi = 1, top
        while lo < hi:
            mid = (lo + hi) // 2
            if nodes_needed(manifest, mid, context=context, sessions=sessions, limit=k) is not None:
                hi = mid
            else:
                lo = mid + 1
        return lo

    exact = least(n_nodes)
    if nodes_needed(manifest, exact, context=context, sessions=sessions, limit=n_nodes) != n_nodes:
        raise BadRequestError(f"the tracker cannot split model {manifest.name or manifest.model_id[:12]} "
                              f"({manifest.n_layers} layers) over exactly {n_nodes} nodes; try fewer")
    return (exact + least(n_nodes - 1)) // 2 if n_nodes > 1 else int(exact * 1.1)


def _served_ranges(url: str, model_id: str) -> list[tuple[str, list[int]]]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
        for m in json.load(r)["data"]:
            if m["id"] == model_id:
                return sorted(zip(m["nodes"], m["layer_ranges"], strict=True), key=lambda x: x[1])
    return []


def run_up_from_swarm(args: argparse.Namespace, settings: Settings) -> int:
    from swarmroute.artifact_prep import import_model
    from swarmroute.backends import default_model_path

    if args.backend != "llamacpp":
        print("swarmroute up --from-swarm: only the llamacpp backend fetches from the swarm", file=sys.stderr)
        return 2
    n_nodes = args.nodes or 2
    root = settings.home / "up-swarm"
    seeder_home = root / "seeder"
    path = Path(args.model) if args.model else default_model_path(settings)
    manifest = import_model(seeder_home, path)  # the seeder's store: a hard link of the file where possible
    alias = args.model_id or slug(manifest.name or path.stem)
    context, sessions = args.ctx or DEFAULT_CONTEXT, args.max_sessions or DEFAULT_SESSIONS
    try:
        memory = args.node_memory or memory_for(manifest, n_nodes, context=context, sessions=sessions)
    except BadRequestError as exc:
        print(f"swarmroute up --from-swarm: {exc.message}", file=sys.stderr)
        return 2
    host = args.host or settings.bind_host
    if args.port is None:
        args.port = settings.gateway_port
    # The nodes start without the model, but this machine has it (the seeder's): measured on it, as plain up does.
    measuring = argparse.Namespace(**{**vars(args), "model": str(path)})
    apply_measured_share(measuring, settings, n_nodes)
    args.threads = measuring.threads
    # The nodes start empty with the model's id; the seeder seeds what the import above put in its store.
    model = ModelSpec(backend="llamacpp", id=alias, sha256=manifest.model_id,
                      allow_unproven_architecture=args.allow_unproven_architecture)
    seeder = SeederSpec(name="seeder", from_store=True, listen=listen(settings.bind_host, 0))
    homes = {"seeder": seeder_home, **{f"node-{i + 1}": root / f"node-{i + 1}" for i in range(n_nodes)}}
    local = local_fleet("up --from-swarm", lambda: LocalFleet(
        up_fleet(args, settings, model, nodes=n_nodes, gateway=listen(host, args.port), memory=f"{memory}B",
                 seeders=[seeder]), home=settings.home, log_level=args.log_level or "warning", homes=homes,
        node_env=local_node_env(n_nodes, args.threads or local_threads(n_nodes))))
    if local is None:
        return 2
    nats = EmbeddedNats(NatsServerConfig(store_dir=settings.home / "nats-up", host=settings.bind_host))
    nats.start()
    started = time.monotonic()
    url = f"http://{host}:{args.port}"

    def ready(supervisor: Supervisor) -> str:
        wait_ready(url, manifest.model_id, supervisor, timeout=1800, api_key=first_key(settings))
        route = " -> ".join(f"{node}[{a},{b})" for node, (a, b) in _served_ranges(url, manifest.model_id))
        return f"""
swarmroute is up from the swarm in {time.monotonic() - started:.0f}s: model {alias!r} ({manifest.model_id[:12]}),
one seeder holding the GGUF, {n_nodes} nodes that started empty with {memory / 2**20:.0f} MiB each and fetched only
their layers; route {route}
  NATS      {nats.url}
  gateway   {url}/v1   (OpenAI-compatible)

  curl {url}/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model": "{alias}", "messages": [{{"role": "user", "content": "Hello!"}}], "stream": true}}'

  swarmroute watch --nats {nats.url}     (nodes, fetches, live sessions)
Ctrl-C stops everything."""

    return local.run("up", ready, nats_url=nats.url, nats=nats)
