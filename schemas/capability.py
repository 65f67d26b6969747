"""Session capabilities: what the tracker grants one node for one Route Session, signed, short-lived.

A capability travels as a compact token ``<alg>.<payload>.<signature>`` (base64url parts, see ``bus.capability``).
The tracker issues one per hop inside the Route; the gateway hands each hop its own in ``SessionOpen.capability``.
The node verifies it once, at open, and from then on admits the session's frames, tokens, failure reports and
close only when they carry ``session_token`` (the same for every hop of the session) — a constant-time compare,
so the per-token path pays no signature check.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

CAPABILITY_VERSION = 1


class Capability(BaseModel):
    """The signed claims. Short keys keep the token small: it rides in every SessionOpen and in NATS replies."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    version: int = Field(default=CAPABILITY_VERSION, alias="v")
    session_id: str = Field(alias="sid", min_length=1, max_length=64)
    """The Route Session this grant is for."""

    node_id: str = Field(alias="node", min_length=1, max_length=128)
    """The only node that may accept it."""

    hop: int = Field(ge=0)
    """The node's place in the route; a capability for hop 1 does not open hop 0."""

    expires_at: float = Field(alias="exp")
    """Unix time after which the session may no longer be opened with it (the open session lives on)."""

    route_digest: str = Field(alias="route", min_length=1, max_length=128)
    """Digest of the route's hops (ids, endpoints, layers): the route cannot be redirected to another successor."""

    session_token: str = Field(alias="link", min_length=16, max_length=128)
    """Random, the same for every hop of the session: proves membership on frames, tokens and control calls."""
