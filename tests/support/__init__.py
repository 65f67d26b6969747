"""Test helpers: real swarms (NATS, tracker, nodes, gateway) in-process or as child processes."""
