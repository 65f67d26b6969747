"""A node that joins with only a model id (issue #17): the manifest asked of the swarm (``manifest_request``), the
artifact control plane on NATS (``artifact_sync``), layer-range ``leases`` in JetStream KV, and the
``provisioner`` that fetches, verifies and cuts the shard."""
