"""Fleet files: validation that names the wrong field, layer resolution, member settings without secrets on the
command line, ``fleet up`` serving end to end, members started one by one (``--fleet F --name X``) and
``fleet status`` telling who is missing."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import openai
import pytest

from bus.identity import Identity, identity_from_settings, load_or_create
from bus.server import EmbeddedNats
from schemas.errors import BadRequestError
from schemas.fleet import Fleet, parse_fleet
from schemas.session import Prompt
from schemas.settings import Settings
from swarmroute.fleet import member_argv, member_settings, resolve_layers
from swarmroute.fleet_file import load_fleet
from swarmroute.fleet_members import LocalFleet
from tests.support.actors import Children
from tests.support.fleet import Proc, stub_reference, write_fleet
from tests.support.nats_cluster import free_port

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"

BASE: dict[str, Any] = {
    "version": 1,
    "nats": {"servers": ["nats://127.0.0.1:4222"],
             "auth": {"node": {"user": "node", "password": {"env": "FLEET_TEST_NODE_PASSWORD"}}}},
    "models": {"stub-model": {"backend": "stub", "n_layers": 8}},
    "trackers": [{"name": "tracker-1"}],
    "gateways": [{"name": "gateway", "listen": "127.0.0.1:8000"}],
    "nodes": [{"name": "n1", "layers": "0:4"}, {"name": "n2", "layers": "4:8"}, {"name": "n3", "layers": "4:8"}],
}


def _mutate(path: str, value: object) -> dict[str, Any]:
    """BASE with ``a.b[2].c`` set to value (``...=None`` deletes the key)."""
    doc = copy.deepcopy(BASE)
    parts = path.replace("[", ".[").split(".")
    target: Any = doc
    for part in parts[:-1]:
        target = target[int(part[1:-1])] if part.startswith("[") else target.setdefault(part, {})
    last = parts[-1]
    key: Any = int(last[1:-1]) if last.startswith("[") else last
    if value is None:
        del target[key]
    else:
        target[key] = value
    return doc


MISTAKES = [
    ("nodes[2].layers", "4:12", "nodes[2].layers: range 4:12 goes past the 8 layers"),
    ("nodes[0].layers", "0:3", "models.stub-model: layers 3:4 are served by no node"),
    ("nodes[1].layers", "8:4", "nodes[1].layers: layer range '8:4' is empty"),
    ("nodes[0].layers", "first half", "nodes[0].layers: 'first half' is not START:END"),
    ("nodes[1].layers", "auto", "nodes[1].layers: auto cannot be mixed with explicit ranges"),
    ("nodes[2].name", "n1", "nodes[2].name: 'n1' is already used by nodes[0].name"),
    ("nodes[0].model", "gemma", "nodes[0].model: 'gemma' is not in models"),
    ("nodes[1].listen", "9000", "nodes[1].listen: '9000' is not host:port"),
    ("nodes[1].threads", 0, "nodes[1].threads: Input should be greater than or equal to 1"),
    ("nodes[1].colour", "red", "nodes[1].colour: unknown field"),
    ("gateways[0].listen", "localhost", "gateways[0].listen: 'localhost' is not host:port"),
    ("gateways[0].api_keys", ["sk-inline"], "gateways[0].api_keys[0]: inline secrets are not allowed"),
    ("nats.auth.node.password", "hunter2", "nats.auth.node.password: inline secrets are not allowed"),
    ("nats.auth.node.password", {"env": "A", "file": "/b"}, "nats.auth.node.password: give exactly one of env or file"),
    ("nats.auth.robot", {"user": "x"}, "nats.auth.robot"),
    ("nats.servers", ["http://127.0.0.1:4222"], "nats.servers: 'http://127.0.0.1:4222' is not a NATS URL"),
    ("nats.registry_replicas", 7, "nats.registry_replicas: Input should be less than or equal to 5"),
    ("settings", {"heartbeat": 1}, "settings.heartbeat: unknown setting"),
    ("settings", {"heartbeat_s": -1}, "settings.heartbeat_s: Input should be greater than 0"),
    ("settings", {"swarm_secret": "x"}, "settings.swarm_secret: a credential"),
    ("settings", {"nats_url": "nats://x:1"}, "settings.nats_url: set by the fleet file itself"),
    ("settings", {"tls_key_file": "/k"}, "settings.tls_key_file: one key for every member; give each node and gateway "
                                         "its own (identity.key"),
    ("nodes[0].identity", {"cert": "/c.crt"}, "nodes[0].identity.key: required field is missing"),
    ("gateways[0].identity", {"cert": "/c", "key": "/k", "ca": "/x"}, "gateways[0].identity.ca: unknown field"),
    ("nodes[0].advertise_url", "ftp://10.0.0.1:9000", "nodes[0].advertise_url: String should match pattern"),
    ("secrets", {"heartbeat_s": {"env": "X"}}, "secrets.heartbeat_s: not a secret setting"),
    ("models.stub-model.n_layers", 0, "models.stub-model.n_layers: Input should be greater than or equal to 1"),
    ("trackers", [], "trackers: List should have at least 1 item"),
    ("gateways", None, "gateways: required field is missing"),
]


@pytest.mark.parametrize(("where", "value", "expected"), MISTAKES, ids=[m[0] + "=" + str(m[1]) for m in MISTAKES])
def test_fleet_file_mistakes_name_the_field(where: str, value: object, expected: str) -> None:
    import yaml

    text = yaml.safe_dump(_mutate(where, value))
    parse_fleet(yaml.safe_dump(BASE))  # the unmutated file is valid: the mutation alone causes the error
    with pytest.raises(BadRequestError) as err:
        parse_fleet(text, source="fleet.yaml")
    assert expected in err.value.message
    assert err.value.message.startswith("fleet.yaml: ")


def test_toml_fleet_file_and_syntax_errors(tmp_path: Path) -> None:
    toml = tmp_path / "fleet.toml"
    toml.write_text('[models.m]\nbackend = "stub"\n[[trackers]]\nname = "t"\n[[gateways]]\nname = "g"\n'
                    '[[nodes]]\nname = "a"\n[[nodes]]\nname = "b"\n')
    fleet = load_fleet(toml)
    assert resolve_layers(fleet) == {"a": (0, 4), "b": (4, 8)}  # stub models default to 8 layers
    broken = tmp_path / "broken.yaml"
    broken.write_text("nodes: [\n")
    with pytest.raises(BadRequestError, match="broken.yaml: not valid YAML"):
        load_fleet(broken)


def test_auto_layers_split_every_model_evenly_in_file_order() -> None:
    doc = copy.deepcopy(BASE)
    doc["models"] = {"a": {"backend": "stub", "n_layers": 11}, "b": {"backend": "stub", "n_layers": 3}}
    doc["nodes"] = [{"name": f"a{i}", "model": "a"} for i in range(4)] + [{"name": "b0", "model": "b"}]
    fleet = Fleet.model_validate(doc)
    ranges = {k: v for k, v in resolve_layers(fleet).items() if v is not None}
    a = [ranges[f"a{i}"] for i in range(4)]
    assert a[0][0] == 0 and a[-1][1] == 11
    assert all(prev[1] == nxt[0] for prev, nxt in zip(a, a[1:], strict=False))  # contiguous, in file order
    sizes = [end - start for start, end in a]
    assert max(sizes) - min(sizes) <= 1
    assert ranges["b0"] == (0, 3)


@pytest.mark.slow
def test_auto_layers_by_memory_use_the_planner(gemma_path: Path) -> None:
    doc = copy.deepcopy(BASE)
    doc["models"] = {"gemma": {"backend": "llamacpp", "path": str(gemma_path)}}
    doc["nodes"] = [{"name": "small", "memory": "250MB"}, {"name": "big", "memory": "330MB"}]
    ranges = {k: v for k, v in resolve_layers(Fleet.model_validate(doc)).items() if v is not None}
    (s0, s1), (b0, b1) = ranges["small"], ranges["big"]
    assert s0 == 0 and s1 == b0 and b1 == 18  # 18 layers read from the GGUF header, covered once
    assert b1 - b0 > s1 - s0  # more memory, more layers (both hold the tied embeddings: head lookup, tail lm_head)
    doc["nodes"][1]["memory"] = None
    with pytest.raises(BadRequestError, match=r"nodes\[1\].memory: give every auto node"):
        parse_fleet(json.dumps(doc))


def test_member_settings_resolve_secrets_and_keep_them_off_the_command_line(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "gateway.key"
    key_file.write_text("sk-from-file\n")
    doc = copy.deepcopy(BASE)
    doc["gateways"][0]["api_keys"] = [{"file": "gateway.key"}]  # relative to the fleet file
    doc["secrets"] = {"swarm_secret": {"env": "FLEET_TEST_SWARM_SECRET", "roles": ["tracker", "node"]}}
    doc["settings"] = {"heartbeat_s": 0.25}
    fleet = load_fleet(write_fleet(tmp_path / "fleet.yaml", doc))
    monkeypatch.setenv("FLEET_TEST_NODE_PASSWORD", "pw-node-123")
    monkeypatch.setenv("FLEET_TEST_SWARM_SECRET", "swarm-456")

    node = member_settings(fleet, "node", "n2")
    assert node.nats_user == "node" and node.nats_password is not None
    assert node.nats_password.get_secret_value() == "pw-node-123"
    assert node.swarm_secret is not None and node.swarm_secret.get_secret_value() == "swarm-456"
    assert node.nats_inbox_prefix == "_INBOX_node" and node.member_name == "n2" and node.heartbeat_s == 0.25
    gateway = member_settings(fleet, "gateway", "gateway")
    assert [k.get_secret_value() for k in gateway.api_keys] == ["sk-from-file"]
    assert gateway.swarm_secret is None  # not one of the secret's roles
    assert gateway.nats_password is None  # the gateway role has no credentials in this file

    argv = " ".join(member_argv(fleet, "node", "n2") + member_argv(fleet, "gateway", "gateway"))
    for secret in ("pw-node-123", "swarm-456", "sk-from-file"):
        assert secret not in argv
    assert "--layers 4:8" in argv and "--node-id n2" in argv

    monkeypatch.delenv("FLEET_TEST_NODE_PASSWORD")
    with pytest.raises(BadRequestError, match="FLEET_TEST_NODE_PASSWORD"):
        member_settings(fleet, "node", "n1")
    with pytest.raises(BadRequestError, match="no node named 'n9'"):
        member_settings(fleet, "node", "n9")


def _with_identities(tmp_path: Path, doc: dict[str, Any]) -> tuple[Path, Identity, Identity]:
    """``doc`` written with a key pair given to its first node and its gateway (paths relative to the file), the
    nodes' TLS on and the gateway's certificate trusted by them."""
    node, gateway = load_or_create(tmp_path / "keys", "node-key"), load_or_create(tmp_path / "keys", "gateway-key")
    doc = copy.deepcopy(doc)
    doc["nodes"][0]["identity"] = {"cert": "keys/node-key.crt", "key": "keys/node-key.key"}
    doc["gateways"][0]["identity"] = {"cert": "keys/gateway-key.crt", "key": "keys/gateway-key.key"}
    doc.setdefault("settings", {}).update(tls="on", tls_trusted_certs=str(gateway.cert_file))
    return write_fleet(tmp_path / "fleet.yaml", doc), node, gateway


def test_a_member_named_key_pair_is_its_identity_and_a_bad_one_names_the_field(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_TEST_NODE_PASSWORD", "pw")
    fleet_file, node_key, gateway_key = _with_identities(tmp_path, BASE)
    fleet = load_fleet(fleet_file)
    home = tmp_path / "home"
    given = member_settings(fleet, "node", "n1", home=home)
    assert identity_from_settings(given, "n1").fingerprint == node_key.fingerprint
    assert identity_from_settings(member_settings(fleet, "gateway", "gateway", home=home),
                                  "gateway").fingerprint == gateway_key.fingerprint
    own = identity_from_settings(member_settings(fleet, "node", "n2", home=home), "n2")  # none given: its own
    assert own.key_file == home / "identity" / "n2.key" and own.fingerprint not in (node_key.fingerprint,
                                                                                      gateway_key.fingerprint)
    node_key.key_file.chmod(0o644)
    with pytest.raises(BadRequestError, match=r"^nodes\[0\]\.identity: .*node-key\.key is readable by others"):
        member_settings(fleet, "node", "n1")
    node_key.key_file.chmod(0o600)
    gateway_key.cert_file.unlink()
    with pytest.raises(BadRequestError, match=r"^gateways\[0\]\.identity: cannot read the certificate "
                                              r".*gateway-key\.crt: No such file"):
        member_settings(fleet, "gateway", "gateway")
    doc = copy.deepcopy(BASE)
    doc["nodes"][1]["identity"] = {"cert": str(node_key.cert_file), "key": str(own.key_file)}
    with pytest.raises(BadRequestError, match=r"^nodes\[1\]\.identity: .*node-key\.crt is not the certificate of "
                                              r"the key in .*n2\.key"):
        member_settings(load_fleet(write_fleet(tmp_path / "mixed.yaml", doc)), "node", "n2")


def test_fleet_members_serve_tls_with_the_keys_the_file_names(nats_server: EmbeddedNats, tmp_path: Path,
                                                              children: Children) -> None:
    """Real members started from the file: node-1 serves (and pins into its endpoint) the key the file gives it,
    node-2 the key it created under its home, and the gateway reaches both with the key the file gives it (the
    nodes admit only that one, by ``tls_trusted_certs``)."""
    port = free_port()
    fleet_file, node_key, _ = _with_identities(tmp_path, _stub_fleet(nats_server.url, port))
    home = ["--home", str(tmp_path / "home")]
    members = [children.add(Proc([role, "--fleet", str(fleet_file), "--name", name, *home]))
               for role, name in [("tracker", "tracker-1"), ("node", "node-1"), ("node", "node-2"),
                                  ("gateway", "gateway")]]
    first = members[1].wait_for(r"node node-1 ready at https://([0-9a-f]{64})@127\.0\.0\.1:", timeout=60)
    second = members[2].wait_for(r"node node-2 ready at https://([0-9a-f]{64})@127\.0\.0\.1:", timeout=60)
    members[3].wait_for(rf"gateway ready at http://127.0.0.1:{port}", timeout=60)
    assert first.group(1) == node_key.fingerprint
    assert second.group(1) == load_or_create(tmp_path / "home" / "identity", "node-2").fingerprint
    code, report = _status(fleet_file, tmp_path / "home")
    assert code == 0 and report["healthy"], report
    text, route = _chat(port, "named keys", 12)
    assert text == stub_reference(Prompt(messages=[{"role": "user", "content": "named keys"}]), 12)
    assert route == ["node-1", "node-2"]


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("fleet*.yaml")), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_shipped_fleet_files_are_valid(path: Path) -> None:
    fleet = load_fleet(path)
    ranges = resolve_layers(fleet)
    assert set(ranges) == {n.name for n in fleet.nodes}


# ---- real processes -----------------------------------------------------------------------------------------------

def _stub_fleet(nats_url: str, gateway_port: int, n_nodes: int = 2) -> dict[str, Any]:
    return {
        "version": 1, "name": "test",
        "nats": {"servers": [nats_url]},
        "settings": {"heartbeat_s": 0.5, "registry_ttl_s": 3.0, "token_timeout_s": 10.0},
        "models": {"stub-model": {"backend": "stub", "n_layers": 8}},
        "trackers": [{"name": "tracker-1"}],
        "nodes": [{"name": f"node-{i + 1}", "layers": "auto"} for i in range(n_nodes)],
        "gateways": [{"name": "gateway", "listen": f"127.0.0.1:{gateway_port}"}],
    }


def _status(fleet_file: Path | None, home: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    target = [str(fleet_file)] if fleet_file is not None else []
    proc = Proc(["fleet", "status", *target, "--json", "--home", str(home), "--log-level", "warning", *extra])
    code = proc.run(60)
    start = next(i for i, line in enumerate(proc.lines) if line.startswith("{"))
    return code, json.loads("\n".join(proc.lines[start:]))


def _chat(port: int, content: str, n: int) -> tuple[str, list[str]]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="stub-model", messages=[{"role": "user", "content": content}],
                                           max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    route = [h["node_id"] for h in (reply.model_extra or {})["swarmroute"]["route"]]
    return reply.choices[0].message.content or "", route


def test_fleet_up_serves_a_request_end_to_end(nats_server: EmbeddedNats, tmp_path: Path, children: Children) -> None:
    port = free_port()
    fleet_file = write_fleet(tmp_path / "fleet.yaml", _stub_fleet(nats_server.url, port))
    up = children.add(Proc(["fleet", "up", str(fleet_file), "--home", str(tmp_path / "home"), "--timeout", "90"]))
    up.wait_for(r"fleet test is up \(4 members\)", timeout=120)
    text, route = _chat(port, "Hello fleet", 24)
    expected = stub_reference(Prompt(messages=[{"role": "user", "content": "Hello fleet"}]), 24)
    assert text == expected
    assert route == ["node-1", "node-2"]  # the auto split: node-1 holds [0, 4), node-2 [4, 8)

    code, report = _status(fleet_file, tmp_path / "home")
    assert code == 0 and report["healthy"]
    states = {(m["role"], m["name"]): m["state"] for m in report["members"]}
    assert states == {("tracker", "tracker-1"): "ok", ("node", "node-1"): "ok", ("node", "node-2"): "ok",
                      ("gateway", "gateway"): "ok"}
    details = {m["name"]: m["detail"] for m in report["members"]}
    assert "stub-model 0:4" in details["node-1"] and "stub-model 4:8" in details["node-2"]
    assert details["gateway"] == f"http://127.0.0.1:{port}"
    assert report["models"] == {"stub-model": True}

    # without the file, whatever answers on NATS is the fleet
    code, report = _status(None, tmp_path / "home", "--nats", nats_server.url)
    assert code == 0 and {(m["name"], m["state"]) for m in report["members"]} == {
        ("tracker-1", "ok"), ("node-1", "ok"), ("node-2", "ok"), ("gateway", "ok")}
    assert up.stop() == 0


def test_members_started_one_by_one_and_status_names_the_missing_one(nats_server: EmbeddedNats,
                                                                     tmp_path: Path, children: Children) -> None:
    port = free_port()
    fleet_file = write_fleet(tmp_path / "fleet.yaml", _stub_fleet(nats_server.url, port))
    home = ["--home", str(tmp_path / "home")]
    members = [children.add(Proc(["tracker", "--fleet", str(fleet_file), "--name", "tracker-1", *home])),
               children.add(Proc(["node", "--fleet", str(fleet_file), "--name", "node-1", *home])),
               children.add(Proc(["gateway", "--fleet", str(fleet_file), "--name", "gateway", *home]))]
    members[1].wait_for(r"node node-1 ready at \S+ serving stub-model layers \[0, 4\)", timeout=60)
    members[2].wait_for(rf"gateway ready at http://127.0.0.1:{port}", timeout=60)
    code, report = _status(fleet_file, tmp_path / "home")
    states = {m["name"]: m["state"] for m in report["members"]}
    assert code == 1 and not report["healthy"]
    assert states == {"tracker-1": "ok", "node-1": "ok", "node-2": "missing", "gateway": "ok"}
    assert report["models"] == {"stub-model": False}  # layers 4:8 have no node yet

    members.append(children.add(Proc(["node", "--fleet", str(fleet_file), "--name", "node-2", *home])))
    members[3].wait_for(r"node node-2 ready at \S+ serving stub-model layers \[4, 8\)", timeout=60)
    code, report = _status(fleet_file, tmp_path / "home")
    assert code == 0 and report["healthy"], report
    text, route = _chat(port, "one by one", 16)
    assert text == stub_reference(Prompt(messages=[{"role": "user", "content": "one by one"}]), 16)
    assert route == ["node-1", "node-2"]


def test_a_member_with_a_bad_file_or_name_exits_with_a_message(tmp_path: Path) -> None:
    fleet_file = write_fleet(tmp_path / "fleet.yaml", _mutate("nodes[0].layers", "0:3"))
    proc = Proc(["node", "--fleet", str(fleet_file), "--name", "n1"])
    assert proc.run(60) != 0
    assert any("models.stub-model: layers 3:4 are served by no node" in line for line in proc.lines)
    good = write_fleet(tmp_path / "good.yaml", BASE)
    proc = Proc(["tracker", "--fleet", str(good), "--name", "nobody"])
    assert proc.run(60) != 0
    assert any("the fleet has no tracker named 'nobody'" in line for line in proc.lines)


@pytest.mark.slow
def test_fleet_up_with_a_llamacpp_node_matches_llama_cpp(nats_server: EmbeddedNats, tmp_path: Path,
                                                         gemma_path: Path, children: Children) -> None:
    """The real model through a fleet file (one whole-model llama.cpp node; its layer count read from the GGUF)
    writes what llama-cpp-python writes by itself for the same prompt tokens, greedy."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gemma_path), n_ctx=512, n_threads=2, verbose=False)
    tokens = llm.tokenize(b"The capital of France is", add_bos=True)
    expected = str(llm.create_completion(prompt=tokens, max_tokens=16, temperature=0.0)["choices"][0]["text"])
    del llm
    port = free_port()
    doc = _stub_fleet(nats_server.url, port, n_nodes=1)
    doc["models"] = {"gemma": {"backend": "llamacpp", "path": str(gemma_path), "context": 512}}
    doc["nodes"][0]["threads"] = 2
    fleet_file = write_fleet(tmp_path / "fleet.yaml", doc)
    assert resolve_layers(load_fleet(fleet_file)) == {"node-1": (0, 18)}
    up = children.add(Proc(["fleet", "up", str(fleet_file), "--home", str(tmp_path / "home"), "--timeout", "240"]))
    up.wait_for(r"fleet test is up", timeout=300)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    reply = client.completions.create(model="gemma", prompt=tokens, max_tokens=16, temperature=0)
    assert reply.choices[0].text == expected


