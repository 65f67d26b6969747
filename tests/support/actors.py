"""Any swarmroute actor (tracker, gateway, node) as a real child process configured like the test's Settings, so a
chaos test can SIGKILL it, restart it, and check that nothing it started outlives it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from pydantic import SecretStr

from schemas.settings import Settings

_READY = {"tracker": r"tracker ready on", "gateway": r"gateway ready at (\S+)", "node": r"ready at (\S+)"}


def settings_env(settings: Settings) -> dict[str, str]:
    """``settings`` as SWARMROUTE_* variables: a child's own Settings() then equals the test's."""
    env: dict[str, str] = {}
    for name, value in settings:
        if value is None:
            continue
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        elif isinstance(value, list):
            value = json.dumps([v.get_secret_value() if isinstance(v, SecretStr) else v for v in value])
        elif isinstance(value, Path):
            value = str(value)
        env[f"SWARMROUTE_{name.upper()}"] = str(value)
    return env


class ActorProcess:
    """``python -m swarmroute <role> ...``; ``url`` is the gateway's or node's base URL once ready."""

    def __init__(self, role: str, settings: Settings, args: list[str], *, ready_timeout: float = 60.0,
                 prefix: Sequence[str] = (), log_level: str = "info") -> None:
        """``prefix`` goes before the interpreter (e.g. ``ip netns exec HOST``)."""
        self.role = role
        env = {**os.environ, **settings_env(settings), "PYTHONUNBUFFERED": "1"}
        argv = [*prefix, sys.executable, "-m", "swarmroute", role, "--log-level", log_level, *args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.output: list[str] = []
        self.url: str | None = None
        ready = threading.Event()
        pattern = re.compile(_READY[role])

        def read() -> None:
            assert self.proc.stdout is not None
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace").rstrip()
                self.output.append(line)
                m = pattern.search(line)
                if m and not ready.is_set():
                    self.url = m.group(1) if m.groups() else None
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(ready_timeout) or self.proc.poll() is not None:
            self.kill()
            raise RuntimeError(f"{role} did not start:\n" + "\n".join(self.output[-30:]))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: gone without a goodbye (no registry delete, no session close)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def orphans(pids: list[int]) -> list[int]:
    """Of the given process ids, those still alive (zombies excluded), plus any live process whose parent is one."""
    alive: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]  # after "pid (comm)": state, ppid, ...
        if state != "Z" and (int(entry.name) in pids or int(ppid) in pids):
            alive.append(int(entry.name))
    return alive
