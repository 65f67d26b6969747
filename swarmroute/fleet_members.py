"""What each member of a fleet (``schemas.fleet``) runs: its layer range, its ``swarmroute <role> ...`` command line,
and, to run a whole fleet on this machine, its child process.

One child-spec builder for both launchers: ``fleet up FILE`` (each child reads its member from the file, so its
secrets never appear on a command line) and ``up`` (a fleet built in memory from ``up``'s options: each child is
given its member's command line itself, and its settings come from this process's environment and flags, as for
any actor). Node command lines are built here only.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from bus.server import EmbeddedNats
from schemas.errors import BadRequestError
from schemas.fleet import Fleet, GatewaySpec, MemberRole, NodeSpec, SeederSpec, parse_listen
from swarmroute.supervisor import ChildSpec, Supervisor, run_supervised

# ---- layer ranges -----------------------------------------------------------------------------------------------


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


def _gguf_layers(path: Path) -> int:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    return int(reader.fields[f"{arch}.block_count"].parts[-1][0])


def model_layers(fleet: Fleet, key: str) -> int:
    """The model's layer count: from the file, else from the GGUF header at ``path`` (read only, never fetched)."""
    spec = fleet.models[key]
    if spec.layer_count is not None:
        return spec.layer_count
    if spec.path is not None and spec.path.is_file():
        return _gguf_layers(spec.path)
    where = spec.path or "the bundled model (not assembled here)"
    raise BadRequestError(f"models.{key}.n_layers: needed for layers: auto, and no GGUF is readable at {where}",
                          code="invalid_fleet")


def _planned(fleet: Fleet, key: str, nodes: list[tuple[int, NodeSpec]]) -> list[tuple[int, int]]:
    """Memory-proportional ranges from the planner (artifacts.layer_split), sized for each node's sessions."""
    from artifacts.layer_split import NodeSpec as PlanNode
    from artifacts.layer_split import PlanSettings, parse_nodes, split
    from artifacts.plan import load_shape

    spec = fleet.models[key]
    if spec.path is None or not spec.path.is_file():
        raise BadRequestError(f"models.{key}.path: the planner (nodes with memory) needs the model's GGUF or shape "
                              f"file here", code="invalid_fleet")
    plan_nodes = [PlanNode(n.name, parse_nodes([n.memory or ""])[0].memory_bytes) for _, n in nodes]
    context = max((n.ctx or spec.context or 4096) for _, n in nodes)
    sessions = max(n.max_sessions for _, n in nodes)
    plan = split(load_shape(spec.path), plan_nodes, PlanSettings(context=context, sessions=sessions))
    if plan.unused:
        unused = {u.label for u in plan.unused}
        first = next(i for i, n in nodes if n.name in unused)
        raise BadRequestError(f"nodes[{first}].memory: the planner needs no layers on {', '.join(sorted(unused))}; "
                              f"remove them or give explicit ranges", code="invalid_fleet")
    return [(a.start, a.end) for a in plan.assignments]


def resolve_layers(fleet: Fleet) -> dict[str, tuple[int, int] | None]:
    """Every node's ``[start, end)``: explicit ranges as written, ``auto`` split per model in file order; None for
    an ``auto`` node of a model fetched from the swarm (the tracker assigns its range when it joins)."""
    ranges: dict[str, tuple[int, int] | None] = {}
    for key, spec in fleet.models.items():
        nodes = [(i, n) for i, n in enumerate(fleet.nodes) if fleet.model_key(n) == key]
        if spec.from_swarm:
            ranges.update((n.name, n.fixed_range) for _, n in nodes)
            continue
        if all(n.fixed_range is not None for _, n in nodes):
            ranges.update((n.name, n.fixed_range) for _, n in nodes if n.fixed_range is not None)
            continue
        if all(n.memory is not None for _, n in nodes):
            split = _planned(fleet, key, nodes)
        else:
            split = split_layers(model_layers(fleet, key), len(nodes))
        ranges.update((n.name, r) for (_, n), r in zip(nodes, split, strict=True))
    return ranges


# ---- command lines ----------------------------------------------------------------------------------------------

def _node_argv(fleet: Fleet, node: NodeSpec, layers: tuple[int, int] | None) -> list[str]:
    key = fleet.model_key(node)
    model = fleet.models[key]
    host, port = parse_listen(node.listen)
    argv = ["--node-id", node.name, "--backend", model.backend, "--max-sessions", str(node.max_sessions),
            "--wire-dtype", node.wire_dtype, "--host", host, "--port", str(port)]
    if layers is not None:
        argv += ["--layers", f"{layers[0]}:{layers[1]}"]
    if model.from_swarm:  # start empty: fetch the (assigned) range from the seeders
        assert model.sha256 is not None
        argv += ["--model-id", model.sha256, "--alias", fleet.model_id(key)]
        if node.memory is not None:
            argv += ["--memory", node.memory.replace(" ", "")]
        if model.manifest_id is not None:
            argv += ["--manifest-id", model.manifest_id]
    else:
        argv += ["--model-id", fleet.model_id(key)]
    if model.backend == "stub":
        argv += ["--model", fleet.model_id(key), "--n-layers", str(model.layer_count),
                 "--hidden-shape", "x".join(map(str, model.hidden_shape)), "--stub-delay", str(model.stub_delay)]
    elif model.path is not None and not model.from_swarm:
        argv += ["--model", str(model.path)]
    ctx = node.ctx or model.context
    if ctx:
        argv += ["--ctx", str(ctx)]
    if node.threads:
        argv += ["--threads", str(node.threads)]
    if node.advertise_url:
        argv += ["--advertise-url", node.advertise_url]
    if model.allow_unproven_architecture:
        argv.append("--allow-unproven-architecture")
    return argv