# ---- models fetched from the swarm (issue #17) --------------------------------------------------------------------

SHA = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def _swarm_doc() -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    doc["models"] = {"gemma": {"backend": "llamacpp", "sha256": SHA, "manifest_id": "b" * 64}}
    doc["seeders"] = [{"name": "seed-1", "path": "/srv/gemma.gguf", "listen": "10.0.0.10:6881"}]
    doc["nodes"] = [{"name": "n1", "memory": "330MB", "listen": "10.0.0.11:9000"},
                    {"name": "n2", "memory": "330MB"}, {"name": "n3", "layers": "6:12"}]
    return doc


def test_a_model_named_by_its_id_starts_empty_nodes_that_the_tracker_assigns() -> None:
    fleet = Fleet.model_validate(_swarm_doc())
    assert resolve_layers(fleet) == {"n1": None, "n2": None, "n3": (6, 12)}  # auto and explicit may mix
    argv = member_argv(fleet, "node", "n1")
    assert argv[argv.index("--model-id") + 1] == SHA and argv[argv.index("--alias") + 1] == "gemma"
    assert argv[argv.index("--memory") + 1] == "330MB" and argv[argv.index("--manifest-id") + 1] == "b" * 64
    assert "--model" not in argv and "--layers" not in argv
    explicit = member_argv(fleet, "node", "n3")
    assert explicit[explicit.index("--layers") + 1] == "6:12"
    assert member_argv(fleet, "seeder", "seed-1") == ["seeder", "/srv/gemma.gguf", "--node-id", "seed-1",
                                                      "--listen-host", "10.0.0.10", "--listen-port", "6881"]


