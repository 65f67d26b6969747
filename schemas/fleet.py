"""A fleet file: the whole deployment (NATS, trackers, gateways, nodes, models) in one declarative document.

Every machine reads the same file and picks its own member by name (``swarmroute node --fleet FILE --name X``);
``swarmroute fleet up FILE`` runs every member on one machine. YAML (``.yaml``/``.yml``) or TOML (``.toml``).

Secrets never appear in the file: credentials and API keys are references, ``{env: VAR}`` or ``{file: PATH}``,
resolved on the machine that runs the member. Errors name the field that is wrong, e.g. ``nodes[2].layers: ...``.

Layer ranges are ``START:END`` (half-open) or ``auto``; ``auto`` is resolved by ``swarmroute.fleet`` (even split,
or the memory planner when every auto node of the model gives ``memory``), because it may need the model's header.

Why one module of ~550 lines: one document's schema, whose sections are validated together (cross-checks
between models, nodes and settings).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from schemas.errors import BadRequestError
from schemas.node import LayerRange
from schemas.settings import Settings

S = TypeVar("S", bound="SecretRef")

Role = Literal["tracker", "node", "gateway", "monitor", "admin"]
"""NATS roles with their own credentials (deploy/nats/auth.conf): ``monitor`` is the read-only view operators' tools
use (``fleet status``, ``watch``); ``admin`` is for people, never given to an actor."""

BackendKind = Literal["llamacpp", "stub", "torch"]

MemberRole = Literal["tracker", "gateway", "node", "seeder"]
"""What a fleet member runs: ``swarmroute <role> --fleet FILE --name X``."""

_NAME = r"^[A-Za-z0-9_-]+$"
_LISTEN = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})$")
_NATS_URL = re.compile(r"^(nats|tls|ws|wss)://[^\s,]+$")
_SECRET_SETTINGS = {"nats_user", "nats_creds"} | {
    name for name, f in Settings.model_fields.items() if "SecretStr" in str(f.annotation)}
"""Credential settings: never in ``settings``; NATS ones come from ``nats.auth``, the rest from ``secrets``."""
_MEMBER_SETTINGS = {"tls_cert_file": "identity.cert", "tls_key_file": "identity.key"}
"""Settings one member alone may hold: fleet-wide, every member would share one key (and a key already held by a
live node is not registered for a second one)."""
_FLEET_OWNED_SETTINGS = {"nats_url", "namespace", "registry_replicas", "nats_randomize", "member_name", "home",
                         "nats_inbox_prefix", "log_level"}


class _Spec(BaseModel):
    """Fleet sections reject unknown keys: a typo must fail loudly, not be ignored."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


def parse_listen(value: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); ``[::1]:80`` for IPv6."""
    m = _LISTEN.match(value)
    if m is None or int(m.group("port")) > 65535:
        raise ValueError(f"{value!r} is not host:port (e.g. 127.0.0.1:9000, 0.0.0.0:8000)")
    return m.group("host").strip("[]"), int(m.group("port"))


def parse_range(value: str) -> tuple[int, int]:
    try:
        parsed = LayerRange.parse(value)
    except ValueError as exc:
        if ":" in value and all(x.strip().isdigit() for x in value.split(":", 1)):
            raise  # well-formed but empty: LayerRange says so
        raise ValueError(f"{value!r} is not START:END (half-open, e.g. 0:12) or auto") from exc
    return parsed.start, parsed.end


class SecretRef(_Spec):
    """Where a secret lives on the machine that runs the member: an environment variable or a file."""

    env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Name of an environment variable holding the secret."""

    file: Path | None = None
    """A file holding the secret (trailing newline stripped), e.g. a mounted Kubernetes secret."""

    @model_validator(mode="before")
    @classmethod
    def _no_inline(cls, data: object) -> object:
        if isinstance(data, str | int | float):
            raise ValueError("inline secrets are not allowed: write {env: VARIABLE} or {file: PATH}")
        return data

    @model_validator(mode="after")
    def _one_source(self) -> SecretRef:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of env or file")
        return self


