"""The data plane over mutually authenticated TLS 1.3, keys pinned to the registry (issue #29), on a real swarm of
stub nodes: real nats-server, real uvicorn servers over real TLS, real OpenAI client.

What is proven here:
* a node's identity: a key created 0600 on first start, the same key (fingerprint) on the next, a renewed
  certificate keeps it, a new key is a new fingerprint;
* a swarm with TLS on serves, every node advertising an ``https://<fingerprint>@`` endpoint and its fingerprint;
* a relay between the hops records neither the prompt, the tokens' text nor the session token (the same relay on a
  plaintext swarm sees the session token: the capture would notice);
* a process holding a valid session token but not the registered key cannot open a connection to the next hop or
  send it frames, while the registered key with the very same request is served;
* a node advertising another node's fingerprint is refused both ways; a removed key and an expired certificate are
  refused.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import ssl
import uuid
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from bus import capability as caps
from bus import codec
from bus import frame as frames
from bus.hoplink import HttpLink, LinkError
from bus.identity import Identity, IdentityError, from_files, load_or_create, self_signed
from bus.nodeclient import FRAME_CONTENT_TYPE, NodeClient
from bus.subjects import Subjects
from bus.tls import PinError, ServerTrust, client_context, pin_endpoint, split_pin
from schemas.frame import FrameHeader, FrameKind, WireDType
from schemas.node import NodeAdvertisement
from schemas.route import RouteRequest
from schemas.session import SessionOpen
from schemas.settings import Settings
from tests.support.relay import RecordingRelay
from tests.support.swarm import Swarm, Swarms, make_settings, stub
from tests.support.waiting import eventually

MODEL = "stub-model"
SECRET = "a-swarm-secret-of-enough-length"
PROMPT = "the quick brown fox jumps over the lazy dog"


def tls_settings(nats_url: str, home: Path, **overrides: object) -> Settings:
    """TLS on (the nodes listen on loopback, where ``auto`` would leave it off), capabilities on, and the gateway's
    key, made here, named to the nodes as a trusted client."""
    gateway = load_or_create(home / "identity", "gateway")
    return make_settings(nats_url, home, tls="on", swarm_secret=SECRET, tls_trusted_certs=gateway.cert_file,
                         **overrides)


@pytest.fixture
def secure(nats_server: object, tmp_path: Path) -> Settings:
    return tls_settings(nats_server.url, tmp_path / "home")  # type: ignore[attr-defined]


# ---- identity ---------------------------------------------------------------------------------------------------


def test_identity_is_created_private_and_kept(tmp_path: Path) -> None:
    first = load_or_create(tmp_path / "id", "n1")
    assert os.stat(first.key_file).st_mode & 0o777 == 0o600
    assert os.stat(tmp_path / "id").st_mode & 0o777 == 0o700
    again = load_or_create(tmp_path / "id", "n1")
    assert again.fingerprint == first.fingerprint and len(first.fingerprint) == 64
    assert load_or_create(tmp_path / "id", "n2").fingerprint != first.fingerprint  # another key, another identity


def test_a_certificate_near_its_end_is_renewed_for_the_same_key(tmp_path: Path) -> None:
    first = load_or_create(tmp_path, "n1")
    key = serialization.load_pem_private_key(first.key_file.read_bytes(), password=None)
    assert isinstance(key, ed25519.Ed25519PrivateKey)
    old = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=360)
    first.cert_file.write_bytes(self_signed(key, "n1", not_before=old).public_bytes(serialization.Encoding.PEM))
    renewed = load_or_create(tmp_path, "n1")
    assert renewed.cert_pem != first.cert_pem and renewed.fingerprint == first.fingerprint


def test_a_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    identity = load_or_create(tmp_path, "n1")
    identity.key_file.chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        load_or_create(tmp_path, "n1")


def test_a_given_key_pair_is_checked_before_it_is_used(tmp_path: Path) -> None:
    """Files an operator names (``tls_cert_file``/``_key_file``, a fleet member's ``identity``): a clear error for a
    missing or unreadable file, a key others can read, a file that is not PEM, or a certificate of another key."""
    a, b = load_or_create(tmp_path / "a", "a"), load_or_create(tmp_path / "b", "b")
    assert from_files(a.cert_file, a.key_file).fingerprint == a.fingerprint
    with pytest.raises(IdentityError, match=r"cannot read the certificate .*nope\.crt: No such file"):
        from_files(tmp_path / "nope.crt", a.key_file)
    with pytest.raises(IdentityError, match=r"cannot read the key .*nope\.key: No such file"):
        from_files(a.cert_file, tmp_path / "nope.key")
    with pytest.raises(IdentityError, match=r"b\.crt is not the certificate of the key in .*a\.key"):
        from_files(b.cert_file, a.key_file)
    with pytest.raises(IdentityError, match="a.key is not an unencrypted PEM private key"):
        from_files(a.cert_file, _write(tmp_path / "bad" / "a.key", b"not a key\n"))
    with pytest.raises(IdentityError, match="junk.crt is not a PEM certificate"):
        from_files(_write(tmp_path / "junk.crt", b"junk"), a.key_file)
    a.key_file.chmod(0o640)
    with pytest.raises(IdentityError, match="readable by others .*chmod 600"):
        from_files(a.cert_file, a.key_file)


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def test_pins_ride_in_the_endpoint_and_must_be_fingerprints() -> None:
    pinned = pin_endpoint("https://10.0.0.1:9101", "ab" * 32)
    assert pinned == f"https://{'ab' * 32}@10.0.0.1:9101"
    assert split_pin(pinned + "/v1/sessions") == ("https://10.0.0.1:9101/v1/sessions", "ab" * 32)
    assert split_pin("http://10.0.0.1:9101") == ("http://10.0.0.1:9101", None)
    with pytest.raises(ValueError, match="fingerprint"):
        split_pin("https://user:password@10.0.0.1:9101")
    with pytest.raises(ValueError, match="https"):
        pin_endpoint("http://10.0.0.1:9101", "ab" * 32)


def test_an_advertisement_whose_pin_is_not_its_fingerprint_is_invalid(tmp_path: Path) -> None:
    a, b = load_or_create(tmp_path, "a"), load_or_create(tmp_path, "b")
    with pytest.raises(ValueError, match="pin differs"):
        _advert("x", pin_endpoint("https://127.0.0.1:1", a.fingerprint), b)


# ---- a swarm over TLS ---------------------------------------------------------------------------------------------


async def _tls_swarm(swarms: Swarms, settings: Settings) -> Swarm:
    swarm = await swarms.start(settings, [stub(0, 4), stub(4, 8)], model_id=MODEL)
    for node in swarm.nodes:
        assert node.keys.identity is not None
        assert node.endpoint.startswith(f"https://{node.keys.identity.fingerprint}@127.0.0.1:")
        assert node.advertisement().fingerprint == node.keys.identity.fingerprint
    return swarm


async def _via_relay(swarms: Swarms, swarm: Swarm, index: int) -> RecordingRelay:
    """A recording relay in front of node ``index``, which the tracker then routes to."""
    node = swarm.nodes[index]
    relay = await RecordingRelay.start(("127.0.0.1", node.server.port))
    swarms.on_teardown(relay.stop)
    scheme, pin = ("https", node.keys.fingerprint) if node.keys.trust is not None else ("http", "")
    url = f"{scheme}://127.0.0.1:{relay.port}"
    await swarm.route_through(node, pin_endpoint(url, pin) if pin else url)
    return relay


async def _complete_capturing_token(swarm: Swarm) -> tuple[str, str]:
    """A streamed completion's text and its session token (read off the tail while the session is open)."""
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)
    stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
    text, token = "", ""
    async for chunk in stream:
        text += chunk.choices[0].text if chunk.choices else ""
        for session in swarm.nodes[1].sessions.values():
            token = token or session.session_token or ""
    assert token, "the tail never held the session while it streamed"
    return text, token