def test_a_seeder_connects_with_the_node_role(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_TEST_NODE_PASSWORD", "pw")
    settings = member_settings(Fleet.model_validate(_swarm_doc()), "seeder", "seed-1")
    assert settings.nats_user == "node" and settings.nats_inbox_prefix == "_INBOX_node"
    assert settings.member_name == "seed-1"


SWARM_MISTAKES = [
    ("seeders", [], "models.gemma.sha256: its nodes fetch it from the swarm, but no seeder holds it"),
    ("models.gemma.backend", "stub", "models.gemma: sha256: only llamacpp models are fetched from the swarm"),
    ("models.gemma.sha256", "abc", "models.gemma.sha256: String should match pattern"),
    ("seeders[0].model", "llama", "seeders[0].model: 'llama' is not in models"),
    ("seeders[0].listen", "6881", "seeders[0].listen: '6881' is not host:port"),
    ("seeders[0].name", "n1", "seeders[0].name: 'n1' is already used by nodes[0].name"),
]


@pytest.mark.parametrize(("where", "value", "expected"), SWARM_MISTAKES, ids=[m[0] for m in SWARM_MISTAKES])
def test_swarm_fleet_mistakes_name_the_field(where: str, value: object, expected: str) -> None:
    doc = _swarm_doc()
    Fleet.model_validate(doc)
    parts = where.replace("[", ".[").split(".")
    target: Any = doc
    for part in parts[:-1]:
        target = target[int(part[1:-1])] if part.startswith("[") else target[part]
    target[parts[-1]] = value
    with pytest.raises(BadRequestError) as err:
        parse_fleet(json.dumps(doc), source="fleet.yaml")
    assert expected in err.value.message
    pinned_alone = _swarm_doc()
    del pinned_alone["models"]["gemma"]["sha256"]
    with pytest.raises(BadRequestError, match="manifest_id: pins the manifest"):
        parse_fleet(json.dumps(pinned_alone))


def test_fleet_check_says_who_is_assigned_by_the_tracker(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from swarmroute.fleet import cmd_check

    path = tmp_path / "fleet.yaml"
    path.write_text(json.dumps(_swarm_doc()))
    assert cmd_check(argparse.Namespace(file=path)) == 0
    out = capsys.readouterr().out
    assert "n1               layers assigned by the tracker when it joins" in out and "layers 6:12" in out
    assert "swarmroute seeder --fleet" in out


# ---- the one launcher of fleet up and up (swarmroute/fleet_members.py) --------------------------------------------

def test_fleet_up_children_read_their_member_from_the_file(tmp_path: Path) -> None:
    path = write_fleet(tmp_path / "fleet.yaml", BASE)
    local = LocalFleet(load_fleet(path), home=tmp_path / "home", log_level="info", file=path)
    specs = {s.name: s for s in local.child_specs("nats://127.0.0.1:4333")}
    assert list(specs) == ["tracker-1", "n1", "n2", "n3", "gateway"]
    assert [s.essential for s in specs.values()] == [True, False, False, False, True]
    assert specs["n2"].argv[1:] == ["-m", "swarmroute", "node", "--fleet", str(path), "--name", "n2", "--log-level",
                                    "info", "--home", str(tmp_path / "home"), "--nats", "nats://127.0.0.1:4333"]
    assert all(not s.env for s in specs.values())


def test_up_runs_an_in_memory_fleet_whose_children_get_their_command_lines(tmp_path: Path) -> None:
    """``up``'s options become a fleet (launcher.up_fleet); each child's command line is its member's, which the
    CLI parses back into what ``up`` was asked for."""
    from swarmroute.cli import build_parser
    from swarmroute.launcher import listen, local_threads, up_fleet, up_model

    parser = build_parser()
    args = parser.parse_args(["up", "--backend", "stub", "--nodes", "3", "--stub-delay", "0.01", "--ctx", "512",
                              "--hidden-shape", "4x64", "--max-sessions", "2", "--wire-dtype", "bf16"])
    settings = Settings(home=tmp_path / "home", namespace="up-test", bind_host="127.0.0.2")
    fleet = up_fleet(args, settings, up_model(args, "stub-model", 8), nodes=3, gateway=listen("127.0.0.1", 8123))
    local = LocalFleet(fleet, home=settings.home, log_level="warning", node_env={"OMP_WAIT_POLICY": "passive"})
    specs = {s.name: s for s in local.child_specs("nats://127.0.0.1:4333")}
    assert list(specs) == ["tracker", "node-1", "node-2", "node-3", "gateway"]
    parsed = {name: parser.parse_args(spec.argv[3:]) for name, spec in specs.items()}
    for p in parsed.values():
        assert (p.namespace, p.home, p.nats_url, p.log_level) == ("up-test", settings.home, "nats://127.0.0.1:4333",
                                                                  "warning")
    nodes = [parsed[f"node-{i}"] for i in (1, 2, 3)]
    assert [n.layers for n in nodes] == [(0, 3), (3, 6), (6, 8)]
    for i, n in enumerate(nodes, start=1):
        assert (n.node_id, n.backend, n.model_id, n.model, n.n_layers, n.hidden_shape) == (
            f"node-{i}", "stub", "stub-model", "stub-model", 8, (4, 64))
        assert (n.stub_delay, n.ctx, n.max_sessions, n.wire_dtype, n.host, n.port) == (
            0.01, 512, 2, "bf16", "127.0.0.2", 0)
        assert n.threads == local_threads(3)  # an equal share of this machine's cores (no --threads given)
        assert specs[f"node-{i}"].env == {"OMP_WAIT_POLICY": "passive"} and not specs[f"node-{i}"].essential
    assert (parsed["gateway"].host, parsed["gateway"].port) == ("127.0.0.1", 8123)
    assert specs["tracker"].essential and specs["gateway"].essential and not specs["gateway"].env


def test_a_fleet_without_its_file_cannot_pass_settings_or_secrets(tmp_path: Path) -> None:
    with pytest.raises(BadRequestError, match="fleet up FILE"):
        LocalFleet(Fleet.model_validate(BASE), home=tmp_path, log_level="info")  # BASE has NATS credentials


def test_a_seeder_seeds_from_its_store_by_the_model_id() -> None:
    doc = _swarm_doc()
    doc["seeders"] = [{"name": "seed-1", "from_store": True}]
    doc["models"]["gemma"]["allow_unproven_architecture"] = True
    fleet = Fleet.model_validate(doc)
    assert member_argv(fleet, "seeder", "seed-1") == ["seeder", SHA, "--node-id", "seed-1", "--listen-host",
                                                      "127.0.0.1", "--listen-port", "0",
                                                      "--allow-unproven-architecture"]  # the model's override
    assert member_argv(fleet, "node", "n1")[-1] == "--allow-unproven-architecture"
    no_id = copy.deepcopy(BASE)
    no_id["seeders"] = [{"name": "seed-1", "from_store": True}]
    with pytest.raises(BadRequestError, match="seeders\\[0\\].from_store: seeds the model by its sha256"):
        parse_fleet(json.dumps(no_id))


@pytest.mark.parametrize("explicit", [None, 5])
def test_up_fleets_give_each_local_node_its_share_of_the_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              explicit: int | None) -> None:
    """``up`` and ``up --from-swarm`` (empty nodes of a model named by its sha256, and a seeder) build their fleets
    with ``up_fleet``: every node's command line carries ``--threads`` = cores / nodes, unless ``--threads`` was
    given; an unproven model's override reaches its seeder as well as its nodes."""
    from schemas.fleet import ModelSpec, SeederSpec
    from swarmroute.cli import build_parser
    from swarmroute.launcher import listen, up_fleet, up_model

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    parser = build_parser()
    extra = ["--threads", str(explicit)] if explicit else []
    settings = Settings(home=tmp_path / "home", namespace="up-test")
    args = parser.parse_args(["up", "--backend", "stub", *extra])
    fleets = {"up": up_fleet(args, settings, up_model(args, "stub-model", 8), nodes=2, gateway=listen("::1", 0))}
    args = parser.parse_args(["up", "--from-swarm", "--allow-unproven-architecture", *extra])
    swarm_model = ModelSpec(backend="llamacpp", id="alias", sha256=SHA, allow_unproven_architecture=True)
    fleets["up --from-swarm"] = up_fleet(args, settings, swarm_model, nodes=3, gateway=listen("127.0.0.1", 0),
                                         memory="300MiB", seeders=[SeederSpec(name="seeder", from_store=True)])
    for command, n_nodes in (("up", 2), ("up --from-swarm", 3)):
        fleet = fleets[command]
        for node in fleet.nodes:
            argv = parser.parse_args(member_argv(fleet, "node", node.name))
            assert argv.threads == (explicit or 8 // n_nodes), (command, node.name)
    assert member_argv(fleets["up --from-swarm"], "seeder", "seeder")[-1] == "--allow-unproven-architecture"
