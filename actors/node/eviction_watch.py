"""What a node does when the trackers evict a node (issue #28, ``Subjects.evictions``): the sessions it heads whose
route goes through the evicted node are repaired around it (the existing repair path, as if the node were lost,
never from its snapshots), and its metrics name the node with the evidence until the eviction is cleared. A node
that finds itself evicted says so in its log: the trackers no longer route to it, and it rejoins only when its
operator clears it (``swarmroute evictions clear``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from nats.aio.msg import Msg

from actors.node.head_session import HeadSession
from actors.node.metrics import NodeMetrics
from actors.node.session import NodeSession
from bus import codec
from schemas.session import FailureReason
from schemas.spot_check import Eviction

log = logging.getLogger(__name__)


class EvictionWatch:
    def __init__(self, node_id: str, sessions: Mapping[str, NodeSession], metrics: NodeMetrics,
                 on_cleared: Callable[[int], None] = lambda clearance: None) -> None:
        self.node_id = node_id
        self._on_cleared = on_cleared
        """Called with this node's clearance generation when its operator clears it."""
        self._sessions = sessions
        self._metrics = metrics
        self._labels: dict[str, tuple[str, ...]] = {}

    async def on_message(self, msg: Msg) -> None:
        try:
            eviction = codec.decode(msg.data, Eviction)
        except codec.DecodeError as exc:
            log.warning("ignoring a bad eviction note on %s: %s", msg.subject, exc)
            return
        self.apply(eviction)

    def apply(self, eviction: Eviction) -> int:
        """Returns how many of this node's head sessions are repaired around the evicted node."""
        node = eviction.node_id
        if eviction.cleared:
            labels = self._labels.pop(node, None)
            if labels is not None:
                self._metrics.evicted.remove(*labels)
            if node == self.node_id:
                log.warning("this node's eviction was cleared by its operator: the trackers route to it again")
                self._on_cleared(eviction.clearance)
            return 0
        evidence = eviction.checker
        layers = str(eviction.layers)
        labels = (node, layers, "", "", "") if evidence is None else \
            (node, layers, evidence.rule, f"{evidence.median_rel_err:.4g}", f"{evidence.median_top_k:.3f}")
        old = self._labels.get(node)
        if old is not None and old != labels:
            self._metrics.evicted.remove(*old)
        self._labels[node] = labels
        self._metrics.evicted.labels(*labels).set(1)
        if node == self.node_id:
            log.error("this node was EVICTED by the trackers for computing wrong: %s. It is no longer routed to "
                      "until its operator runs `swarmroute evictions clear %s`", eviction.reason, node)
            return 0
        repaired = 0
        for session in list(self._sessions.values()):
            if isinstance(session, HeadSession) and not session.closed and \
                    any(h.node_id == node for h in session.route.hops[1:]):
                session.on_failure_report(FailureReason(
                    node_id=node, phase=session.phase, kind="unreachable", evicted=True,
                    message=f"node {node} was evicted for computing wrong: {eviction.reason}"))
                repaired += 1
        if repaired:
            log.warning("repairing %d session(s) around evicted node %s", repaired, node)
        return repaired
