"""The child processes of ``swarmroute up`` and ``fleet up``: started, watched, named when they die, restarted.

Every child's output goes through this process, each line prefixed with the child's name, and its last lines are
kept: when a child exits unexpectedly the supervisor prints its name, its exit status or signal and what it wrote
last. Before the swarm is ready, such an exit is fatal (a node that cannot start will not start on a retry). After
that, a dead child is restarted with a growing back-off, so the swarm keeps serving with what is left meanwhile (a
route that needs a dead node's layers is refused with a 503 naming them); a child that keeps dying is given up on,
and if it was essential (NATS, tracker, gateway) the whole swarm stops. Ctrl-C (SIGINT) or SIGTERM stops everything.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO

from actors.selfcheck import describe_exit
from bus.server import EmbeddedNats, wait_port_free

__all__ = ["ChildSpec", "RestartPolicy", "StopRequest", "Supervisor", "on_stop_signal", "run_supervised"]

_TAIL_LINES = 20
_STOP_GRACE_S = 10.0


class StopRequest:
    """Set by SIGINT or SIGTERM, read by a supervisor loop that stops its children in order.

    Not a ``threading.Event``: its ``set`` takes a lock, and a second signal landing while the handler of the first
    holds it (Ctrl-C twice, or INT then TERM from a process manager) deadlocked the process for good."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


def on_stop_signal() -> StopRequest:
    stop = StopRequest()
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    return stop


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """How hard the supervisor tries to keep a child running once the swarm was ready."""

    max_restarts: int = 5
    """Restarts allowed within ``window_s``; one more and the child is given up on."""

    window_s: float = 300.0

    first_backoff_s: float = 1.0
    """Wait before the first restart; doubled for each further restart inside the window."""

    max_backoff_s: float = 30.0


@dataclasses.dataclass(frozen=True)
class ChildSpec:
    name: str
    """How the child is named in every message (``node-1``, ``gateway``)."""

    argv: list[str]

    essential: bool = False
    """Without it nothing can be served: giving up on it stops the swarm."""

    env: dict[str, str] = dataclasses.field(default_factory=dict)
    """Added to the supervisor's environment for this child."""