def _seeder_argv(fleet: Fleet, seeder: SeederSpec) -> list[str]:
    model = fleet.models[fleet.model_key(seeder)]
    path = seeder.path or (model.path if model.path is not None else None)
    if seeder.from_store:  # its store holds the artifact already: seeded by id, no GGUF read
        assert model.sha256 is not None
        source = model.sha256
    else:
        source = str(path) if path is not None else "bundled"
    host, port = parse_listen(seeder.listen)
    argv = [source, "--node-id", seeder.name, "--listen-host", host, "--listen-port", str(port)]
    if seeder.upload_limit:
        argv += ["--upload-limit", str(seeder.upload_limit)]
    if model.allow_unproven_architecture:  # the shards it verifies (and repairs) are of an unproven architecture
        argv.append("--allow-unproven-architecture")
    return argv


def member_argv(fleet: Fleet, role: MemberRole, name: str,
                layers: dict[str, tuple[int, int] | None] | None = None) -> list[str]:
    """The ``swarmroute <role> ...`` arguments this member runs with (no secrets: those come from Settings)."""
    member = fleet.member(role, name)
    if isinstance(member, NodeSpec):
        ranges = layers if layers is not None else resolve_layers(fleet)
        return [role, *_node_argv(fleet, member, ranges[name])]
    if isinstance(member, SeederSpec):
        return [role, *_seeder_argv(fleet, member)]
    if isinstance(member, GatewaySpec):
        host, port = parse_listen(member.listen)
        return [role, "--host", host, "--port", str(port)]
    return [role]


# ---- a whole fleet on this machine ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LocalFleet:
    """Every member of ``fleet`` as a child process of this one. Built before anything starts: a fleet whose layers
    cannot be resolved fails here, once, rather than in every child."""

    fleet: Fleet
    home: Path
    log_level: str
    file: Path | None = None
    """``fleet up``: each child reads its member (and its settings, secrets included) from this file. Without it
    (``up``), each child gets its member's command line and the fleet's namespace, and nothing else of the fleet:
    such a fleet has no settings, secrets or credentials to pass."""

    homes: Mapping[str, Path] = dataclasses.field(default_factory=dict)
    """A member's own home instead of ``home`` (``up --from-swarm``: one store per node, as on separate machines)."""

    node_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Added to every node's environment (``up``: nodes sharing this machine's cores)."""

    layers: dict[str, tuple[int, int] | None] = dataclasses.field(init=False)
    """Every node's range (``resolve_layers``)."""

    def __post_init__(self) -> None:
        f = self.fleet
        if self.file is None and (f.settings or f.secrets or f.nats.auth or any(g.api_keys for g in f.gateways)):
            raise BadRequestError("a fleet run without its file cannot hand its members settings, secrets or "
                                  "credentials: run it with fleet up FILE", code="invalid_fleet")
        object.__setattr__(self, "layers", resolve_layers(f))

    def argv(self, role: MemberRole, name: str, nats_url: str | None) -> list[str]:
        """``python -m swarmroute <role> ...`` of one member; ``nats_url`` (``--nats``) wins over the file's."""
        own = ([role, "--fleet", str(self.file), "--name", name] if self.file is not None
               else [*member_argv(self.fleet, role, name, self.layers), "--namespace", self.fleet.namespace])
        common = ["--log-level", self.log_level, "--home", str(self.homes.get(name, self.home))]
        return [sys.executable, "-m", "swarmroute", *own, *common, *(["--nats", nats_url] if nats_url else [])]

    def child_specs(self, nats_url: str | None) -> list[ChildSpec]:
        """One child per member, in the fleet's order (trackers, seeders, nodes, gateways); without a tracker or
        a gateway nothing is served, so those are essential."""
        return [ChildSpec(member.name, self.argv(role, member.name, nats_url), essential=role not in ("node", "seeder"),
                          env=dict(self.node_env) if role == "node" else {})
                for role, member in self.fleet.members()]

    def run(self, command: str, ready: Callable[[Supervisor], str], *, nats_url: str | None,
            nats: EmbeddedNats | None = None) -> int:
        """Supervise the children until a stop signal (``swarmroute.supervisor``, which also stops ``nats``);
        ``ready`` waits for them and returns the banner."""
        return run_supervised(command, self.child_specs(nats_url), ready, nats=nats)
