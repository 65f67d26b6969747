"""The container and NATS deployment files, checked statically (no container engine runs here): every command is a
real `swarmroute` command line (parsed by the real parser), every fleet member named exists in the fleet file the
container mounts and gets the secrets its role needs, images and ports agree across Dockerfile, compose, Kubernetes
and fleet files, and nats-server itself accepts the NATS configs."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from bus.server import find_binary
from schemas.fleet import Fleet, GatewaySpec, NodeSpec, parse_listen
from swarmroute.cli import build_parser
from swarmroute.fleet_file import load_fleet

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
ROOT = DEPLOY.parent
ROLES = ("tracker", "node", "gateway")
NATS_ENV = {f"SWARMROUTE_NATS_{r}_PASSWORD": "x" for r in ("TRACKER", "NODE", "GATEWAY", "MONITOR", "ADMIN")}


def parse_command(argv: list[str]) -> Any:
    """What `swarmroute ARGV` would run; a wrong subcommand or flag fails the test (argparse exits)."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"not a valid swarmroute command line: {argv} (exit {exc.code})")


def required_env(fleet: Fleet, role: str, name: str) -> set[str]:
    """Environment variables a member needs: its role's NATS secret references, its API keys, role secrets."""
    needed: set[str] = set()
    auth = fleet.nats.auth.get(role)  # type: ignore[call-overload]
    for ref in (auth.password, auth.token) if auth else ():
        if ref is not None and ref.env:
            needed.add(ref.env)
    member = fleet.member(role, name)  # type: ignore[arg-type]
    if isinstance(member, GatewaySpec):
        needed |= {k.env for k in member.api_keys if k.env}
    needed |= {s.env for s in fleet.secrets.values() if s.env and (s.roles is None or role in s.roles)}
    return needed


def _image() -> str:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return str(compose["services"]["nats"]["image"])


# ---- Dockerfile ---------------------------------------------------------------------------------------------------

def _dockerfile() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def test_dockerfile_builds_the_project_with_the_gguf_extra_and_runs_swarmroute() -> None:
    instructions = _dockerfile()
    for op, rest in instructions:
        if op == "COPY" and not rest.startswith("--from"):
            for src in rest.split()[:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: no such path in the repository"
    copied = {rest.split()[0] for op, rest in instructions if op == "COPY" and not rest.startswith("--from")}
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert {p.rstrip("*") for p in packages["include"]} <= copied  # every package the wheel needs is copied
    runs = " ".join(rest for op, rest in instructions if op == "RUN")
    assert '".[gguf]"' in runs and '"swarmroute[gguf]"' in runs
    assert ("ENTRYPOINT", '["swarmroute"]') in instructions
    user = [rest for op, rest in instructions if op == "USER"]
    assert user and user[-1] not in ("root", "0")
    exposed = {int(p) for op, rest in instructions if op == "EXPOSE" for p in rest.split()}
    assert exposed >= _compose_ports() | _k8s_container_ports()


# ---- docker compose -----------------------------------------------------------------------------------------------

def _compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())  # type: ignore[no-any-return]


def _mounts(service: dict[str, Any]) -> dict[str, Path]:
    """container path -> host path (relative to deploy/)."""
    out = {}
    for volume in service.get("volumes", []):
        host, container = volume.split(":")[:2]
        if host.startswith("."):
            out[container] = (DEPLOY / host).resolve()
    return out


def _compose_ports() -> set[int]:
    ports: set[int] = set()
    for service in _compose()["services"].values():
        ports |= {int(p) for p in service.get("expose", [])}
        ports |= {int(str(p).rsplit(":", 1)[-1]) for p in service.get("ports", [])}
    return ports


def test_compose_runs_nats_tracker_three_nodes_and_a_gateway_from_one_fleet_file() -> None:
    services = _compose()["services"]
    image = _image()
    roles: dict[str, list[str]] = {}
    fleets: set[Path] = set()
    for name, service in services.items():
        assert service["image"] == image, f"{name}: another image"
        args = parse_command(service["command"])
        roles.setdefault(args.command, []).append(name)
        mounts = _mounts(service)
        if args.command == "nats":
            config = mounts[str(args.config.parent)] / args.config.name
            assert config.is_file(), f"{name}: --config {args.config} is not mounted from deploy/"
            continue
        fleet_file = mounts[str(args.fleet)]
        fleets.add(fleet_file)
        fleet = load_fleet(fleet_file)
        member = fleet.member(args.command, args.name)
        env = set(service.get("environment", {}))
        missing = required_env(fleet, args.command, args.name) - env
        assert not missing, f"{name}: the fleet needs {sorted(missing)} in its environment"
        if isinstance(member, NodeSpec):
            _, port = parse_listen(member.listen)
            assert [str(port)] == service["expose"]
            assert member.advertise_url == f"http://{name}:{port}"  # the compose service name resolves
        if isinstance(member, GatewaySpec):
            _, port = parse_listen(member.listen)
            assert any(str(p).endswith(f":{port}") for p in service["ports"])
    assert {r: len(v) for r, v in roles.items()} == {"nats": 1, "tracker": 1, "node": 3, "gateway": 1}
    [fleet_file] = fleets
    fleet = load_fleet(fleet_file)
    nats_args = parse_command(services[roles["nats"][0]]["command"])
    assert fleet.nats.servers == [f"nats://{roles['nats'][0]}:{nats_args.port}"]
    assert fleet.nats.registry_replicas == 1  # one server holds one replica
    assert {fleet.member("node", n).name for n in roles["node"]} == {n.name for n in fleet.nodes}


