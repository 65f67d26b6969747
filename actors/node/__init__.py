"""The node actor: serves one shard over binary HTTP, keeps its sessions' Hot KV State, heartbeats on NATS."""

from actors.node.actor import Node, NodeConfig

__all__ = ["Node", "NodeConfig"]