class SecretSetting(SecretRef):
    """A secret ``Settings`` field (e.g. ``swarm_secret``) by reference, for the roles that need it."""

    roles: list[Literal["tracker", "node", "gateway"]] | None = None
    """Members that receive it (default: every role)."""


class RoleAuth(_Spec):
    """How one role authenticates to NATS: user + password, a token, or a credentials (JWT) file."""

    user: str | None = None
    password: SecretRef | None = None
    token: SecretRef | None = None
    creds: Path | None = None
    """NATS credentials file (JWT + nkey seed); the file itself is the secret."""

    inbox_prefix: str | None = Field(default=None, pattern=_NAME)
    """Reply-subject prefix of this role (default ``_INBOX_<role>``, as deploy/nats/auth.conf expects)."""

    @model_validator(mode="after")
    def _consistent(self) -> RoleAuth:
        if self.password is not None and self.user is None:
            raise ValueError("password needs a user")
        methods = sum(x is not None for x in (self.user, self.token, self.creds))
        if methods > 1:
            raise ValueError("choose one method: user/password, token, or creds")
        return self


class NatsSpec(_Spec):
    servers: list[str] = Field(default_factory=lambda: ["nats://127.0.0.1:4222"], min_length=1)
    """Client URLs of the NATS servers (one is enough to join a cluster; list all for a faster failover)."""

    embedded: bool = False
    """``fleet up`` starts a local nats-server (random loopback port) instead of using ``servers``."""

    embedded_config: Path | None = None
    """nats-server config for the embedded server (e.g. deploy/nats/single.conf for authentication)."""

    registry_replicas: int = Field(default=1, ge=1, le=5)
    """JetStream replicas of the node registry; 3 on a 3-server cluster so it survives losing a server."""

    randomize: bool = True
    """Shuffle the server list per connection (spreads clients); false connects to the first listed first."""

    auth: dict[Role, RoleAuth] = Field(default_factory=dict)
    """Credentials per role; a role not listed connects without credentials."""

    @field_validator("servers")
    @classmethod
    def _urls(cls, servers: list[str]) -> list[str]:
        for url in servers:
            if not _NATS_URL.match(url):
                raise ValueError(f"{url!r} is not a NATS URL like nats://host:4222")
        return servers


class ModelSpec(_Spec):
    backend: BackendKind = "llamacpp"
    """How nodes run it: llamacpp (GGUF), torch (reference) or stub (protocol test double)."""

    path: Path | None = None
    """GGUF file on each node's machine; omitted means the bundled Gemma 3 270M (llamacpp/torch)."""

    id: str | None = Field(default=None, min_length=1)
    """Model id to advertise and request (default: the model's key in ``models``)."""

    n_layers: int | None = Field(default=None, ge=1)
    """Layers of the whole model; needed for ``auto`` ranges unless ``path`` is readable where the file is read.
    Stub models default to 8."""

    context: int | None = Field(default=None, ge=16)
    """Context per session in tokens (default: the backend's)."""

    hidden_shape: list[int] = Field(default_factory=lambda: [64], min_length=1, max_length=4)
    """Stub only: per-position hidden shape."""

    stub_delay: float = Field(default=0.0, ge=0.0)
    """Stub only: artificial seconds of compute per step."""

    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """The GGUF's sha256, its artifact id (``swarmroute artifact build`` prints it). With it and no ``path``, nodes
    start empty and fetch only their layers from the fleet's ``seeders``; their ``auto`` layers are assigned by the
    tracker from each node's ``memory``."""

    manifest_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """With ``sha256``: the only manifest nodes accept (pinning, docs/artifacts.md "What is trusted")."""

    allow_unproven_architecture: bool = False
    """Let nodes cut, verify and serve, and seeders verify and seed, shards of an architecture the shard matrix has
    not proven bit-exact (docs/models/architectures.md); refused architectures stay refused."""

    @field_validator("hidden_shape")
    @classmethod
    def _positive(cls, shape: list[int]) -> list[int]:
        if any(d < 1 for d in shape):
            raise ValueError("every dimension must be at least 1")
        return shape

    @property
    def layer_count(self) -> int | None:
        return self.n_layers if self.n_layers is not None or self.backend != "stub" else 8

    @property
    def from_swarm(self) -> bool:
        """Nodes fetch this model from the swarm (an artifact id and no local path)."""
        return self.sha256 is not None and self.path is None

    @model_validator(mode="after")
    def _swarm_backend(self) -> ModelSpec:
        if self.sha256 is not None and self.backend != "llamacpp":
            raise ValueError("sha256: only llamacpp models are fetched from the swarm")
        if self.manifest_id is not None and self.sha256 is None:
            raise ValueError("manifest_id: pins the manifest of a model fetched from the swarm; give sha256 too")
        return self


