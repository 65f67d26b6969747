"""Child processes for tests: one ``ChildProcess`` (its own session, its output read line by line by a thread,
``wait_for`` a line, ``stop`` escalating to SIGKILL), the ``Children`` a test started (stopped at teardown by the
``children`` fixture), and ``ActorProcess``: any swarmroute actor (tracker, gateway, node) as a real child process
configured like the test's Settings, so a chaos test can SIGKILL it, restart it, and check that nothing it started
outlives it. The process-tree helpers read /proc."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, TypeVar

from pydantic import SecretStr

from schemas.settings import Settings
from tests.support.waiting import eventually_sync

_READY = {"tracker": r"tracker ready on", "gateway": r"gateway ready at (\S+)", "node": r"ready at (\S+)"}

C = TypeVar("C", bound="ChildProcess")


# ---- process trees (/proc) --------------------------------------------------------------------------------------

def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) from /proc, or None once the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm)": state, ppid, ...
    return int(fields[1]), fields[0], int(fields[19])


def _processes() -> dict[int, tuple[int, str, int]]:
    """Every process on the machine: pid -> (parent pid, state, start time)."""
    found: dict[int, tuple[int, str, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _stat(int(entry))) is not None:
            found[int(entry)] = info
    return found


def descendants(root: int) -> dict[int, int]:
    """Every live process below ``root``, with its start time (so a recycled pid is not mistaken for it)."""
    table = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = table[child][2]
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


def orphans(pids: list[int]) -> list[int]:
    """Of the given process ids, those still alive (zombies excluded), plus any live process whose parent is one."""
    return [pid for pid, (ppid, state, _) in _processes().items()
            if state != "Z" and (pid in pids or ppid in pids)]


# ---- one child process ------------------------------------------------------------------------------------------

class ChildExited(RuntimeError):
    """The child's output ended before the line a test waited for."""


class ChildProcess:
    """``argv`` as a child in its own session (a signal to the test's process group never reaches it; a kill can
    take its whole group), its output read line by line into ``lines`` by a thread (stderr too, unless ``stderr``
    is given). ``env`` is added to this process's environment; ``env_replace`` replaces it."""

    stop_signal: int = signal.SIGTERM
    stop_timeout: float = 10.0

    def __init__(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                 env_replace: Mapping[str, str] | None = None, cwd: Path | None = None,
                 stderr: IO[str] | None = None) -> None:
        self.argv = list(argv)
        base = dict(os.environ) if env_replace is None else dict(env_replace)
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT if stderr is None else stderr,
                                     env={**base, "PYTHONUNBUFFERED": "1", **(env or {})}, cwd=cwd,
                                     start_new_session=True)
        self.lines: list[str] = []
        self._ended = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.lines.append(line)
            self.on_line(line)
        self._ended = True

    def on_line(self, line: str) -> None:
        """Each line as it comes, on the reader thread."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first line matching ``pattern``; ``ChildExited`` if the output ends first, ``AssertionError`` after
        ``timeout`` seconds."""
        regex = re.compile(pattern)
        seen = 0

        def found() -> re.Match[str] | None:
            nonlocal seen
            ended = self._ended  # before reading: every line of an ended output is in by then
            lines = self.lines[seen:]
            seen += len(lines)
            for line in lines:
                if m := regex.search(line):
                    return m
            if ended:
                raise ChildExited(f"{' '.join(self.argv[2:])} exited ({self.proc.poll()}):\n{self.tail()}")
            return None

        return eventually_sync(found, timeout=timeout, interval=0.02,
                               what=lambda: f"a line matching {pattern!r}:\n{self.tail()}")

    def run(self, timeout: float) -> int:
        """Wait for the child to exit (a one-shot command); its exit code, once its output is all read."""
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def kill(self) -> None:
        """SIGKILL: gone without a goodbye (no registry delete, no session close)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def force(self) -> None:
        """What ``stop`` does to a child that outlived its signal: SIGKILL (subclasses take more with it)."""
        self.kill()

    def stop(self, sig: int | None = None, timeout: float | None = None) -> int:
        """``sig`` (``stop_signal``), then ``force`` if it has not exited within ``timeout`` (``stop_timeout``);
        its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal if sig is None else sig)
            try:
                return self.proc.wait(self.stop_timeout if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self.force()
        return self.proc.wait()

    def close(self) -> None:
        """At the end of a test (``Children``): ``stop``."""
        self.stop()


class Children:
    """The child processes one test starts, each closed (``ChildProcess.close``, newest first) when the test ends,
    passed or failed: the ``children`` fixture."""

    def __init__(self) -> None:
        self.started: list[ChildProcess] = []

    def add(self, child: C) -> C:
        self.started.append(child)
        return child

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        errors: list[BaseException] = []
        for child in reversed(self.started):
            try:
                child.close()
            except Exception as exc:  # noqa: BLE001 - every child is closed; the first failure is raised after
                errors.append(exc)
        if errors:
            raise errors[0]


# ---- swarmroute actors ------------------------------------------------------------------------------------------

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


def swarmroute(*args: str) -> list[str]:
    """The command line of ``python -m swarmroute ARGS`` with this interpreter."""
    return [sys.executable, "-m", "swarmroute", *args]


class ActorProcess(ChildProcess):
    """``python -m swarmroute <role> ...``, returned once it reports ready (unless ``wait`` is false: then
    ``ready()`` waits); ``url`` is the base URL the gateway or node reported then (a tracker reports none: "")."""

    def __init__(self, role: str, settings: Settings, args: list[str], *, ready_timeout: float = 60.0,
                 prefix: Sequence[str] = (), log_level: str = "info", name: str | None = None,
                 wait: bool = True) -> None:
        """``prefix`` goes before the interpreter (e.g. ``ip netns exec HOST``); ``name`` is how messages name it
        (default: its role)."""
        self.role = role
        self.name = name or role
        super().__init__([*prefix, *swarmroute(role, "--log-level", log_level, *args)], env=settings_env(settings))
        self.url = ""
        if wait:
            self.ready(ready_timeout)

    def ready(self, timeout: float) -> str:
        """Wait (at most ``timeout``) for its ready line; its URL. If it exits or is not ready by then, it is
        killed and ``RuntimeError`` shows its last lines."""
        try:
            ready = self.wait_for(_READY[self.role], timeout)
        except (ChildExited, AssertionError):
            ready = None
        if ready is None or self.proc.poll() is not None:
            self.kill()
            raise RuntimeError(f"{self.name} did not start:\n" + self.tail(30))
        self.url = ready.group(1) if ready.groups() else ""
        return self.url