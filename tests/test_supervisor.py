"""The supervisor of ``up`` and ``fleet up`` with real child processes: named deaths, restarts, giving up."""

from __future__ import annotations

import io
import sys
import time

from swarmroute.supervisor import ChildSpec, RestartPolicy, Supervisor
from tests.support.waiting import eventually_sync

FAST = RestartPolicy(max_restarts=2, window_s=60, first_backoff_s=0.1, max_backoff_s=0.2)


def _python(code: str) -> list[str]:
    return [sys.executable, "-u", "-c", code]


DIES = _python("import os, signal, time; print('loaded the shard'); print('about to decode'); "
               "time.sleep(0.2); os.kill(os.getpid(), signal.SIGSEGV)")
LIVES = _python("import time; print('serving'); time.sleep(60)")


def _until(supervisor: Supervisor, out: io.StringIO, text: str, timeout: float = 20) -> bool:
    """Run the supervisor's watch loop until ``text`` appears; returns what the last check said."""
    said = [True]

    def check_then_sleep(interval: float) -> None:
        said.append(supervisor.check())
        time.sleep(interval)

    eventually_sync(lambda: text in out.getvalue(), timeout=timeout, sleep=check_then_sleep,
                    what=lambda: f"{text!r} in the supervisor's report:\n{out.getvalue()}")
    return said[-1]


def test_a_child_dying_after_start_up_is_named_restarted_and_given_up_on() -> None:
    out = io.StringIO()
    supervisor = Supervisor([ChildSpec("node-1", DIES), ChildSpec("gateway", LIVES, essential=True)], policy=FAST,
                            out=out)
    supervisor.start()
    supervisor.ready = True
    try:
        assert _until(supervisor, out, "killed by signal 11 (SIGSEGV)")
        report = out.getvalue()
        assert "swarmroute: node-1 (pid " in report and ") killed by signal 11 (SIGSEGV); its last lines:" in report
        assert "    loaded the shard\n    about to decode" in report
        assert "[node-1] about to decode" in report  # relayed live, named
        assert _until(supervisor, out, "restarting node-1 (restart 1)")
        assert _until(supervisor, out, "giving up on node-1 after 3 deaths")
        assert "the swarm goes on without it" in out.getvalue()
        assert supervisor.check() and supervisor.failed is None  # a node is not essential: the swarm goes on
        assert supervisor.children[1].running()
    finally:
        supervisor.stop()
    assert not any(c.running() for c in supervisor.children)


def test_giving_up_on_an_essential_child_stops_the_swarm() -> None:
    out = io.StringIO()
    supervisor = Supervisor([ChildSpec("gateway", DIES, essential=True)], policy=FAST, out=out)
    supervisor.start()
    supervisor.ready = True
    try:
        assert not _until(supervisor, out, "giving up on gateway; stopping the swarm")
        assert supervisor.failed == "gateway died 3 times within 60s"
    finally:
        supervisor.stop()


def test_a_child_dying_during_start_up_is_fatal_and_named() -> None:
    out = io.StringIO()
    supervisor = Supervisor([ChildSpec("node-2", _python("import sys; print('no model'); sys.exit(3)")),
                             ChildSpec("tracker", LIVES)], policy=FAST, out=out)
    supervisor.start()
    try:
        eventually_sync(lambda: not supervisor.check(), timeout=20,
                        what=lambda: f"the supervisor giving up:\n{out.getvalue()}")
        assert supervisor.failed == "node-2 exited during start-up"
        report = out.getvalue()
        assert "node-2 (pid " in report and "exited with status 3; its last lines:\n    no model" in report
    finally:
        supervisor.stop()
    assert not supervisor.children[1].running()


def test_stop_is_safe_twice_and_stops_pending_restarts() -> None:
    out = io.StringIO()
    supervisor = Supervisor([ChildSpec("node-1", DIES)], policy=FAST, out=out)
    supervisor.start()
    supervisor.ready = True
    _until(supervisor, out, "will be restarted in")
    supervisor.stop()
    supervisor.stop()
    time.sleep(0.3)
    assert supervisor.check()
    assert "restarting node-1" not in out.getvalue()