async def test_a_swarm_over_tls_serves_and_a_relay_between_hops_learns_nothing(secure: Settings,
                                                                               swarms: Swarms) -> None:
    swarm = await _tls_swarm(swarms, secure)
    head, tail = await _via_relay(swarms, swarm, 0), await _via_relay(swarms, swarm, 1)
    text, token = await _complete_capturing_token(swarm)
    assert len(text) > 0 and tail.connections > 0 and head.connections > 0
    for relay in (head, tail):
        seen = bytes(relay.captured)
        assert len(seen) > 1000  # frames and tokens crossed it
        assert PROMPT.encode() not in seen and b"quick brown" not in seen
        assert token.encode() not in seen
        assert text.strip().encode()[:8] not in seen
        assert b"x-swarmroute-session-token" not in seen and b"/v1/sessions" not in seen


async def test_the_same_relay_on_a_plaintext_swarm_sees_the_session_token(nats_server: object, tmp_path: Path,
                                                                          swarms: Swarms) -> None:
    plain = make_settings(nats_server.url, tmp_path / "home", swarm_secret=SECRET)  # type: ignore[attr-defined]
    swarm = await swarms.start(plain, [stub(0, 4), stub(4, 8)], model_id=MODEL)
    relay = await _via_relay(swarms, swarm, 1)
    _, token = await _complete_capturing_token(swarm)
    assert token.encode() in bytes(relay.captured)


