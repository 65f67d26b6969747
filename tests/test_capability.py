"""Session capabilities: the tracker signs one per hop, nodes admit a session only with theirs, and every later
request about the session must carry the session token. Real tracker, nodes, gateway, NATS and HTTP on loopback."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from actors.node.admission import Admission
from bus import capability as caps
from bus import frame as frames
from bus.nodeclient import FRAME_CONTENT_TYPE
from schemas.errors import CapabilityError, PermissionDeniedError
from schemas.frame import FrameHeader, FrameKind, WireDType
from schemas.node import LayerRange
from schemas.route import Hop, Route, RouteRequest
from schemas.session import SessionOpen
from schemas.settings import Settings
from tests.support.swarm import Swarm, Swarms, make_settings, stub
from tests.support.waiting import eventually

MODEL = "stub-model"
SECRET = "capability-test-secret-" + "x" * 16


def a_route(session_id: str = "a" * 32) -> Route:
    return Route(session_id=session_id, model_id=MODEL, n_layers=8, hidden_shape=[64], context_length=4096,
                 hops=[Hop(node_id="n1", endpoint="http://127.0.0.1:1", layers=LayerRange(start=0, end=4)),
                       Hop(node_id="n2", endpoint="http://127.0.0.1:2", layers=LayerRange(start=4, end=8))])


def an_open(route: Route, hop: int) -> SessionOpen:
    return SessionOpen(session_id=route.session_id, route=caps.strip(route), hop_index=hop, prompt_tokens=[1, 2],
                       max_tokens=4, capability=route.hops[hop].capability)


# ---- signing and verification -----------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["hs256", "ed25519"])
def test_every_hop_gets_its_own_grant_and_all_share_one_session_token(scheme: str) -> None:
    if scheme == "hs256":
        signer: caps.Signer = caps.HmacKey(SECRET.encode())
        verifier: caps.Verifier = caps.HmacKey(SECRET.encode())
    else:
        seed, public = caps.new_ed25519_keypair()
        signer = caps.Ed25519Signer(base64.urlsafe_b64decode(seed + "=="))
        verifier = caps.Ed25519Verifier(base64.urlsafe_b64decode(public + "=="))
    route = caps.issue(a_route(), signer, 30.0)
    claims = [caps.verify(h.capability, verifier) for h in route.hops]
    assert [(c.node_id, c.hop) for c in claims] == [("n1", 0), ("n2", 1)]
    assert claims[0].session_token == claims[1].session_token and len(claims[0].session_token) >= 16
    assert all(c.route_digest == caps.route_digest(route) == caps.route_digest(caps.strip(route)) for c in claims)
    other = caps.issue(a_route("b" * 32), signer, 30.0)
    assert caps.peek(other.hops[0].capability).session_token != claims[0].session_token
    assert all(h.capability == "" for h in caps.strip(route).hops)


def _tamper_payload(token: str, **changes: object) -> str:
    alg, payload, sig = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims.update(changes)
    forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"{alg}.{forged}.{sig}"


def test_forged_tampered_and_foreign_capabilities_do_not_verify() -> None:
    key = caps.HmacKey(SECRET.encode())
    token = caps.issue(a_route(), key, 30.0).hops[1].capability
    cases = {
        "tampered node": _tamper_payload(token, node="n1"),
        "tampered expiry": _tamper_payload(token, exp=time.time() + 1e6),
        "another swarm's secret": caps.issue(a_route(), caps.HmacKey(b"another-secret-of-16+"), 30.0)
        .hops[1].capability,
        "truncated signature": token[:-4],
        "not a token": "hello",
        "empty": "",
    }
    for name, bad in cases.items():
        with pytest.raises(CapabilityError) as err:
            caps.verify(bad, key)
        assert err.value.status == 401 and err.value.message, name
    seed, _ = caps.new_ed25519_keypair()
    ed_token = caps.issue(a_route(), caps.Ed25519Signer(base64.urlsafe_b64decode(seed + "==")), 30.0).hops[0].capability
    with pytest.raises(CapabilityError, match="accepts 'hs256' only"):
        caps.verify(ed_token, key)
    assert caps.verify(token, key).node_id == "n2"


def test_admission_binds_grant_to_node_hop_session_route_and_time() -> None:
    key = caps.HmacKey(SECRET.encode())
    gate = Admission(key, "n2", skew_s=5.0)
    route = caps.issue(a_route(), key, 30.0)
    good = an_open(route, 1)
    claims = gate.admit_open(good)
    assert claims is not None and claims.node_id == "n2"

    def refused(request: SessionOpen) -> Exception:
        with pytest.raises((CapabilityError, PermissionDeniedError)) as err:
            gate.admit_open(request)
        return err.value

    assert refused(an_open(route, 0)).status == 403  # n1's grant presented to n2
    assert refused(good.model_copy(update={"hop_index": 0})).status == 403
    assert refused(good.model_copy(update={"session_id": "c" * 32})).status == 403
    moved = a_route()
    moved.hops[1].endpoint = "http://127.0.0.1:9"  # same ids, a different successor endpoint
    assert "different route" in refused(good.model_copy(update={"route": moved})).message
    expired = caps.issue(a_route(), key, 30.0, now=time.time() - 60)
    err = refused(an_open(expired, 1))
    assert err.status == 401 and "expired" in err.message
    assert refused(good.model_copy(update={"capability": ""})).status == 401
    gate.record(claims)
    assert "already used" in refused(good).message  # replay after the session closed
    assert Admission(None, "n2", skew_s=5.0).admit_open(good.model_copy(update={"capability": ""})) is None

    Admission.check_session_token(None, None)  # admission off
    Admission.check_session_token(claims.session_token, claims.session_token)
    with pytest.raises(CapabilityError):
        Admission.check_session_token(claims.session_token, None)
    with pytest.raises(PermissionDeniedError):
        Admission.check_session_token(claims.session_token, claims.session_token[:-1] + "x")


# ---- a live swarm -----------------------------------------------------------------------------------------------

@pytest.fixture
def secure_settings(nats_server: object, tmp_path: Path) -> Settings:
    return make_settings(nats_server.url, tmp_path / "home", swarm_secret=SECRET)  # type: ignore[attr-defined]


async def test_swarm_with_secret_serves_and_binds_each_session(secure_settings: Settings, swarms: Swarms) -> None:
    head, tail = stub(0, 4), stub(4, 8)
    swarm = await swarms.start(secure_settings, [head, tail], model_id=MODEL)
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)
    seen_tokens: list[str | None] = []

    def spy_open(node_index: int) -> None:
        node = swarm.nodes[node_index]
        original = node.open_session

        async def wrapped(request: SessionOpen):  # type: ignore[no-untyped-def]
            opened = await original(request)
            seen_tokens.append(node.sessions[request.session_id].session_token)
            assert request.route.hops[0].capability == "" and request.capability  # only its own grant
            return opened

        node.open_session = wrapped  # type: ignore[method-assign]

    spy_open(0)
    spy_open(1)
    result = await client.completions.create(model=MODEL, prompt="hello", max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert result.usage is not None and result.usage.completion_tokens == 8
    assert len(seen_tokens) == 2 and seen_tokens[0] and seen_tokens[0] == seen_tokens[1]
    await eventually(lambda: not head.open_sessions and not tail.open_sessions, timeout=2.0, interval=0.02,
                     what="both nodes closing the session")
    assert head.open_sessions == [] and tail.open_sessions == []  # the gateway's close carried the token


def _frame(session_id: str, start: int, n: int = 1) -> bytes:
    header = FrameHeader(session_id=frames.session_bytes(session_id), kind=FrameKind.PREFILL, dtype=WireDType.F32,
                         start_position=start, n_positions=n, position_shape=(64,))
    return frames.encode(header, np.zeros((n, 64), dtype=np.float32))


async def _open_tail_directly(swarm: Swarm, session_id: str) -> tuple[Route, str]:
    """A signed route from the real tracker, opened on the tail only, as a head would find it."""
    reply = swarm.tracker.route(RouteRequest(model=MODEL, session_id=session_id))
    assert reply.route is not None
    route = reply.route
    tail = route.hops[1]
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{tail.endpoint}/v1/sessions", json=an_open(route, 1).model_dump(mode="json"))
        assert r.status_code == 201, r.text
    return route, caps.peek(tail.capability).session_token


async def test_node_refuses_requests_without_the_right_grant_with_a_reason(secure_settings: Settings,
                                                                          swarms: Swarms) -> None:
    swarm = await swarms.start(secure_settings, [stub(0, 4), stub(4, 8)], model_id=MODEL)
    sid = "d" * 32
    route, token = await _open_tail_directly(swarm, sid)
    head, tail = route.hops
    url = f"{tail.endpoint}/v1/sessions/{sid}"
    async with httpx.AsyncClient() as http:
        async def post_frame(headers: dict[str, str], start: int = 0) -> httpx.Response:
            return await http.post(f"{url}/frames", content=_frame(sid, start),
                                   headers={"content-type": FRAME_CONTENT_TYPE, **headers})

        r = await post_frame({})
        assert r.status_code == 401 and caps.HEADER_SESSION_TOKEN in r.json()["error"]["message"]
        r = await post_frame({caps.HEADER_SESSION_TOKEN: "x" * 32})
        assert r.status_code == 403 and "wrong session token" in r.json()["error"]["message"]
        r = await post_frame({caps.HEADER_SESSION_TOKEN: token})
        assert r.status_code == 200 and r.json()["position"] == 1  # the tail computed it
        r = await http.get(url)
        assert r.status_code == 401
        r = await http.delete(url)
        assert r.status_code == 401 and sid in swarm.nodes[1].sessions  # not closed by a stranger

        # Opening needs this node's own, unexpired grant for this hop of this route.
        other = "e" * 32
        reply = swarm.tracker.route(RouteRequest(model=MODEL, session_id=other))
        assert reply.route is not None
        for body, status, reason in [
            (an_open(reply.route, 1).model_copy(update={"capability": ""}), 401, "missing session capability"),
            (an_open(reply.route, 1).model_copy(update={"capability": reply.route.hops[0].capability}), 403,
             "is for node"),
            (an_open(reply.route, 1).model_copy(update={"capability": caps.issue(
                reply.route, caps.HmacKey(b"not-the-swarm-secret!"), 30).hops[1].capability}), 401,
             "does not verify"),
        ]:
            r = await http.post(f"{tail.endpoint}/v1/sessions", json=body.model_dump(mode="json"))
            assert r.status_code == status and reason in r.json()["error"]["message"], r.text
        r = await http.post(f"{head.endpoint}/v1/tokenize", json={"text": "hi"})
        assert r.status_code == 401
        r = await http.post(f"{head.endpoint}/v1/tokenize", json={"text": "hi"},
                            headers={caps.HEADER_CAPABILITY: head.capability})
        assert r.status_code == 200 and r.json()["tokens"]
        r = await http.delete(url, headers={caps.HEADER_SESSION_TOKEN: token})
        assert r.status_code == 200 and sid not in swarm.nodes[1].sessions
        r = await http.post(f"{tail.endpoint}/v1/sessions", json=an_open(route, 1).model_dump(mode="json"))
        assert r.status_code == 403 and "already used" in r.json()["error"]["message"]  # no replay


async def test_mismatched_secrets_fail_cleanly_as_a_route_error(nats_server: object, tmp_path: Path) -> None:
    """A node with another secret refuses the tracker's grants: the client gets a 502 naming the node, not a 401."""
    url = nats_server.url  # type: ignore[attr-defined]
    good = make_settings(url, tmp_path / "h", swarm_secret=SECRET)
    odd = make_settings(url, tmp_path / "h", swarm_secret="a-different-secret-entirely")
    from actors.node import Node, NodeConfig
    from actors.tracker import Tracker
    from gateway.app import Gateway
    from tests.support.swarm import wait_model

    async with Tracker(good) as tracker, Node(NodeConfig("n1", MODEL), stub(0, 4), good), \
            Node(NodeConfig("n2", MODEL), stub(4, 8), odd) as n2, Gateway(good, port=0) as gateway:
        await wait_model(tracker, MODEL, n_nodes=2)
        client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as err:
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert err.value.status_code == 502
        assert "n2" in err.value.message and "capability" in err.value.message
        assert not n2.sessions


