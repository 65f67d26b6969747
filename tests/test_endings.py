"""A head remembers the sessions it ended (``actors.node.endings``): a liveness probe of one in the window between
the head freeing it and its ``SessionEnd`` reaching the gateway hears "ended", and the gateway does not fail a
stream that completed (issue #30: under load, completed streams were reported "answers but no longer holds the
session").

The window is held open by the route itself: the tail sits behind a proxy that delays every byte by more than the
head waits for a hop's ``DELETE`` (1 s), so the head publishes the end about a second after it freed the session,
twice the gateway's grace (``gateway.live_session.LOST_GRACE_S``), while the gateway probes the head every 50 ms of
silence. Real nats-server, tracker, stub nodes, gateway and the official client.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai

from actors.node.endings import Endings
from bus.nodeclient import NodeClient
from gateway.live_session import LOST_GRACE_S
from schemas.session import SessionPhase
from tests.support.swarm import Swarms, make_settings, stub

MODEL = "stub-model"
TAIL_DELAY_S = 1.2
"""One way, per chunk, in front of the tail: longer than the head's 1 s wait for the tail's DELETE."""


def test_the_newest_endings_are_remembered() -> None:
    endings = Endings(remembered=2)
    endings.ended("a", SessionPhase.COMPLETE)
    endings.ended("b", SessionPhase.FAILED)
    endings.ended("c", SessionPhase.COMPLETE)
    assert endings.phase("a") is None and endings.phase("b") is SessionPhase.FAILED
    assert endings.phase("c") is SessionPhase.COMPLETE and endings.phase("never") is None


async def test_a_stream_whose_end_comes_after_the_head_freed_it_completes(nats_server: Any, tmp_path: Path,
                                                                         swarms: Swarms) -> None:
    assert 2 * LOST_GRACE_S <= 1.0  # the window (the head's 1 s DELETE timeout) outlasts the gateway's grace
    settings = make_settings(nats_server.url, tmp_path / "home", liveness_probe_s=0.05, hop_timeout_s=10.0,
                             token_timeout_s=20.0, first_token_timeout_s=30.0)
    swarm = await swarms.start(settings, [stub(0, 4), stub(4, 8)], model_id=MODEL)
    head, tail = swarm.nodes
    proxy = await swarms.proxy(swarm, tail)
    proxy.delay_s = TAIL_DELAY_S
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0, timeout=120)

    stream = await client.completions.create(model=MODEL, prompt="hello", max_tokens=2, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
    chunks = [chunk async for chunk in stream]
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    phases = [((c.model_extra or {}).get("swarmroute") or {}).get("phase") for c in chunks]
    assert len(texts) == 2 and "failed" not in phases, phases
    assert chunks[-1].choices and chunks[-1].choices[0].finish_reason == "length", chunks[-1]

    # What the probe heard from the head once the session was gone there: ended, and how.
    sid = chunks[-1].id.removeprefix("cmpl-")
    assert head.endings.phase(sid) is SessionPhase.COMPLETE
    nodes = NodeClient(timeout_s=5)
    try:
        assert await nodes.session_state("n1", head.endpoint, sid) == "ended"
    finally:
        await nodes.aclose()
    async with httpx.AsyncClient(timeout=5) as http:
        r = await http.get(f"{head.endpoint}/v1/sessions/{sid}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_ended", r.text
        r = await http.get(f"{head.endpoint}/v1/sessions/never-opened")
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found", r.text
    proxy.delay_s = 0.0
    await swarm.freed()