def _frame(session_id: str) -> bytes:
    header = FrameHeader(session_id=frames.session_bytes(session_id), kind=FrameKind.PREFILL, dtype=WireDType.F32,
                         start_position=0, n_positions=2, position_shape=(64,))
    return frames.encode(header, np.zeros((2, 64), dtype=np.float32))


async def test_a_valid_session_token_without_the_registered_key_cannot_reach_the_hop(secure: Settings,
                                                                                     swarms: Swarms,
                                                                                     tmp_path: Path) -> None:
    swarm = await _tls_swarm(swarms, secure)
    route = swarm.tracker.route(RouteRequest(model=MODEL, session_id=uuid.uuid4().hex)).route
    assert route is not None
    tail = route.hops[1]
    token = caps.peek(tail.capability).session_token
    gateway = load_or_create(secure.home / "identity", "gateway")
    legit = NodeClient(tls=client_context(gateway))
    try:
        await legit.open_session("n2", tail.endpoint, SessionOpen(
            session_id=route.session_id, route=caps.strip(route), hop_index=1, prompt_tokens=[1, 2], max_tokens=4,
            capability=tail.capability))
        bare, pin = split_pin(tail.endpoint)
        impostor = client_context(load_or_create(tmp_path / "impostor", "n1"))  # n1's name, not n1's key
        link = HttpLink(bare, tls=impostor, pin=pin)
        with pytest.raises(LinkError):
            await link.post(f"/v1/sessions/{route.session_id}/frames", _frame(route.session_id),
                            FRAME_CONTENT_TYPE, 5.0, {caps.HEADER_SESSION_TOKEN: token})
        await link.aclose()
        assert swarm.nodes[1].sessions[route.session_id].position == 0  # no frame of it was computed
        # The very request with a registered key is served: only the key made the difference.
        await legit.send_frame("n2", tail.endpoint, route.session_id, _frame(route.session_id),
                               session_token=token)
        await eventually(lambda: swarm.nodes[1].sessions[route.session_id].position == 2, timeout=5.0,
                         what="the tail computing the frame sent with the registered key")
        # A client without any certificate does not get through the handshake either.
        anonymous = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        anonymous.check_hostname, anonymous.verify_mode = False, ssl.CERT_NONE
        with pytest.raises(LinkError):
            await HttpLink(bare, tls=anonymous, pin=pin).post(
                f"/v1/sessions/{route.session_id}/frames", _frame(route.session_id), FRAME_CONTENT_TYPE, 5.0,
                {caps.HEADER_SESSION_TOKEN: token})
    finally:
        await legit.aclose()


def _advert(node_id: str, endpoint: str, identity: Identity, model: str = "other-model") -> NodeAdvertisement:
    base = stub(0, 8, model=model)
    return NodeAdvertisement(node_id=node_id, endpoint=endpoint, model_id=model,
                             layers=base.layers, is_head=True, is_tail=True, backend=base.info,
                             capacity={"max_sessions": 1, "max_context": 64},  # type: ignore[arg-type]
                             fingerprint=identity.fingerprint, certificate=identity.cert_pem)


async def _put(swarm: Swarm, advert: NodeAdvertisement) -> None:
    js = swarm.nodes[0].nc.jetstream()
    kv = await js.key_value(Subjects(swarm.settings.namespace).registry_bucket)
    await kv.put(advert.node_id, codec.encode(advert))


async def _reaches(identity: Identity, endpoint: str) -> bool:
    client = NodeClient(tls=client_context(identity), timeout_s=3.0)
    try:
        return await client.probe("x", endpoint, timeout=3.0)
    finally:
        await client.aclose()


