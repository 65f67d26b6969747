"""Fleets from a fleet file (schemas.fleet): run one member, run them all, check a file, report health.

    swarmroute fleet check  FILE                 validate; print each member's layer range and command
    swarmroute fleet up     FILE                 every member as a child process of this one (one machine)
    swarmroute fleet status [FILE] [--nats URL]  health of every member, from NATS ($SRV ping + registry)
    swarmroute node|tracker|gateway --fleet FILE --name X    one member (one per machine in a real fleet)

A member's command line and Settings come from the file; ``--nats``, ``--home`` and ``--log-level`` given on the
command line win over it. Secrets are resolved from their references (env/file) in the process that needs them,
so they never appear on a command line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Literal

from nats.aio.client import Client as NATS

from actors.registry import registry_snapshot
from actors.tracker.routes import uncovered_layers
from bus.connection import connected
from bus.identity import IdentityError, from_files
from bus.service import discover
from bus.subjects import Subjects
from schemas.errors import BadRequestError, SwarmrouteError
from schemas.fleet import Fleet, GatewaySpec, MemberRole, NodeSpec, Role
from schemas.node import NODE_FETCHING, NodeAdvertisement
from schemas.settings import Settings
from swarmroute import argtypes
from swarmroute.fleet_file import load_fleet, resolve_secret
from swarmroute.fleet_members import LocalFleet, member_argv, resolve_layers
from swarmroute.supervisor import Supervisor

# ---- one member -------------------------------------------------------------------------------------------------

def member_settings(fleet: Fleet, role: MemberRole, name: str, *, nats_url: str | None = None,
                    home: Path | None = None, log_level: str | None = None) -> Settings:
    """Settings of one member: NATS servers, role credentials, secrets and overrides from the file."""
    member = fleet.member(role, name)
    values: dict[str, Any] = dict(fleet.settings)
    values.update(nats_url=nats_url or ",".join(member.nats_servers or fleet.nats.servers),
                  namespace=fleet.namespace, registry_replicas=fleet.nats.registry_replicas,
                  nats_randomize=fleet.nats.randomize, member_name=name)
    # A seeder does on NATS what a node does for the artifact swarm (announce, answer manifests): node credentials.
    auth_role: Literal["tracker", "gateway", "node"] = "node" if role == "seeder" else role
    values.update(_credentials(fleet, auth_role))
    for setting, ref in fleet.secrets.items():
        if role != "seeder" and (ref.roles is None or role in ref.roles):
            values[setting] = resolve_secret(ref)
    if isinstance(member, GatewaySpec):
        values["api_keys"] = [resolve_secret(k) for k in member.api_keys]
    if isinstance(member, GatewaySpec | NodeSpec) and member.identity is not None:
        values.update(tls_cert_file=member.identity.cert, tls_key_file=member.identity.key)
        _check_identity(fleet, member)
    if home is not None:
        values["home"] = home
    if log_level is not None:
        values["log_level"] = log_level
    return Settings(**values)


def _check_identity(fleet: Fleet, member: GatewaySpec | NodeSpec) -> None:
    """The member's given key pair, read here (on its machine) so a wrong one stops it at start, naming the field,
    rather than at its first handshake."""
    assert member.identity is not None
    section, members = ("gateways", fleet.gateways) if isinstance(member, GatewaySpec) else ("nodes", fleet.nodes)
    where = f"{section}[{[m.name for m in members].index(member.name)}].identity"
    try:
        from_files(member.identity.cert, member.identity.key)
    except IdentityError as exc:
        raise BadRequestError(f"{where}: {exc}", code="invalid_fleet") from None


def monitor_settings(fleet: Fleet, *, nats_url: str | None = None) -> Settings:
    """Settings for operators' tools (status, fleet up's readiness check): the read-only ``monitor`` role's
    credentials (``admin``'s if the file gives no monitor)."""
    values: dict[str, Any] = dict(nats_url=nats_url or ",".join(fleet.nats.servers), namespace=fleet.namespace)
    role: Literal["monitor", "admin"] = "monitor" if "monitor" in fleet.nats.auth else "admin"
    return Settings(**values, **_credentials(fleet, role))


def _credentials(fleet: Fleet, role: Role) -> dict[str, Any]:
    """The ``Settings`` fields of a role's NATS credentials (none if the file gives the role none), its secrets
    resolved here, on the machine that runs it."""
    auth = fleet.nats.auth.get(role)
    if auth is None:
        return {}
    return dict(nats_user=auth.user, nats_creds=auth.creds,
                nats_password=resolve_secret(auth.password) if auth.password else None,
                nats_token=resolve_secret(auth.token) if auth.token else None,
                nats_inbox_prefix=auth.inbox_prefix or f"_INBOX_{role}")


def resolve_member(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """``swarmroute <role> --fleet FILE --name X``: the member's own arguments, parsed by ``parser`` (the CLI's),
    with its Settings attached."""
    if not args.name:
        raise SystemExit(f"swarmroute {args.command} --fleet needs --name (which member of the fleet this is)")
    role: MemberRole = args.command
    try:
        fleet = load_fleet(args.fleet)
        parsed = parser.parse_args(member_argv(fleet, role, args.name))
        parsed.fleet_settings = member_settings(fleet, role, args.name, nats_url=args.nats_url, home=args.home,
                                                log_level=args.log_level)
    except SwarmrouteError as exc:
        raise SystemExit(f"swarmroute {role}: {exc.message}") from None
    parsed.log_level = args.log_level
    return parsed


# ---- health from NATS -------------------------------------------------------------------------------------------

@dataclasses.dataclass
class MemberStatus:
    role: str
    name: str
    state: Literal["ok", "missing", "not-advertising", "stale", "extra", "fetching"]
    detail: str = ""


@dataclasses.dataclass
class FleetReport:
    members: list[MemberStatus]
    models: dict[str, bool]
    """Model id -> complete (every layer covered by fresh, verified advertisements in the registry)."""
    registry: dict[str, Any]
    """The registry bucket's replication: replicas, leader, replicas current."""

    @property
    def healthy(self) -> bool:
        return all(m.state in ("ok", "extra") for m in self.members) and bool(self.models) and all(self.models.values())

    def to_json(self) -> dict[str, Any]:
        return {"healthy": self.healthy, "members": [dataclasses.asdict(m) for m in self.members],
                "models": self.models, "registry": self.registry}


def _models(adverts: list[NodeAdvertisement], ttl_s: float) -> dict[str, bool]:
    """Model id -> every layer served by a fresh, verified advertisement (what a tracker could route)."""
    fresh = [a for a in adverts if a.verified and time.time() - a.sent_at <= ttl_s]
    return {model: not uncovered_layers([a for a in fresh if a.model_id == model],
                                        max(a.backend.n_layers for a in adverts if a.model_id == model))
            for model in sorted({a.model_id for a in adverts})}


def _node_status(name: str, pinged: dict[str, Any] | None, advert: NodeAdvertisement | None,
                 ttl_s: float) -> MemberStatus:
    if advert is None:
        state: Literal["ok", "missing", "not-advertising", "stale"] = "not-advertising" if pinged else "missing"
        return MemberStatus("node", name, state)
    age = max(0.0, time.time() - advert.sent_at)
    if advert.state == NODE_FETCHING and age <= ttl_s:  # coming up: in the registry, not serving yet
        f = advert.fetch
        progress = f"{f.phase} {100 * f.fraction:.0f}% {f.message}".rstrip() if f is not None else ""
        return MemberStatus("node", name, "fetching", f"{advert.model_id} {advert.layers.start}:{advert.layers.end}  "
                                                      f"{progress}")
    detail = (f"{advert.model_id} {advert.layers.start}:{advert.layers.end}  sessions "
              f"{advert.capacity.active_sessions}/{advert.capacity.max_sessions}  {advert.endpoint}  "
              f"heartbeat {age:.1f}s ago")
    return MemberStatus("node", name, "ok" if pinged and age <= ttl_s else "stale", detail)


async def fleet_report(nc: NATS, namespace: str, fleet: Fleet | None, *, ttl_s: float = 6.0,
                       wait_s: float = 0.5) -> FleetReport:
    subjects = Subjects(namespace)
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for ping in await discover(nc, wait_s=wait_s):
        meta = ping.get("metadata")
        if isinstance(meta, dict) and meta.get("namespace") == namespace:
            seen.setdefault((str(meta.get("role")), str(meta.get("member"))), meta)
    snapshot = await registry_snapshot(nc, subjects)
    adverts, replication = snapshot.adverts, snapshot.replication
    expected: list[tuple[str, str]] = [(r, m.name) for r, m in fleet.members()] if fleet else []
    if fleet is None:  # no file: whatever answers is the fleet
        expected = sorted(set(seen) | {("node", k) for k in adverts})
    members: list[MemberStatus] = []
    for role, name in expected:
        meta = seen.get((role, name))
        if role == "node":
            members.append(_node_status(name, meta, adverts.get(name), ttl_s))
        else:
            members.append(MemberStatus(role, name, "ok" if meta else "missing", str((meta or {}).get("url", ""))))
    for role, name in sorted(set(seen) - set(expected)):
        members.append(MemberStatus(role, name, "extra", "answers $SRV ping but is not in the fleet file"))
    return FleetReport(members, _models(list(adverts.values()), ttl_s), replication)


def render_report(report: FleetReport, title: str) -> str:
    lines = [title, f"{'ROLE':<8} {'NAME':<16} {'STATE':<16} DETAIL"]
    lines += [f"{m.role:<8} {m.name:<16} {m.state:<16} {m.detail}" for m in report.members]
    for model, complete in sorted(report.models.items()):
        lines.append(f"model {model}: {'complete' if complete else 'INCOMPLETE (some layers unserved)'}")
    if not report.models:
        lines.append("no node advertises a model")
    reg = report.registry
    if "replicas" in reg:
        lines.append(f"registry: {reg['replicas']} replica(s), leader {reg.get('leader') or '-'}, "
                     f"{reg.get('current')} current")
    elif "error" in reg:
        lines.append(f"registry: {reg['error']}")
    lines.append("healthy" if report.healthy else "NOT healthy")
    return "\n".join(lines)


async def _status_once(settings: Settings, fleet: Fleet | None, ttl_s: float) -> FleetReport:
    async with connected(settings, name="fleet-status") as nc:
        return await fleet_report(nc, settings.namespace, fleet, ttl_s=ttl_s)


# ---- commands ---------------------------------------------------------------------------------------------------

def _status_settings(args: argparse.Namespace, fleet: Fleet | None) -> tuple[Settings, float]:
    if fleet is not None:
        settings = monitor_settings(fleet, nats_url=args.nats_url)
        ttl = float(fleet.settings.get("registry_ttl_s", Settings.model_fields["registry_ttl_s"].default))
        return settings, ttl
    overrides: dict[str, Any] = {k: v for k in ("nats_url", "namespace") if (v := getattr(args, k, None))}
    settings = Settings(**overrides)
    return settings, settings.registry_ttl_s


def cmd_status(args: argparse.Namespace) -> int:
    fleet = load_fleet(args.file) if args.file else None
    settings, ttl = _status_settings(args, fleet)
    report = asyncio.run(_status_once(settings, fleet, ttl))
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        name = fleet.name if fleet else "(no fleet file)"
        print(render_report(report, f"fleet {name}, namespace {settings.namespace}, NATS {settings.nats_url}"))
    return 0 if report.healthy else 1


def cmd_check(args: argparse.Namespace) -> int:
    fleet = load_fleet(args.file)
    layers = resolve_layers(fleet)
    print(f"fleet {fleet.name}: {len(fleet.trackers)} tracker(s), {len(fleet.nodes)} node(s), "
          f"{len(fleet.gateways)} gateway(s); NATS {', '.join(fleet.nats.servers)}")
    for role, member in fleet.members():
        assigned = layers.get(member.name)
        shown = "" if role != "node" else (f" layers {assigned[0]}:{assigned[1]}" if assigned is not None
                                          else " layers assigned by the tracker when it joins")
        print(f"  {role:<8} {member.name:<16}{shown}")
        print(f"           swarmroute {role} --fleet {args.file} --name {member.name}")
        print(f"           (= swarmroute {' '.join(member_argv(fleet, role, member.name, layers))})")
    return 0


async def _wait_healthy(settings: Settings, fleet: Fleet, supervisor: Supervisor, timeout: float,
                        ttl_s: float) -> FleetReport:
    """Poll the fleet's health on one NATS connection until every member is up and every model routable."""
    deadline = time.monotonic() + timeout
    report: FleetReport | None = None
    async with connected(settings, name="fleet-up") as nc:
        while time.monotonic() < deadline:
            if not supervisor.check():
                raise RuntimeError(supervisor.failed or "a fleet member exited during start-up")
            report = await fleet_report(nc, settings.namespace, fleet, ttl_s=ttl_s)
            if report.healthy:
                return report
            await asyncio.sleep(0.5)
    detail = render_report(report, "last status:") if report else ""
    raise RuntimeError(f"the fleet did not become healthy within {timeout:g}s\n{detail}")


def _start_embedded(fleet: Fleet, home: Path) -> Any:
    from bus.server import EmbeddedNats, NatsServerConfig

    config = NatsServerConfig(store_dir=home / "fleet-nats" / fleet.name, config_file=fleet.nats.embedded_config)
    return EmbeddedNats(config).start()


def cmd_up(args: argparse.Namespace) -> int:
    fleet = load_fleet(args.file)
    local = LocalFleet(fleet, home=args.home or Settings().home, log_level=args.log_level or "warning",
                       file=args.file)
    nats = _start_embedded(fleet, local.home) if fleet.nats.embedded else None
    nats_url = nats.url if nats is not None else args.nats_url
    ttl = float(fleet.settings.get("registry_ttl_s", Settings.model_fields["registry_ttl_s"].default))

    def ready(supervisor: Supervisor) -> str:
        report = asyncio.run(_wait_healthy(monitor_settings(fleet, nats_url=nats_url), fleet, supervisor,
                                           args.timeout, ttl))
        members = len(fleet.members())
        return render_report(report, f"fleet {fleet.name} is up ({members} members); Ctrl-C stops it")

    return local.run("fleet up", ready, nats_url=nats_url, nats=nats)


def _reporting_errors(command: Any) -> Any:
    """A bad fleet file or missing secret is a message for the operator, not a traceback."""
    def run(args: argparse.Namespace) -> int:
        try:
            result: int = command(args)
        except SwarmrouteError as exc:
            print(f"swarmroute fleet {args.fleet_command}: {exc.message}", file=sys.stderr)
            return 2
        return result

    return run


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    fleet = subparsers.add_parser("fleet", help="run, check or inspect a fleet described by a fleet file")
    verbs = fleet.add_subparsers(dest="fleet_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--nats", dest="nats_url", help="NATS URL(s), overriding the file's nats.servers")
        p.add_argument("--home", type=Path, help="state directory (env SWARMROUTE_HOME)")
        p.add_argument("--log-level", dest="log_level", help="debug, info, warning")

    up = verbs.add_parser("up", help="run every member of the fleet on this machine, as child processes")
    up.add_argument("file", type=Path)
    up.add_argument("--timeout", type=argtypes.at_least(0.001, float), default=600.0,
                    help="seconds to wait for the fleet to be healthy")
    common(up)
    up.set_defaults(func=_reporting_errors(cmd_up))

    status = verbs.add_parser("status", help="each member's health from NATS ($SRV ping + registry)")
    status.add_argument("file", type=Path, nargs="?", help="fleet file (else: whatever answers on --nats)")
    status.add_argument("--namespace", help="subject namespace when no file is given")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    common(status)
    status.set_defaults(func=_reporting_errors(cmd_status))

    check = verbs.add_parser("check", help="validate a fleet file and print each member's layers and command")
    check.add_argument("file", type=Path)
    common(check)
    check.set_defaults(func=_reporting_errors(cmd_check))
    return fleet