async def test_ed25519_swarm_serves_and_nodes_cannot_mint(nats_server: object, tmp_path: Path) -> None:
    seed, public = caps.new_ed25519_keypair()
    url = nats_server.url  # type: ignore[attr-defined]
    tracker_settings = make_settings(url, tmp_path / "h", capability_signing_key=seed)
    node_settings = make_settings(url, tmp_path / "h", capability_verify_key=public)
    assert caps.signer_from_settings(node_settings) is None  # a node holds nothing to sign with
    from actors.node import Node, NodeConfig
    from actors.tracker import Tracker
    from gateway.app import Gateway
    from tests.support.swarm import wait_model

    async with Tracker(tracker_settings) as tracker, Node(NodeConfig("n1", MODEL), stub(0, 4), node_settings), \
            Node(NodeConfig("n2", MODEL), stub(4, 8), node_settings), Gateway(node_settings, port=0) as gateway:
        await wait_model(tracker, MODEL, n_nodes=2)
        client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        result = await client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0,
                                                 extra_body={"ignore_eos": True})
        assert result.usage is not None and result.usage.completion_tokens == 4
        reply = tracker.route(RouteRequest(model=MODEL, session_id="f" * 32))
        assert reply.route is not None and reply.route.hops[0].capability.startswith("ed25519.")