async def test_a_node_advertising_another_nodes_fingerprint_is_refused(secure: Settings, swarms: Swarms,
                                                                       tmp_path: Path) -> None:
    swarm = await _tls_swarm(swarms, secure)
    n1, n2 = swarm.nodes
    assert n1.keys.identity is not None and n2.keys.trust is not None
    stolen = n1.keys.identity
    forger = load_or_create(tmp_path / "forger", "evil")
    # The forger serves with its own key (it has no other) behind an endpoint pinned to n1's.
    trust = ServerTrust(forger)
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0, ssl=trust.context)
    swarms.on_teardown(server.close)
    port = server.sockets[0].getsockname()[1]
    claimed = Identity(key_file=forger.key_file, cert_file=forger.cert_file, fingerprint=stolen.fingerprint,
                       cert_pem=stolen.cert_pem)
    await _put(swarm, _advert("evil", pin_endpoint(f"https://127.0.0.1:{port}", stolen.fingerprint), claimed))
    await eventually(lambda: n2.keys.seen("evil"), timeout=5.0, what="n2 seeing the forged advertisement")
    # Nobody reaching the forged endpoint accepts the forger: it cannot prove n1's key.
    gateway = load_or_create(secure.home / "identity", "gateway")
    with pytest.raises(PinError):
        await _reaches_or_raise(gateway, pin_endpoint(f"https://127.0.0.1:{port}", stolen.fingerprint))
    # Its own key is named by no advertisement: n2 does not let it in.
    assert not await _reaches(forger, n2.endpoint)
    assert n2.keys.trust.register("evil", stolen.fingerprint, stolen.cert_pem) is False  # n1 holds that key
    assert await _reaches(n1.keys.identity, n2.endpoint)  # n1 itself still gets in


async def _reaches_or_raise(identity: Identity, endpoint: str) -> None:
    bare, pin = split_pin(endpoint)
    link = HttpLink(bare, tls=client_context(identity), pin=pin)
    try:
        await link._connect()  # noqa: SLF001 - the handshake and pin check alone
    finally:
        await link.aclose()


async def test_a_removed_key_and_an_expired_certificate_are_refused(secure: Settings, swarms: Swarms,
                                                                    tmp_path: Path) -> None:
    swarm = await _tls_swarm(swarms, secure)
    n2 = swarm.nodes[1]
    joiner = load_or_create(tmp_path / "joiner", "n9")
    assert not await _reaches(joiner, n2.endpoint)  # not registered yet
    await _put(swarm, _advert("n9", pin_endpoint("https://127.0.0.1:1", joiner.fingerprint), joiner))
    async def admitted() -> bool:
        return await _reaches(joiner, n2.endpoint)

    await eventually(admitted, timeout=5.0, what="n2 admitting the registered key")
    js = swarm.nodes[0].nc.jetstream()
    await (await js.key_value(Subjects(secure.namespace).registry_bucket)).delete("n9")
    await eventually(lambda: n2.keys.trust is not None and not n2.keys.trust.admits_fingerprint(joiner.fingerprint),
                     timeout=5.0, what="n2 forgetting the removed key")
    assert not await _reaches(joiner, n2.endpoint)
    # An expired certificate for a registered key: OpenSSL refuses it although the key is named.
    key = serialization.load_pem_private_key(joiner.key_file.read_bytes(), password=None)
    assert isinstance(key, ed25519.Ed25519PrivateKey)
    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=30)
    expired_cert = tmp_path / "expired.crt"
    expired_cert.write_bytes(self_signed(key, "n8", not_before=past, days=1).public_bytes(serialization.Encoding.PEM))
    expired = from_files(expired_cert, joiner.key_file)
    await _put(swarm, _advert("n8", pin_endpoint("https://127.0.0.1:1", expired.fingerprint), expired))
    await eventually(lambda: n2.keys.trust is not None and n2.keys.trust.admits_fingerprint(expired.fingerprint),
                     timeout=5.0, what="n2 registering the key of the expired certificate")
    assert not await _reaches(expired, n2.endpoint)


async def test_the_gateway_serves_https_when_given_a_certificate(nats_server: object, tmp_path: Path,
                                                                 swarms: Swarms) -> None:
    served = load_or_create(tmp_path / "gw", "https")
    settings = make_settings(nats_server.url, tmp_path / "home",  # type: ignore[attr-defined]
                             gateway_tls_cert_file=served.cert_file, gateway_tls_key_file=served.key_file)
    swarm = await swarms.start(settings, [stub(0, 8)], model_id=MODEL)
    assert swarm.url.startswith("https://127.0.0.1:")
    trusting = ssl.create_default_context(cafile=str(served.cert_file))
    trusting.check_hostname = False  # the certificate names no host: the key is what the client trusts
    async with httpx.AsyncClient(verify=trusting) as http:
        models = await http.get(f"{swarm.url}/v1/models")
        assert models.status_code == 200 and MODEL in models.text
    async with httpx.AsyncClient() as http:
        with pytest.raises(httpx.HTTPError):  # plain HTTP gets no answer from a TLS port
            await http.get(swarm.url.replace("https://", "http://") + "/v1/models")
