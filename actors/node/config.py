"""What a node is told at start besides its backend and settings: its identity, where it listens and what it
advertises (``actors.node.actor.Node``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class NodeConfig:
    node_id: str
    """Unique in the swarm; also the registry key."""

    model_id: str
    """What the tracker matches route requests against (content-derived id for GGUF artifacts)."""

    host: str = "127.0.0.1"
    """Listen address of the node's HTTP API."""

    port: int = 0
    """Listen port; 0 picks a free one."""

    advertise_url: str | None = None
    """Base URL peers should use, when it differs from the listen address (NAT, containers)."""

    wire_dtype: str = "f32"
    """Activation dtype this node sends: f32 (bit-exact) or f16 (half the bytes)."""

    manifest_id: str = ""
    """Artifact manifest this node's shard was verified against."""

    verified: bool = True
    """Whether the shard passed verification; unverified nodes are never routed to."""

    aliases: tuple[str, ...] = ()
    """Other names clients may use for the model (the id stays content-derived for GGUF artifacts)."""
