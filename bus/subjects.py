"""Every NATS subject and JetStream bucket swarmroute uses, in one place.

Namespace first, identifiers last, so monitoring tools subscribe with wildcards such as
``swarmroute.telemetry.>``. docs/protocol.md documents each subject's payload.
"""

from __future__ import annotations

import dataclasses
import re

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def _check_token(value: str, what: str) -> str:
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} is not a valid subject token (letters, digits, '-' and '_' only)")
    return value


@dataclasses.dataclass(frozen=True)
class Subjects:
    namespace: str = "swarmroute"
    """First token of every subject; lets several deployments share one NATS."""

    def __post_init__(self) -> None:
        _check_token(self.namespace, "namespace")

    @property
    def route_request(self) -> str:
        """Request/reply: RouteRequest -> RouteReply, served by trackers in queue group ``tracker``."""
        return f"{self.namespace}.tracker.route"

    @property
    def models_request(self) -> str:
        """Request/reply: empty -> ModelsReply (what live nodes serve); trackers serve it in queue group ``tracker``."""
        return f"{self.namespace}.tracker.models"

    @property
    def assign_request(self) -> str:
        """Request/reply: AssignmentRequest -> AssignmentReply (a joining node's layer range, held as a lease);
        trackers serve it in queue group ``tracker``."""
        return f"{self.namespace}.tracker.assign"

    @property
    def repair_request(self) -> str:
        """Request/reply: RepairRequest -> RouteReply (a head replacing a lost hop of its route, issue #18);
        trackers serve it in queue group ``tracker``."""
        return f"{self.namespace}.tracker.repair"

    @property
    def spot_checker_request(self) -> str:
        """Request/reply: CheckerRequest -> CheckerReply (a node asking who recomputes a receipt of its layers, or a
        checker asking for a referee, issue #28); trackers serve it in queue group ``tracker``."""
        return f"{self.namespace}.tracker.spot"

    @property
    def dispute_request(self) -> str:
        """Request/reply: Dispute -> DisputeReply (a checker reporting a disagreement its referee settled, issue
        #28); trackers serve it in queue group ``tracker`` and evict the node found wrong."""
        return f"{self.namespace}.tracker.dispute"

    def evictions(self, node_id: str = "*") -> str:
        """Eviction notes of one node (``*`` for all): an Eviction with its evidence when the trackers evict it,
        one with ``cleared`` when its operator clears it (issue #28)."""
        return f"{self.namespace}.evictions.{_wild_or(node_id, 'node id')}"

    @property
    def eviction_bucket(self) -> str:
        """JetStream KV bucket of Eviction keyed by node id, without TTL: a node stays evicted until its operator
        clears it (``swarmroute evictions clear <node-id>``)."""
        return f"{self.namespace}_evictions"

    @property
    def lease_bucket(self) -> str:
        """JetStream KV bucket of RangeLease keyed ``<model_id>.<start>-<end>.<slot>``; entries expire when their
        node stops renewing them (same TTL as the registry)."""
        return f"{self.namespace}_leases"

    @property
    def registry_bucket(self) -> str:
        """JetStream KV bucket of NodeAdvertisement keyed by node id; entries expire when heartbeats stop."""
        return f"{self.namespace}_nodes"

    def registry_key_subject(self, node_id: str = "*") -> str:
        """The subject a KV put lands on: subscribe to it to watch node health without JetStream."""
        return f"$KV.{self.registry_bucket}.{_wild_or(node_id, 'node id')}"

    def telemetry(self, session_id: str = "*") -> str:
        """GenerationTelemetry snapshots of one session (``*`` for all)."""
        return f"{self.namespace}.telemetry.{_wild_or(session_id, 'session id')}"

    @property
    def telemetry_all(self) -> str:
        return f"{self.namespace}.telemetry.>"

    def gateway_queue(self, gateway: str = "*") -> str:
        """QueueStats of one gateway's admission queue (issue #30), every second while requests wait."""
        return f"{self.namespace}.gateway.queue.{_wild_or(gateway, 'gateway name')}"

    def tokens(self, session_id: str) -> str:
        """TokenEvent then one SessionEnd, published by the session's head for the gateway."""
        return f"{self.namespace}.tokens.{_wild_or(session_id, 'session id')}"

    def client(self, session_id: str) -> str:
        """Request/reply: empty -> empty. The session's head asks whether its client still listens; the gateway's
        per-session subscription (``session_events``) answers. NATS "no responders" means the client is gone."""
        return f"{self.namespace}.client.{_check_token(session_id, 'session id')}"

    def session_events(self, session_id: str) -> str:
        """Matches ``tokens.<id>`` and ``telemetry.<id>`` (and ``client.<id>``): one subscription keeps their
        relative order."""
        return f"{self.namespace}.*.{_check_token(session_id, 'session id')}"

    def node_events(self, node_id: str = "*") -> str:
        """Node lifecycle notes (started, stopping) for operators' tools."""
        return f"{self.namespace}.node.{_wild_or(node_id, 'node id')}.events"

    def node_info(self, node_id: str = "*") -> str:
        """Request/reply (micro endpoint ``info``): empty -> the node's advertisement as JSON."""
        return f"{self.namespace}.node.{_wild_or(node_id, 'node id')}.info"

    def artifact_progress(self, node_id: str = "*") -> str:
        """Artifact fetch progress of one node."""
        return f"{self.namespace}.artifacts.progress.{_wild_or(node_id, 'node id')}"

    def artifact_peers(self, model_id: str = "*") -> str:
        """Seeders announce themselves here (torrent peer address) for a model artifact."""
        return f"{self.namespace}.artifacts.peers.{_wild_or(model_id, 'model id')}"

    def artifact_peer_query(self, model_id: str) -> str:
        """Request/reply: who seeds this artifact? Every seeder answers with its peer address."""
        return f"{self.namespace}.artifacts.who.{_check_token(model_id, 'model id')}"

    def artifact_manifest(self, model_id: str) -> str:
        """Request/reply: the manifest JSON (zlib) of a model artifact, answered by every node that holds it."""
        return f"{self.namespace}.artifacts.manifest.{_check_token(model_id, 'model id')}"


def _wild_or(value: str, what: str) -> str:
    return value if value in ("*", ">") else _check_token(value, what)
