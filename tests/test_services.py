"""$SRV discovery: trackers, nodes and gateways answer the NATS micro protocol, as `nats service ls` expects.

Everything here speaks plain nats-py to a real nats-server, as a third-party tool would: one request on
``$SRV.PING``, every reply collected.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus import codec
from bus.subjects import Subjects
from schemas.route import RouteReply, RouteRequest
from schemas.settings import Settings
from tests.support.swarm import Swarms, stub
from tests.support.waiting import eventually


async def _collect(nc: NATS, subject: str, expected: int, wait_s: float = 0.5) -> list[dict[str, Any]]:
    """The replies to one request on ``subject``: the ``expected`` ones, however long a loaded machine takes, and
    whatever else arrives within ``wait_s`` after them."""
    replies: list[dict[str, Any]] = []
    inbox = nc.new_inbox()

    async def on_reply(msg: Msg) -> None:
        if msg.data:
            replies.append(json.loads(msg.data))

    sub = await nc.subscribe(inbox, cb=on_reply)
    await nc.publish(subject, b"", reply=inbox)
    await eventually(lambda: len(replies) >= expected, what=lambda: f"{expected} replies on {subject} ({replies})")
    await asyncio.sleep(wait_s)
    await sub.unsubscribe()
    return replies


async def test_srv_ping_lists_tracker_nodes_and_gateway(settings: Settings, nc: NATS, swarms: Swarms) -> None:
    swarm = await swarms.start(settings, [stub(0, 4), stub(4, 8)], model_id="stub-model")
    pings = await _collect(nc, "$SRV.PING", 4)
    members = sorted((p["name"], p["metadata"]["member"]) for p in pings)
    assert members == [("swarmroute-gateway", "gateway"), ("swarmroute-node", "n1"), ("swarmroute-node", "n2"),
                       ("swarmroute-tracker", "tracker")]
    assert all(p["type"] == "io.nats.micro.v1.ping_response" and p["version"] for p in pings)
    nodes = {p["metadata"]["node_id"]: p["metadata"] for p in pings if p["name"] == "swarmroute-node"}
    assert nodes["n1"]["layers"] == "0:4" and nodes["n2"]["layers"] == "4:8"
    assert nodes["n2"]["endpoint"] == swarm.nodes[1].endpoint
    gateway = next(p for p in pings if p["name"] == "swarmroute-gateway")
    assert gateway["metadata"]["url"] == swarm.gateway.url

    subjects = Subjects(settings.namespace)
    [info] = await _collect(nc, "$SRV.INFO.swarmroute-tracker", 1)
    endpoints = {e["name"]: e for e in info["endpoints"]}
    assert endpoints["route"]["subject"] == subjects.route_request
    assert endpoints["route"]["queue_group"] == "tracker"  # replicas still share route requests
    assert endpoints["models"]["subject"] == subjects.models_request

    # the route endpoint is the real one: a route request counts in the tracker's $SRV.STATS
    request = RouteRequest(model="stub-model", session_id="s" * 32)
    reply = codec.decode((await nc.request(subjects.route_request, codec.encode(request), timeout=2)).data,
                         RouteReply)
    assert reply.route is not None and [h.node_id for h in reply.route.hops] == ["n1", "n2"]
    [stats] = await _collect(nc, "$SRV.STATS.swarmroute-tracker", 1)
    route_stats = next(e for e in stats["endpoints"] if e["name"] == "route")
    assert route_stats["num_requests"] == 1 and route_stats["num_errors"] == 0

    # a node's info endpoint answers with its advertisement
    advert = json.loads((await nc.request(subjects.node_info("n2"), b"", timeout=2)).data)
    assert advert["node_id"] == "n2" and advert["layers"] == {"schema_version": 1, "start": 4, "end": 8}

    await swarm.nodes[1].stop()
    after = await _collect(nc, "$SRV.PING.swarmroute-node", 1)
    assert [p["metadata"]["member"] for p in after] == ["n1"]  # a stopped node leaves discovery at once
