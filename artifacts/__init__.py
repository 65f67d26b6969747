"""The Model Artifact plane: manifests, shard GGUFs, the content-addressed store, verification and the torrent swarm.

Imports only ``schemas`` and third-party packages (gguf, libtorrent): NATS glue lives in
``actors.provisioning.artifact_sync``.
"""
