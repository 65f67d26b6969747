"""Issuing and checking session capabilities (``schemas.capability``) — shared by tracker, gateway and nodes.

Token: ``<alg>.<base64url(payload JSON)>.<base64url(signature over "<alg>.<payload>")>``. The algorithm is part of
the signed bytes and each verifier accepts exactly one, so a token cannot be replayed under a weaker algorithm.

- ``hs256``: HMAC-SHA256 with ``Settings.swarm_secret`` (trackers and nodes share the secret).
- ``ed25519``: trackers hold the private key, nodes only the public key, so a node cannot mint capabilities for
  other nodes. Needs the ``cryptography`` package.

The gateway never needs a key: it only reads (``peek``) the session token out of the capabilities it forwards.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from typing import Protocol

from pydantic import ValidationError

from schemas.capability import Capability
from schemas.errors import CapabilityError
from schemas.route import Hop, Route
from schemas.settings import Settings

HEADER_SESSION_TOKEN = "x-swarmroute-session-token"
"""Carries ``Capability.session_token`` on every request about an open session (frames, tokens, failure, close)."""

HEADER_CAPABILITY = "x-swarmroute-capability"
"""Carries a whole capability on session-less requests to a node (tokenize)."""

MAX_TOKEN_CHARS = 4096


class Signer(Protocol):
    alg: str

    def sign(self, data: bytes) -> bytes: ...


class Verifier(Protocol):
    alg: str

    def verify(self, data: bytes, signature: bytes) -> bool: ...


class HmacKey:
    """HMAC-SHA256: signs and verifies with the same swarm secret."""

    alg = "hs256"

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("the swarm secret must be at least 16 bytes")
        self._secret = secret

    def sign(self, data: bytes) -> bytes:
        return hmac.new(self._secret, data, hashlib.sha256).digest()

    def verify(self, data: bytes, signature: bytes) -> bool:
        return hmac.compare_digest(self.sign(data), signature)

    def __repr__(self) -> str:
        return "HmacKey(<secret>)"


class Ed25519Signer:
    alg = "ed25519"

    def __init__(self, seed: bytes) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        self._key = Ed25519PrivateKey.from_private_bytes(seed)

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def public_key(self) -> bytes:
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        return self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def __repr__(self) -> str:
        return "Ed25519Signer(<private key>)"


class Ed25519Verifier:
    alg = "ed25519"

    def __init__(self, public_key: bytes) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        self._key = Ed25519PublicKey.from_public_bytes(public_key)

    def verify(self, data: bytes, signature: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature

        try:
            self._key.verify(signature, data)
        except InvalidSignature:
            return False
        return True


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def signer_from_settings(settings: Settings) -> Signer | None:
    """The tracker's signer: Ed25519 if a signing key is configured, else HMAC if a swarm secret is, else None."""
    if settings.capability_signing_key is not None:
        return Ed25519Signer(_unb64(settings.capability_signing_key.get_secret_value()))
    if settings.swarm_secret is not None:
        return HmacKey(settings.swarm_secret.get_secret_value().encode())
    return None


def verifier_from_settings(settings: Settings) -> Verifier | None:
    """A node's verifier: Ed25519 if a public key is configured, else HMAC with the swarm secret, else None (off)."""
    if settings.capability_verify_key:
        return Ed25519Verifier(_unb64(settings.capability_verify_key))
    if settings.swarm_secret is not None:
        return HmacKey(settings.swarm_secret.get_secret_value().encode())
    return None


def new_ed25519_keypair() -> tuple[str, str]:
    """(private seed, public key), both base64url, for ``capability_signing_key`` / ``capability_verify_key``."""
    seed = secrets.token_bytes(32)
    return _b64(seed), _b64(Ed25519Signer(seed).public_key())


