"""The swarmroute command line as a user runs it: real child processes, the official client, real signals."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from actors.backends.stub import StubBackend, StubConfig
from schemas.settings import Settings
from tests.support.swarm import start_swarm

MODEL = "stub-model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) from /proc, or None once the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[1]), fields[0], int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every live process below ``root``, with its start time (so a recycled pid is not mistaken for it)."""
    parents: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _stat(int(entry))
            if info is not None:
                parents.setdefault(info[0], []).append(int(entry))
                starts[int(entry)] = info[2]
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            found[child] = starts[child]
            todo.append(child)
    return found


def alive(pid: int, started: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    info = _stat(pid)
    return info is not None and info[2] == started and info[1] != "Z"


class Up:
    """``python -m swarmroute up`` in its own process group, its output collected by a thread."""

    def __init__(self, home: Path, port: int, *extra: str) -> None:
        argv = [sys.executable, "-m", "swarmroute", "up", "--backend", "stub", "--port", str(port), "--home", str(home),
                *extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        self.lines: list[str] = []
        self.banner = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.lines.append(line)
            if line.startswith("Ctrl-C stops everything"):
                self.banner.set()
        self.banner.set()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def kill_all(self) -> None:
        for pid in descendants(self.proc.pid):
            with_suppress_kill(pid)
        with_suppress_kill(self.proc.pid)
        self.proc.wait(10)


def with_suppress_kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    port = free_port()
    proc = Up(tmp_path / "home", port)
    yield proc
    if proc.proc.poll() is None:
        proc.kill_all()


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
    deadline = time.monotonic() + 10
    while any(alive(pid, started) for pid, started in children.items()):
        assert time.monotonic() < deadline, [pid for pid, s in children.items() if alive(pid, s)]
        time.sleep(0.1)
    with socket.socket() as s:  # nobody listens on the gateway's port any more (TIME_WAIT aside)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", int(url.group(1).rsplit(":", 1)[1])))


async def test_watch_once_lists_the_nodes(settings: Settings) -> None:
    backends = [StubBackend(StubConfig(model=MODEL, n_layers=8, layer_start=a, layer_end=b))
                for a, b in ((0, 5), (5, 8))]
    swarm = await start_swarm(settings, backends, model_id=MODEL)
    try:
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
    finally:
        await swarm.stop()


def test_up_survives_a_burst_of_stop_signals(up: Up) -> None:
    """Ctrl-C pressed repeatedly, or INT then TERM from a process manager: the launcher still stops everything."""
    assert up.banner.wait(90), up.output
    children = descendants(up.proc.pid)
    for signum in [signal.SIGINT] * 200 + [signal.SIGTERM] * 50:
        with contextlib.suppress(ProcessLookupError):
            os.kill(up.proc.pid, signum)
    assert up.proc.wait(30) == 0, up.output
    deadline = time.monotonic() + 10
    while any(alive(pid, started) for pid, started in children.items()):
        assert time.monotonic() < deadline, [pid for pid, s in children.items() if alive(pid, s)]
        time.sleep(0.1)
