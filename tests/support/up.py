"""``python -m swarmroute up`` as a user runs it: its own process group, its output collected by a thread, and the
process tree below it (to find a child by role, and to prove none is left)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import threading
from pathlib import Path

from tests.support.actors import ChildProcess, alive, descendants, still_alive, swarmroute

__all__ = ["Up", "alive", "descendants", "free_port", "still_alive"]  # the process-tree helpers live in actors.py


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Up(ChildProcess):
    """``python -m swarmroute up`` in its own process group, its output collected by a thread. ``argv`` follows
    ``up``; ``env`` is added to the environment (``SWARMROUTE_*`` settings), ``env_replace`` replaces it.
    ``banner`` is set once it prints that it is up (or its output ends)."""

    stop_signal = signal.SIGINT  # Ctrl-C, as a user stops it
    stop_timeout = 60.0

    def __init__(self, *argv: str, env: dict[str, str] | None = None,
                 env_replace: dict[str, str] | None = None) -> None:
        self.banner = threading.Event()
        super().__init__(swarmroute("up", *argv), env=env, env_replace=env_replace)

    def on_line(self, line: str) -> None:
        if line.startswith("Ctrl-C stops everything"):
            self.banner.set()

    def _read(self) -> None:
        super()._read()
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

    def force(self) -> None:
        self.kill_all()

    def kill_all(self) -> None:
        """SIGKILL for it and every process below it."""
        for pid in [*descendants(self.proc.pid), self.proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        """At the end of a test: whatever it left running is killed, with its whole tree."""
        if self.proc.poll() is None:
            self.kill_all()