def route_digest(route: Route) -> str:
    """Binds a capability to the exact route: session, model, and every hop's id, endpoint and layers, in order."""
    hops = [[h.node_id, h.endpoint, h.layers.start, h.layers.end] for h in route.hops]
    canonical = json.dumps([route.session_id, route.model_id, hops], separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()[:32]


def encode(capability: Capability, signer: Signer) -> str:
    payload = _b64(capability.model_dump_json(by_alias=True).encode())
    signed = f"{signer.alg}.{payload}"
    return f"{signed}.{_b64(signer.sign(signed.encode()))}"


def _split(token: str) -> tuple[str, str, str]:
    if not token:
        raise CapabilityError("missing session capability: this node requires one issued by the tracker")
    if len(token) > MAX_TOKEN_CHARS:
        raise CapabilityError(f"session capability longer than {MAX_TOKEN_CHARS} characters")
    parts = token.split(".")
    if len(parts) != 3:
        raise CapabilityError("malformed session capability: expected <alg>.<payload>.<signature>")
    return parts[0], parts[1], parts[2]


def _claims(payload: str) -> Capability:
    try:
        return Capability.model_validate_json(_unb64(payload))
    except (ValidationError, binascii.Error, ValueError) as exc:
        raise CapabilityError(f"malformed session capability payload: {type(exc).__name__}") from None


def peek(token: str) -> Capability:
    """The claims without checking the signature: for the gateway, which only forwards capabilities."""
    return _claims(_split(token)[1])


def verify(token: str, verifier: Verifier) -> Capability:
    """Check the signature and return the claims; expiry and binding are the caller's checks
    (``actors.node.admission``)."""
    alg, payload, signature = _split(token)
    if alg != verifier.alg:
        raise CapabilityError(f"session capability signed with {alg!r}; this node accepts {verifier.alg!r} only")
    try:
        raw_signature = _unb64(signature)
    except (binascii.Error, ValueError):
        raise CapabilityError("malformed session capability signature") from None
    if not verifier.verify(f"{alg}.{payload}".encode(), raw_signature):
        raise CapabilityError("session capability signature does not verify (forged, or another swarm's key)")
    return _claims(payload)


def issue(route: Route, signer: Signer, ttl_s: float, *, now: float | None = None, link: str | None = None) -> Route:
    """A copy of ``route`` whose every hop (and every hop's standby holder, issue #18, and prefix source, issue #26)
    carries its capability; one session token for the whole route: fresh, or ``link`` (a repaired route keeps its
    session's token)."""
    digest = route_digest(route)
    link = link or secrets.token_urlsafe(24)
    expires = (time.time() if now is None else now) + ttl_s

    def grant(node: str, hop: int) -> str:
        return encode(Capability(sid=route.session_id, node=node, hop=hop, exp=expires, route=digest, link=link),
                      signer)

    hops = [hop.model_copy(update={
        "capability": grant(hop.node_id, i),
        "standby": None if hop.standby is None else hop.standby.model_copy(
            update={"capability": grant(hop.standby.node_id, i)}),
        "prefix_source": None if hop.prefix_source is None else hop.prefix_source.model_copy(
            update={"capability": grant(hop.prefix_source.node_id, i)})})
        for i, hop in enumerate(route.hops)]
    return route.model_copy(update={"hops": hops})


def strip(route: Route, *, keep_standby: int | None = None) -> Route:
    """The route without capabilities: what a hop receives, so no hop learns another hop's grant. ``keep_standby``:
    hop whose standby grant stays (the hop that sends its snapshots there needs it)."""
    def bare(i: int, h: Hop) -> Hop:
        standby = h.standby
        if standby is not None and i != keep_standby:
            standby = standby.model_copy(update={"capability": ""})
        return h.model_copy(update={"capability": "", "standby": standby})
    return route.model_copy(update={"hops": [bare(i, h) for i, h in enumerate(route.hops)]})


def session_token_of(route: Route) -> str | None:
    """The session token the route's capabilities carry (None without capabilities): for the gateway's close."""
    token = route.hops[0].capability if route.hops else ""
    if not token:
        return None
    try:
        return peek(token).session_token
    except CapabilityError:
        return None
