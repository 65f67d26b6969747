"""What a node's sessions share: the backend engine, the HTTP client to other nodes, NATS publishing, settings,
metrics and the loop poller."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from pydantic import BaseModel

from actors.node.engine import StepEngine
from actors.node.metrics import NodeMetrics
from actors.node.speculation.drafts import DraftSource, NgramDraft
from actors.node.spin import LoopPoller
from actors.node.spot_receipt import SpotRecorder
from bus.nats_edge import error_reply
from bus.nodeclient import NodeClient
from bus.subjects import Subjects
from schemas.errors import BadRequestError, NoRouteError
from schemas.frame import WireDType
from schemas.route import RepairRequest, RouteReply
from schemas.session import SessionOpen
from schemas.settings import Settings

PublishModel = Callable[[str, BaseModel], Awaitable[None]]
AskRepair = Callable[[RepairRequest], Awaitable[RouteReply]]
"""A head asks the trackers to replace a lost hop of its route (issue #18)."""
ClientProbe = Callable[[str], Awaitable[bool | None]]
"""A session id -> whether its client listens: True, False (NATS: no responders), None (no answer: unknown)."""


async def _always_there(session_id: str) -> bool | None:
    return None


def _ngram_only(session_id: str, source: str) -> DraftSource:
    if source != "ngram":
        raise BadRequestError(f"this node has no {source!r} draft source (set SWARMROUTE_DRAFT_MODEL on the head)")
    return NgramDraft()


def _no_spot_checks(request: SessionOpen, reused: int) -> SpotRecorder | None:
    return None


async def _no_tracker(request: RepairRequest) -> RouteReply:
    return error_reply(RouteReply, NoRouteError("this node cannot reach a tracker"))


@dataclasses.dataclass
class NodeRuntime:
    node_id: str
    engine: StepEngine
    client: NodeClient
    publish: PublishModel
    """Publish a wire model on a NATS subject (msgpack)."""
    subjects: Subjects
    settings: Settings
    wire_dtype: WireDType = WireDType.F32
    metrics: NodeMetrics = dataclasses.field(default_factory=NodeMetrics)
    """Prometheus series of this node (actors.node.metrics)."""
    poller: LoopPoller = dataclasses.field(default_factory=LoopPoller)
    """Keeps the node's loop polling while a decoding session waits for its next message (actors.node.spin)."""
    client_present: ClientProbe = _always_there
    """Asks a head session's client whether it still listens (``Settings.client_probe_s``)."""
    ask_repair: AskRepair = _no_tracker
    """Asks the trackers to replace a lost hop (``Settings.repair``)."""
    drafts: Callable[[str, str], DraftSource] = _ngram_only
    """(session id, source name) -> the draft source of a speculative session this node heads (issue #20)."""
    manifest_id: str = ""
    """The artifact manifest this node's shard was verified against (snapshot segments name it)."""
    spot_recorder: Callable[[SessionOpen, int], SpotRecorder | None] = _no_spot_checks
    """(a session's open, the positions it reused) -> its spot-check receipt when it is sampled (issue #28)."""
