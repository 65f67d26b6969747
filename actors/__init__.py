"""The actors of a swarm: tracker, node (with its model backends) and the per-session telemetry publisher."""
