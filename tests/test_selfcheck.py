"""A node proves its backend before it advertises: the child's verdict, the warm-up, and the node's exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from actors.backend import StepInput, StepOutput
from actors.backends.stub import StubBackend, StubConfig
from actors.node import Node, NodeConfig
from actors.selfcheck import describe_exit, prove_in_child, warm_up
from schemas.errors import BackendCrashedError
from schemas.settings import Settings


def _child(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_describe_exit_names_signals_and_statuses() -> None:
    assert describe_exit(-11) == "killed by signal 11 (SIGSEGV)"
    assert describe_exit(-4) == "killed by signal 4 (SIGILL)"
    assert describe_exit(3) == "exited with status 3"
    assert describe_exit(-99) == "killed by signal 99 (unknown signal)"


@pytest.mark.parametrize("layers", [(0, 8), (0, 4), (4, 8), (2, 6)])
def test_warm_up_runs_a_prefill_and_a_decode_and_leaves_nothing_open(layers: tuple[int, int]) -> None:
    backend = StubBackend(StubConfig(model="m", n_layers=8, layer_start=layers[0], layer_end=layers[1]))
    warm_up(backend)
    assert backend.open_sessions == []
    assert backend.kv_bytes_in_use() == 0


def test_a_child_killed_by_a_signal_is_named_with_the_signal() -> None:
    with pytest.raises(BackendCrashedError) as caught:
        prove_in_child("llamacpp", {}, python=_child("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"))
    message = caught.value.message
    assert message.startswith("the llama.cpp build on this machine crashes on decode (killed by signal 11 (SIGSEGV))")
    assert "docs/llamacpp-backend.md" in message
    assert caught.value.details == {"status": -signal.SIGSEGV, "backend": "llamacpp"}


def test_a_child_that_fails_says_what_it_wrote() -> None:
    with pytest.raises(BackendCrashedError) as caught:
        prove_in_child("stub", {}, python=_child("import sys; sys.exit('the model has no layers')"))
    assert "the stub backend fails its start-up decode (exited with status 1)" in caught.value.message
    assert "the model has no layers" in caught.value.message


def test_a_child_that_hangs_is_stopped_and_reported() -> None:
    with pytest.raises(BackendCrashedError, match="did not finish its start-up decode within 0.5s"):
        prove_in_child("llamacpp", {}, timeout_s=0.5, python=_child("import time; time.sleep(60)"))


def test_the_real_child_loads_and_warms_up_a_backend() -> None:
    prove_in_child("stub", {"model": "m", "n_layers": 4, "layer_start": 1, "layer_end": 3})
    with pytest.raises(BackendCrashedError, match="no_such_option"):
        prove_in_child("stub", {"model": "m", "no_such_option": 1})


@pytest.mark.slow
def test_a_llamacpp_shard_proves_itself_and_amx_is_caught_where_it_crashes(gemma_path: Path, tmp_path: Path) -> None:
    """On this machine's real build: the guarded backend passes its check. With AMX allowed, an AMX build either
    decodes or is caught by the check with the signal named, never a silent crash."""
    pytest.importorskip("llama_cpp")
    from actors.backends.llamacpp.cpu_buffers import AMX, buffer_types

    options = {"model_path": gemma_path, "layer_start": 0, "layer_end": 9, "shard_dir": tmp_path, "threads": 1,
               "native_dir": tmp_path / "native"}
    prove_in_child("llamacpp", options)
    if AMX not in buffer_types().available:
        prove_in_child("llamacpp", {**options, "allow_amx": True})  # nothing to guard against here
        return
    try:
        prove_in_child("llamacpp", {**options, "allow_amx": True})
    except BackendCrashedError as exc:
        assert "crashes on decode (killed by signal" in exc.message, exc.message


def test_a_node_whose_self_check_crashes_exits_non_zero_with_the_message(tmp_path: Path) -> None:
    """``swarmroute node`` end to end, its self-check child replaced by one that dies of SIGSEGV: the node says
    why and exits 3 before it connects anywhere (no NATS is running)."""
    code = ("import actors.selfcheck as s; s._CHILD_CODE = 'import os, signal; os.kill(os.getpid(), signal.SIGSEGV)';"
            "from swarmroute.cli import main; raise SystemExit(main())")
    pytest.importorskip("llama_cpp")
    done = subprocess.run([sys.executable, "-c", code, "node", "--home", str(tmp_path), "--layers", "0:9",
                           "--nats", "nats://127.0.0.1:1"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False)
    assert done.returncode == 3, done.stderr[-2000:]
    assert ("swarmroute node: the llama.cpp build on this machine crashes on decode (killed by signal 11 (SIGSEGV)); "
            "see docs/llamacpp-backend.md") in done.stderr


class ThreadRecordingStub(StubBackend):
    """The stub, remembering which thread ran each forward pass."""

    def __init__(self) -> None:
        super().__init__(StubConfig(model="m", n_layers=8))
        self.pass_threads: list[str] = []

    def step(self, batch: list[StepInput]) -> list[StepOutput]:
        self.pass_threads.append(threading.current_thread().name)
        return super().step(batch)


async def test_a_starting_node_warms_its_backend_up_on_its_engines_thread(settings: Settings) -> None:
    """Before it advertises, and on the thread that runs every later pass: a warm-up on the thread that loaded the
    model would leave a second OpenMP pool in the process, and every pass after it ~1.6x slower (engine.py)."""
    backend = ThreadRecordingStub()
    async with Node(NodeConfig(node_id="warm", model_id="m"), backend, settings) as node:
        assert backend.pass_threads == ["backend", "backend"], "a prefill and a decode step, on the worker"
        assert backend.open_sessions == [] and node.advertisement is not None
