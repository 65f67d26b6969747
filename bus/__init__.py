"""The control plane: an embedded NATS server, connections to it, every subject name, and the wire codecs."""