class IdentitySpec(_Spec):
    """A member's data-plane key pair, as files on its own machine: a certificate (self-signed, or issued by the
    fleet's CA, ``settings.tls_ca_file``) and its private key (0600), both PEM."""

    cert: Path
    """The certificate (PEM); its key's fingerprint is the member's identity (docs/operations.md, Security)."""

    key: Path
    """The private key of ``cert`` (PEM, unencrypted, readable by its owner only)."""


class _Member(_Spec):
    name: str = Field(pattern=_NAME, max_length=64)
    """Unique in the fleet; what ``--name`` selects. A node's name is its node id."""

    nats_servers: list[str] | None = None
    """This member's NATS URLs, nearest first (with ``nats.randomize: false``); default ``nats.servers``."""

    @field_validator("nats_servers")
    @classmethod
    def _urls(cls, servers: list[str] | None) -> list[str] | None:
        return NatsSpec._urls(servers) if servers is not None else None


class TrackerSpec(_Member):
    pass


class GatewaySpec(_Member):
    listen: str = "127.0.0.1:8000"
    """host:port the OpenAI API listens on."""

    api_keys: list[SecretRef] = Field(default_factory=list)
    """Bearer keys clients must send; empty means no authentication."""

    identity: IdentitySpec | None = None
    """This member's data-plane key and certificate (``{cert: PATH, key: PATH}``, paths on its machine), instead of
    the key it creates on its first start under its home (``<home>/identity/<name>.key``). Checked when the member
    starts: a missing or unreadable file, a key readable by others or a certificate of another key stops it."""

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        parse_listen(value)
        return value


class NodeSpec(_Member):
    model: str | None = None
    """Key in ``models``; may be omitted when the fleet has a single model."""

    layers: str = "auto"
    """``START:END`` (half-open) or ``auto`` (split evenly, or by ``memory`` with the planner)."""

    memory: str | None = Field(default=None, pattern=r"^\s*\d+(\.\d+)?\s*[A-Za-z]*\s*$")
    """Memory for the model on this node (24GB, 512MiB): with ``auto``, the planner sizes ranges by it."""

    threads: int | None = Field(default=None, ge=1)
    """Compute threads (default: all cores)."""

    max_sessions: int = Field(default=4, ge=1)
    """Concurrent sessions (KV slots)."""

    ctx: int | None = Field(default=None, ge=16)
    """Context per session; overrides the model's ``context``."""

    listen: str = "127.0.0.1:0"
    """host:port of the node's binary HTTP API (port 0 picks a free one)."""

    advertise_url: str | None = Field(default=None, pattern=r"^https?://\S+$")
    """URL peers use to reach this node when it differs from ``listen`` (containers, NAT); ``https://`` when it
    serves TLS (off loopback, ``tls: auto``): the node pins its key into it."""

    wire_dtype: Literal["f32", "bf16", "f16"] = "f32"
    """Activation dtype on the wire."""

    identity: IdentitySpec | None = None
    """This member's data-plane key and certificate (``{cert: PATH, key: PATH}``, paths on its machine), instead of
    the key it creates on its first start under its home (``<home>/identity/<name>.key``). Checked when the member
    starts: a missing or unreadable file, a key readable by others or a certificate of another key stops it."""

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        parse_listen(value)
        return value

    @field_validator("layers")
    @classmethod
    def _layers(cls, value: str) -> str:
        if value != "auto":
            parse_range(value)
        return value

    @property
    def fixed_range(self) -> tuple[int, int] | None:
        return None if self.layers == "auto" else parse_range(self.layers)