# ---- Kubernetes ---------------------------------------------------------------------------------------------------

def _k8s() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _workloads() -> list[dict[str, Any]]:
    return [d for d in _k8s() if d["kind"] in ("Deployment", "StatefulSet")]


def _k8s_container_ports() -> set[int]:
    return {p["containerPort"] for w in _workloads() for c in w["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])}


def _pod_names(workload: dict[str, Any]) -> list[str]:
    name, replicas = workload["metadata"]["name"], workload["spec"].get("replicas", 1)
    return [f"{name}-{i}" for i in range(replicas)] if workload["kind"] == "StatefulSet" else [name]


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def test_k8s_manifests_are_consistent_with_the_fleet_file() -> None:
    docs = _k8s()
    for d in docs:
        assert {"apiVersion", "kind", "metadata", "spec"} <= set(d), d.get("metadata")
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("StatefulSet", "nats"), ("Service", "nats"), ("Deployment", "tracker"), ("StatefulSet", "node"),
            ("Service", "gateway"), ("Deployment", "gateway")} <= kinds
    image = _image()
    fleet = load_fleet(DEPLOY / "fleet.k8s.yaml")
    members: dict[str, set[str]] = {r: set() for r in ROLES}
    for w in _workloads():
        pod = w["spec"]["template"]
        assert w["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for c in pod["spec"]["containers"]:
            assert c["image"] == image, f"{w['metadata']['name']}: another image"
            env_names = {e["name"] for e in c.get("env", [])}
            for pod_name in _pod_names(w):
                args = parse_command(_expand(c["args"], {"POD_NAME": pod_name}))
                if args.command == "nats":
                    assert "NATS_SERVER_NAME" in env_names and set(NATS_ENV) <= env_names
                    continue
                mount = next(m for m in c["volumeMounts"] if str(args.fleet).startswith(m["mountPath"] + "/"))
                assert volumes[mount["name"]]["configMap"]["name"] == "swarmroute-fleet"
                member = fleet.member(args.command, args.name)
                members[args.command].add(member.name)
                missing = required_env(fleet, args.command, args.name) - env_names
                assert not missing, f"{pod_name}: the fleet needs {sorted(missing)} in its environment"
                ports = {p["containerPort"] for p in c.get("ports", [])}
                if isinstance(member, NodeSpec | GatewaySpec):
                    assert parse_listen(member.listen)[1] in ports
                if isinstance(member, NodeSpec):
                    url = urlsplit(member.advertise_url or "")
                    assert url.hostname == f"{pod_name}.{w['spec']['serviceName']}" and url.port in ports
    assert members["node"] == {n.name for n in fleet.nodes}  # every fleet node runs, and nothing else
    assert members["tracker"] == {t.name for t in fleet.trackers}
    assert members["gateway"] == {g.name for g in fleet.gateways}

    nats = next(w for w in _workloads() if w["metadata"]["name"] == "nats")
    nats_pods = [f"{p}.{nats['spec']['serviceName']}" for p in _pod_names(nats)]
    assert fleet.nats.servers == [f"nats://{p}:4222" for p in nats_pods]
    assert fleet.nats.registry_replicas == nats["spec"]["replicas"] == 3
    routes = re.findall(r"nats://(\S+):6222", (DEPLOY / "nats" / "nats.conf").read_text())
    assert routes == nats_pods  # the cluster config routes to exactly the StatefulSet's pods

    for svc in (d for d in docs if d["kind"] == "Service"):
        targets = [w for w in _workloads()
                   if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert targets, f"service {svc['metadata']['name']} selects no workload"
        ports = {p["containerPort"] for w in targets for c in w["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports


# ---- NATS configs -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["nats.conf", "single.conf"])
def test_nats_server_accepts_the_shipped_configs(name: str) -> None:
    env = {**os.environ, **NATS_ENV, "NATS_SERVER_NAME": "nats-0"}
    ok = subprocess.run([find_binary(), "-c", str(DEPLOY / "nats" / name), "-t"], env=env, capture_output=True,
                        text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    unset = {k: v for k, v in env.items() if k != "SWARMROUTE_NATS_NODE_PASSWORD"}
    bad = subprocess.run([find_binary(), "-c", str(DEPLOY / "nats" / name), "-t"], env=unset, capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode != 0 and "SWARMROUTE_NATS_NODE_PASSWORD" in bad.stderr + bad.stdout
