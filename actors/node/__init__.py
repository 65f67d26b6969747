"""The node actor: serves one shard over binary HTTP, keeps its sessions' Hot KV State, heartbeats on NATS."""

from actors.node.actor import Node
from actors.node.config import NodeConfig

__all__ = ["Node", "NodeConfig"]
