"""The swarmroute command line as a user runs it: real child processes, the official client, real signals."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import sys
from pathlib import Path

import openai
import pytest

from schemas.settings import Settings
from tests.support.actors import Children, descendants, still_alive
from tests.support.swarm import Swarms, stub
from tests.support.up import Up, free_port
from tests.support.waiting import eventually_sync

MODEL = "stub-model"


@pytest.fixture
def up(tmp_path: Path, children: Children) -> Up:
    return children.add(Up("--backend", "stub", "--port", str(free_port()), "--home", str(tmp_path / "home")))


def test_up_serves_chat_and_sigint_stops_every_child(up: Up) -> None:
    assert up.banner.wait(90), up.output
    assert up.proc.poll() is None, up.output
    out = up.output
    assert "swarmroute is up: stub backend" in out
    url = re.search(r"gateway\s+(http://\S+)/v1", out)
    assert url is not None, out
    assert re.search(r"NATS\s+nats://127\.0\.0\.1:\d+", out)
    assert "node-1[0,4) -> node-2[4,8)" in out

    client = openai.OpenAI(base_url=url.group(1) + "/v1", api_key="none", max_retries=0, timeout=30)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}],
                                           max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content and reply.choices[0].finish_reason == "length"
    assert [h["node_id"] for h in reply.model_extra["swarmroute"]["route"]] == ["node-1", "node-2"]  # type: ignore[index]

    children = descendants(up.proc.pid)
    # nats-server, tracker, two nodes, gateway
    assert len(children) >= 5, children
    # SIGINT to the launcher alone (a terminal's Ctrl-C would reach the children too): it must stop them itself.
    os.kill(up.proc.pid, signal.SIGINT)
    assert up.proc.wait(30) == 0, up.output
    eventually_sync(lambda: not still_alive(children), timeout=10, interval=0.1,
                    what=lambda: f"every child exiting (alive: {still_alive(children)})")
    with socket.socket() as s:  # nobody listens on the gateway's port any more (TIME_WAIT aside)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", int(url.group(1).rsplit(":", 1)[1])))


async def test_watch_once_lists_the_nodes(settings: Settings, swarms: Swarms) -> None:
    swarm = await swarms.start(settings, [stub(0, 5), stub(5, 8)], model_id=MODEL)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "swarmroute", "watch", "--once", "--nats", settings.nats_url, "--namespace",
        settings.namespace, "--log-level", "warning", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, stderr.decode()
    rows = {line.split()[0]: line for line in stdout.decode().splitlines() if line.strip()}
    assert "NODE" in rows
    for node, layers in zip(swarm.nodes, ("[0, 5)", "[5, 8)"), strict=True):
        row = rows[node.config.node_id]
        assert MODEL in row and layers in row and node.endpoint in row


def test_up_survives_a_burst_of_stop_signals(up: Up) -> None:
    """Ctrl-C pressed repeatedly, or INT then TERM from a process manager: the launcher still stops everything."""
    assert up.banner.wait(90), up.output
    children = descendants(up.proc.pid)
    for signum in [signal.SIGINT] * 200 + [signal.SIGTERM] * 50:
        with contextlib.suppress(ProcessLookupError):
            os.kill(up.proc.pid, signum)
    assert up.proc.wait(30) == 0, up.output
    eventually_sync(lambda: not still_alive(children), timeout=10, interval=0.1,
                    what=lambda: f"every child exiting (alive: {still_alive(children)})")
