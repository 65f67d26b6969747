"""A node's gate: which requests may open, drive or close a Route Session here.

Off when no verifier is configured (no swarm secret, no Ed25519 key): everything is admitted, as before. On, a
session is opened only with a capability that verifies, is unexpired, names this node, this hop, this session and
this exact route, and has not opened a session here before (no replay). The open binds the session to the
capability's session token; every later request about the session must carry that token, checked with a
constant-time compare — one header lookup and one ``hmac.compare_digest`` on the per-token path.
"""

from __future__ import annotations

import collections
import hmac
import time

from bus import capability as caps
from schemas.capability import Capability
from schemas.errors import CapabilityError, PermissionDeniedError
from schemas.route import RouteUpdate
from schemas.session import SessionOpen

SETTLED_REMEMBERED = 8192
"""Session ids a node remembers having opened or refused: a close arriving later for one of them is not news."""


class Settlements:
    """Which of the sessions routed here settled without opening (issue #30): refused at open, or closed by their
    gateway before they ever opened here (a hop the route never reached because an earlier one refused).

    A tracker counts a route it handed out against every node on it until the node says the session settled: its
    advertisement's ``sessions_opened + sessions_refused`` passed the value seen at hand-out. Without the refusals a
    rejected request kept its slot until the reservation expired (1.5 heartbeats): five bad requests in a row made
    an idle swarm refuse everyone for seconds. Each id counts once, whichever of open, refusal or close comes first.
    """

    def __init__(self, remembered: int = SETTLED_REMEMBERED) -> None:
        self.refused = 0
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._remembered = remembered

    def _first(self, session_id: str) -> bool:
        if session_id in self._seen:
            return False
        self._seen[session_id] = None
        if len(self._seen) > self._remembered:
            self._seen.popitem(last=False)
        return True

    def opened(self, session_id: str) -> None:
        self._first(session_id)

    def refused_open(self, session_id: str) -> bool:
        """An open of ``session_id`` failed here; True when that settles it (the advertisement should go out now)."""
        if self._first(session_id):
            self.refused += 1
            return True
        return False

    def closed_unopened(self, session_id: str) -> bool:
        """A close for a session this node does not hold; True when it was never opened or refused here."""
        return self.refused_open(session_id)


class Admission:
    def __init__(self, verifier: caps.Verifier | None, node_id: str, *, skew_s: float) -> None:
        self._verifier = verifier
        self._node_id = node_id
        self._skew_s = skew_s
        self._used: dict[str, float] = {}
        """session id -> the capability's expiry: a capability opens its session once (bounded by expiry)."""
        self.settled = Settlements()
        """Routes that reached this node and will never open here (issue #30): trackers release them at once."""

    @property
    def enabled(self) -> bool:
        return self._verifier is not None

    def _verified(self, token: str, *, now: float) -> Capability:
        assert self._verifier is not None
        claims = caps.verify(token, self._verifier)
        if now > claims.expires_at + self._skew_s:
            raise CapabilityError(f"session capability expired {now - claims.expires_at:.0f}s ago; "
                                  f"ask the tracker for a new route", code="capability_expired")
        if claims.node_id != self._node_id:
            raise PermissionDeniedError(f"session capability is for node {claims.node_id}, not {self._node_id}")
        return claims

    def admit_open(self, request: SessionOpen) -> Capability | None:
        """Check ``request.capability`` (None when admission is off); ``record`` it once the session is open."""
        if self._verifier is None:
            return None
        now = time.time()
        claims = self._verified(request.capability, now=now)
        if claims.session_id != request.session_id:
            raise PermissionDeniedError(f"session capability is for session {claims.session_id}, "
                                        f"not {request.session_id}")
        if claims.hop != request.hop_index:
            raise PermissionDeniedError(f"session capability is for hop {claims.hop}, not hop {request.hop_index}")
        if claims.route_digest != caps.route_digest(request.route):
            raise PermissionDeniedError("session capability was issued for a different route (hops, endpoints or "
                                        "layers changed)")
        self._forget_expired(now)
        if claims.session_id in self._used:
            raise PermissionDeniedError(f"session capability for {claims.session_id} was already used on this node")
        return claims

    def check_update(self, update: RouteUpdate, bound: str | None) -> None:
        """A repaired route (issue #18): its grant for this hop must verify like an open's and carry the session
        token the session was opened with, so only the tracker can redirect a session, and only its own."""
        if self._verifier is None:
            return
        claims = self._verified(update.capability, now=time.time())
        if claims.session_id != update.session_id or claims.hop != update.hop_index:
            raise PermissionDeniedError("the route update's capability is for another session or hop")
        if claims.route_digest != caps.route_digest(update.route):
            raise PermissionDeniedError("the route update's capability was issued for a different route")
        self.check_session_token(bound, claims.session_token)

    def admit_standby(self, token: str | None, session_id: str) -> Capability:
        """The tracker's grant naming this node a standby holder of ``session_id``'s snapshots; the caller binds
        its session token to the session's chains."""
        assert self._verifier is not None
        claims = self._verified(token or "", now=time.time())
        if claims.session_id != session_id:
            raise PermissionDeniedError(f"standby capability is for session {claims.session_id}, not {session_id}")
        return claims

    def record(self, claims: Capability | None) -> None:
        """The session opened: its capability may not open it again (a replay after close)."""
        if claims is not None:
            self._used[claims.session_id] = claims.expires_at

    def _forget_expired(self, now: float) -> None:
        for sid in [s for s, exp in self._used.items() if now > exp + self._skew_s]:
            del self._used[sid]

    def check_capability(self, token: str | None) -> None:
        """Session-less calls (tokenize): any live capability for this node will do."""
        if self._verifier is not None:
            self._verified(token or "", now=time.time())

    @staticmethod
    def check_session_token(bound: str | None, given: str | None) -> None:
        """Per request on an open session: constant-time compare against the token bound at open."""
        if bound is None:
            return
        if not given:
            raise CapabilityError(f"missing {caps.HEADER_SESSION_TOKEN} header for this session")
        if not hmac.compare_digest(bound.encode(), given.encode()):
            raise PermissionDeniedError("wrong session token for this session")