class SeederSpec(_Member):
    """A machine that holds a model's GGUF and seeds it (``swarmroute seeder``), for nodes that fetch from the
    swarm."""

    model: str | None = None
    """Key in ``models``; may be omitted when the fleet has a single model."""

    path: Path | None = None
    """The GGUF on this machine (default: the model's ``path``, else the bundled Gemma 3 270M)."""

    listen: str = "127.0.0.1:0"
    """host:port the torrent listener binds (a loopback or private address nodes reach; port 0: any free one)."""

    upload_limit: int = Field(default=0, ge=0)
    """Bytes/s it uploads at most, 0 for no limit."""

    from_store: bool = False
    """Seed the artifact this seeder's store already holds, by the model's ``sha256``, instead of reading a GGUF
    (``swarmroute up --from-swarm`` imports the file into the seeder's store once, before it starts)."""

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        parse_listen(value)
        return value


class Fleet(_Spec):
    version: Literal[1] = 1
    """Fleet file format version."""

    name: str = Field(default="swarmroute", pattern=_NAME)
    """A label for humans (status output)."""

    namespace: str = Field(default="swarmroute", pattern=_NAME)
    """First token of every NATS subject; several fleets can share one NATS with different namespaces."""

    nats: NatsSpec = Field(default_factory=NatsSpec)
    settings: dict[str, Any] = Field(default_factory=dict)
    """Overrides of ``schemas.settings.Settings`` fields (heartbeat_s, token_timeout_s, ...) for every member."""

    secrets: dict[str, SecretSetting] = Field(default_factory=dict)
    """Secret ``Settings`` fields by reference, e.g. ``swarm_secret: {env: SWARMROUTE_SWARM_SECRET, roles: [...]}``."""

    models: dict[str, ModelSpec] = Field(min_length=1)
    trackers: list[TrackerSpec] = Field(min_length=1)
    gateways: list[GatewaySpec] = Field(min_length=1)
    nodes: list[NodeSpec] = Field(min_length=1)
    seeders: list[SeederSpec] = Field(default_factory=list)
    """Machines that seed models fetched from the swarm (models with ``sha256`` and no ``path``)."""

    @field_validator("models")
    @classmethod
    def _model_keys(cls, models: dict[str, ModelSpec]) -> dict[str, ModelSpec]:
        for key in models:
            if not re.match(_NAME, key):
                raise ValueError(f"model key {key!r} may only use letters, digits, '-' and '_'")
        return models

    @model_validator(mode="after")
    def _cross_checks(self) -> Fleet:
        problems = self._setting_problems() + self._duplicate_names() + self._model_refs() + self._layer_problems()
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _setting_problems(self) -> list[str]:
        known = set(Settings.model_fields)
        problems = []
        for key in self.settings:
            where = f"settings.{key}"
            if key in _SECRET_SETTINGS:
                problems.append(f"{where}: a credential; give it under nats.auth, gateways[].api_keys or secrets")
            elif key in _MEMBER_SETTINGS:
                problems.append(f"{where}: one key for every member; give each node and gateway its own "
                                f"({_MEMBER_SETTINGS[key]} of nodes[] and gateways[])")
            elif key in _FLEET_OWNED_SETTINGS:
                problems.append(f"{where}: set by the fleet file itself (nats, namespace) or the command line")
            elif key not in known:
                allowed = known - _SECRET_SETTINGS - _FLEET_OWNED_SETTINGS - set(_MEMBER_SETTINGS)
                problems.append(f"{where}: unknown setting (known: {', '.join(sorted(allowed))})")
        for key in self.secrets:
            if key not in _SECRET_SETTINGS - {"nats_user", "nats_creds", "nats_password", "nats_token", "api_keys"}:
                problems.append(f"secrets.{key}: not a secret setting this section can carry (NATS credentials go "
                                f"under nats.auth, API keys under gateways[].api_keys)")
        if problems:
            return problems
        try:
            Settings.model_validate(self.settings)
        except ValidationError as exc:
            problems += [f"settings.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        return problems

    def _duplicate_names(self) -> list[str]:
        seen: dict[str, str] = {}
        problems = []
        sections: tuple[tuple[str, list[Any]], ...] = (("trackers", self.trackers), ("gateways", self.gateways),
                                                       ("nodes", self.nodes), ("seeders", self.seeders))
        for section, members in sections:
            for i, m in enumerate(members):
                where = f"{section}[{i}].name"
                if m.name in seen:
                    problems.append(f"{where}: {m.name!r} is already used by {seen[m.name]}")
                seen.setdefault(m.name, where)
        return problems

    def _model_refs(self) -> list[str]:
        problems = []
        members: list[tuple[str, NodeSpec | SeederSpec]] = [*(("nodes", n) for n in self.nodes),
                                                            *(("seeders", s) for s in self.seeders)]
        counts: dict[str, int] = {}
        for section, member in members:
            i = counts[section] = counts.get(section, -1) + 1
            if member.model is None and len(self.models) > 1:
                problems.append(f"{section}[{i}].model: required when the fleet has several models "
                                f"({', '.join(self.models)})")
            elif member.model is not None and member.model not in self.models:
                problems.append(f"{section}[{i}].model: {member.model!r} is not in models ({', '.join(self.models)})")
            elif (isinstance(member, SeederSpec) and member.from_store
                  and self.models[self.model_key(member)].sha256 is None):
                problems.append(f"{section}[{i}].from_store: seeds the model by its sha256; give the model one")
        return problems

    def _layer_problems(self) -> list[str]:
        problems = []
        for key, spec in self.models.items():
            indexed = [(i, n) for i, n in enumerate(self.nodes) if self.model_key(n) == key]
            if not indexed:
                problems.append(f"models.{key}: no node serves it")
                continue
            if spec.from_swarm:
                problems += self._swarm_problems(key, spec, indexed)
                continue
            autos = [i for i, n in indexed if n.fixed_range is None]
            if autos and len(autos) != len(indexed):
                problems.append(f"nodes[{autos[0]}].layers: auto cannot be mixed with explicit ranges for model "
                                f"{key!r}: give every node of the model a range, or none")
                continue
            with_memory = [i for i, n in indexed if n.memory is not None]
            if autos and with_memory and len(with_memory) != len(indexed):
                missing = next(i for i, _ in indexed if i not in with_memory)
                problems.append(f"nodes[{missing}].memory: give every auto node of model {key!r} a memory size, "
                                f"or none (even split)")
            n_layers = spec.layer_count
            if autos and n_layers is not None and len(autos) > n_layers:
                problems.append(f"models.{key}: {len(autos)} auto nodes cannot split {n_layers} layers")
            if not autos:
                problems += _coverage_problems(key, [(i, n.fixed_range) for i, n in indexed], n_layers)
        return problems

    def _swarm_problems(self, key: str, spec: ModelSpec, indexed: list[tuple[int, NodeSpec]]) -> list[str]:
        """A model fetched from the swarm: auto nodes are assigned by the tracker (explicit ranges may mix in),
        and somebody must seed it."""
        problems = []
        if not any(self.model_key(s) == key for s in self.seeders):
            problems.append(f"models.{key}.sha256: its nodes fetch it from the swarm, but no seeder holds it: add "
                            f"seeders: [{{name: ..., model: {key}, path: /path/to/model.gguf}}]")
        n_layers = spec.layer_count
        for i, node in indexed:
            r = node.fixed_range
            if r is not None and n_layers is not None and r[1] > n_layers:
                problems.append(f"nodes[{i}].layers: range {r[0]}:{r[1]} goes past the {n_layers} layers of model "
                                f"{key!r}")
        return problems

    # ---- lookups -------------------------------------------------------------------------------------------------

    def model_key(self, node: NodeSpec | SeederSpec) -> str:
        return node.model if node.model is not None else next(iter(self.models))

    def model_id(self, key: str) -> str:
        return self.models[key].id or key

    def members(self) -> list[tuple[MemberRole, _Member]]:
        out: list[tuple[MemberRole, _Member]] = []
        out += [("tracker", t) for t in self.trackers]
        out += [("seeder", s) for s in self.seeders]
        out += [("node", n) for n in self.nodes]
        out += [("gateway", g) for g in self.gateways]
        return out

    def member(self, role: MemberRole, name: str) -> _Member:
        for r, m in self.members():
            if r == role and m.name == name:
                return m
        names = [m.name for r, m in self.members() if r == role]
        raise BadRequestError(f"the fleet has no {role} named {name!r} ({role}s: {', '.join(names) or 'none'})")

    def with_base(self, base: Path) -> Fleet:
        """Relative paths in the file are relative to the file's directory."""
        def fix(p: Path | None) -> Path | None:
            return p if p is None or p.is_absolute() else base / p

        def fix_secret(s: S) -> S:
            return s.model_copy(update={"file": fix(s.file)})

        auth = {role: a.model_copy(update={"creds": fix(a.creds), "password": a.password and fix_secret(a.password),
                                           "token": a.token and fix_secret(a.token)})
                for role, a in self.nats.auth.items()}
        nats = self.nats.model_copy(update={"embedded_config": fix(self.nats.embedded_config), "auth": auth})
        models = {k: m.model_copy(update={"path": fix(m.path)}) for k, m in self.models.items()}
        seeders = [sd.model_copy(update={"path": fix(sd.path)}) for sd in self.seeders]
        def fix_identity(i: IdentitySpec | None) -> IdentitySpec | None:
            return i and i.model_copy(update={"cert": fix(i.cert), "key": fix(i.key)})

        gateways = [g.model_copy(update={"api_keys": [fix_secret(k) for k in g.api_keys],
                                         "identity": fix_identity(g.identity)}) for g in self.gateways]
        nodes = [n.model_copy(update={"identity": fix_identity(n.identity)}) for n in self.nodes]
        secrets = {k: fix_secret(v) for k, v in self.secrets.items()}
        return self.model_copy(update={"nats": nats, "models": models, "gateways": gateways, "secrets": secrets,
                                       "seeders": seeders, "nodes": nodes})


def _coverage_problems(key: str, ranges: list[tuple[int, tuple[int, int] | None]], n_layers: int | None) -> list[str]:
    problems = []
    for i, r in ranges:
        assert r is not None
        if n_layers is not None and r[1] > n_layers:
            problems.append(f"nodes[{i}].layers: range {r[0]}:{r[1]} goes past the {n_layers} layers of model "
                            f"{key!r}")
    reach = 0
    for start, end in sorted(r for _, r in ranges if r is not None):
        if start > reach:
            problems.append(f"models.{key}: layers {reach}:{start} are served by no node")
        reach = max(reach, end)
    if n_layers is not None and reach < n_layers:
        problems.append(f"models.{key}: layers {reach}:{n_layers} are served by no node")
    return problems


def _where(loc: tuple[int | str, ...]) -> str:
    """('nodes', 2, 'layers') -> 'nodes[2].layers'; pydantic's internal tags (function-after[...]) are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part.startswith(("function-", "literal")):
            continue
        else:
            out += f".{part}" if out else part
    return out


def _messages(exc: ValidationError) -> list[str]:
    lines: list[str] = []
    for e in exc.errors(include_url=False):
        msg = str(e["msg"]).removeprefix("Value error, ")
        where = _where(tuple(e["loc"]))
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        lines.extend(f"{where}: {line}" if where else line for line in msg.splitlines())
    return lines


def parse_fleet(text: str, *, source: str = "fleet", toml: bool = False) -> Fleet:
    """Parse and validate a fleet document; BadRequestError lists every problem, each naming its field."""
    try:
        doc = tomllib.loads(text) if toml else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        kind = "TOML" if toml else "YAML"
        raise BadRequestError(f"{source}: not valid {kind}: {exc}", code="invalid_fleet") from None
    if not isinstance(doc, dict):
        raise BadRequestError(f"{source}: a fleet file is a mapping (models, nodes, trackers, gateways...)",
                              code="invalid_fleet")
    try:
        return Fleet.model_validate(doc)
    except ValidationError as exc:
        raise BadRequestError(f"{source}: " + "\n  ".join(["invalid fleet file:", *_messages(exc)]),
                              code="invalid_fleet") from None
