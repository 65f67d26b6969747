"""``python -m swarmroute up`` as a user runs it: its own process group, its output collected by a thread, and the
process tree below it (to find a child by role, and to prove none is left)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path


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


def still_alive(children: dict[int, int]) -> list[int]:
    """Those of ``children`` (pids with their start times, from ``descendants``) still running."""
    return [pid for pid, started in children.items() if alive(pid, started)]


class Up:
    """``python -m swarmroute up`` in its own process group, its output collected by a thread. ``argv`` follows
    ``up``; ``env`` is added to the environment (``SWARMROUTE_*`` settings)."""

    def __init__(self, *argv: str, env: dict[str, str] | None = None,
                 env_replace: dict[str, str] | None = None) -> None:
        """``env`` is added to this process's environment; ``env_replace`` replaces it."""
        self.argv = [sys.executable, "-m", "swarmroute", "up", *argv]
        base = dict(os.environ) if env_replace is None else env_replace
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env={**base, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)
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

    def gateway_url(self) -> str:
        found = re.search(r"gateway\s+(http://\S+)/v1", self.output)
        assert found is not None, self.output
        return found.group(1)

    def child(self, *words: str) -> int:
        """The pid of the live child whose command line holds every word (e.g. ``"node", "node-1"``)."""
        for pid in descendants(self.proc.pid):
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
                if "swarmroute" in argv and all(w in argv for w in words):
                    return pid
        raise AssertionError(f"no child with {words} below {self.proc.pid}:\n{self.output}")

    def stop(self, timeout: float = 60) -> int:
        """Ctrl-C, as a user stops it; SIGKILL for the whole tree if it does not stop in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill_all()
        return self.proc.returncode

    def kill_all(self) -> None:
        for pid in descendants(self.proc.pid):
            with_suppress_kill(pid)
        with_suppress_kill(self.proc.pid)
        self.proc.wait(10)


def with_suppress_kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)