class _Child:
    def __init__(self, spec: ChildSpec, out: IO[str] | None) -> None:
        self.spec = spec
        self._out = out
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts: list[float] = []
        self.restart_at: float | None = None
        self.given_up = False

    def start(self) -> None:
        self.proc = subprocess.Popen(self.spec.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env={**os.environ, **self.spec.env})
        threading.Thread(target=self._relay, args=(self.proc,), name=f"relay-{self.spec.name}", daemon=True).start()

    def _relay(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.tail.append(line)
            print(f"[{self.spec.name}] {line}", file=self._out or sys.stdout, flush=True)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_report(self) -> str:
        assert self.proc is not None and self.proc.returncode is not None
        time.sleep(0.1)  # let the relay thread take the last lines the child wrote
        lines = "\n".join(f"    {line}" for line in self.tail) or "    (nothing)"
        return (f"swarmroute: {self.spec.name} (pid {self.proc.pid}) {describe_exit(self.proc.returncode)}; "
                f"its last lines:\n{lines}")


class Supervisor:
    """Starts children, watches them, restarts them; ``stop()`` is safe to call twice."""

    def __init__(self, specs: list[ChildSpec], *, policy: RestartPolicy | None = None, out: IO[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``out``: where children's lines and the supervisor's reports go (default: stdout and stderr)."""
        self._out = out
        self.children = [_Child(spec, out) for spec in specs]
        self.policy = policy or RestartPolicy()
        self._clock = clock
        self.ready = False
        self.failed: str | None = None
        """Why the swarm cannot go on (an essential child given up on, or a child dead during start-up)."""

    @property
    def processes(self) -> list[subprocess.Popen[bytes]]:
        return [c.proc for c in self.children if c.proc is not None]

    def start(self) -> None:
        for child in self.children:
            child.start()

    def _say(self, message: str) -> None:
        print(message, file=self._out or sys.stderr, flush=True)

    def check(self) -> bool:
        """One round of watching: report and schedule restarts of dead children, restart those whose back-off
        ended. False once the swarm cannot go on (``failed`` says why)."""
        now = self._clock()
        for child in self.children:
            if child.given_up or child.running():
                continue
            if child.restart_at is None:
                self._say(child.exit_report())
                if not self.ready:
                    self.failed = f"{child.spec.name} exited during start-up"
                    return False
                self._schedule_restart(child, now)
            elif now >= child.restart_at:
                child.restart_at = None
                child.restarts.append(now)
                self._say(f"swarmroute: restarting {child.spec.name} (restart {len(child.restarts)})")
                child.start()
            if self.failed:
                return False
        return True

    def _schedule_restart(self, child: _Child, now: float) -> None:
        p = self.policy
        child.restarts = [t for t in child.restarts if now - t < p.window_s]
        if len(child.restarts) >= p.max_restarts:
            child.given_up = True
            if child.spec.essential:
                self.failed = f"{child.spec.name} died {len(child.restarts) + 1} times within {p.window_s:g}s"
                self._say(f"swarmroute: giving up on {child.spec.name}; stopping the swarm")
            else:
                self._say(f"swarmroute: giving up on {child.spec.name} after {len(child.restarts) + 1} deaths "
                          f"within {p.window_s:g}s; the swarm goes on without it")
            return
        backoff = min(p.max_backoff_s, p.first_backoff_s * 2 ** len(child.restarts))
        child.restart_at = now + backoff
        what = "the swarm keeps serving with what is left" if not child.spec.essential else "requests wait"
        self._say(f"swarmroute: {child.spec.name} will be restarted in {backoff:g}s; {what}")

    def stop(self) -> None:
        procs = [c.proc for c in self.children if c.proc is not None and c.proc.poll() is None]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for child in self.children:
            child.restart_at = None
            child.given_up = True


def run_supervised(name: str, specs: list[ChildSpec], ready: Callable[[Supervisor], str], *,
                   nats: EmbeddedNats | None = None) -> int:
    """The one launcher of ``up``, ``up --from-swarm`` and ``fleet up``: start the children, wait with ``ready`` (it
    raises ``RuntimeError`` when the swarm cannot become ready, else returns the banner to print), then watch them
    (restarting the embedded NATS server and dead children) until Ctrl-C or SIGTERM; everything is stopped on the
    way out. Exit status 0 on a requested stop, 1 when the swarm could not start or go on."""
    supervisor = Supervisor(specs)
    stop_requested = on_stop_signal()
    try:
        supervisor.start()
        try:
            banner = ready(supervisor)
        except RuntimeError as exc:
            print(f"swarmroute {name}: {exc}; stopping", file=sys.stderr, flush=True)
            return 1
        supervisor.ready = True
        print(banner, flush=True)
        while not stop_requested.is_set():
            if nats is not None and not nats.running:
                _restart_nats(nats)
            if not supervisor.check():
                print(f"swarmroute {name}: {supervisor.failed}; stopping", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.3)
        return 0
    finally:
        supervisor.stop()
        if nats is not None:
            nats.stop()


def _restart_nats(nats: EmbeddedNats) -> None:
    """The embedded NATS server died: say so and start it again on the same port (its JetStream state is on disk);
    every actor reconnects by itself."""
    print(f"swarmroute: the embedded NATS server {describe_exit(nats.returncode or 0)}; restarting it on "
          f"{nats.url}; its last lines:\n" + "\n".join(f"    {line}" for line in nats.log_tail(10)),
          file=sys.stderr, flush=True)
    nats.stop()
    nats.config.port = nats.port
    wait_port_free(nats.host, nats.port)
    nats.start()
