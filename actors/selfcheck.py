"""A node proves its backend before it advertises: one tiny prefill and one decode step, first in a child process,
then in the node itself (the warm-up llama-server also does at start).

Why a child: a native library that crashes on this CPU (llama.cpp's AMX kernels,
``actors/backends/llamacpp/cpu_buffers.py``) kills the process with a signal, and a process killed by a signal
cannot say why. So the node first loads the same backend with the same options in a fresh interpreter and runs the
warm-up there; if that child dies, the node exits with a message naming the signal instead of crashing on a user's
first request. The child runs before the node loads anything, so the weights are never held twice. A forked copy of
the loaded node would be cheaper but is not safe: ggml's AMX weight conversion starts OpenMP's thread pool at load
time, and a fork inherits its locks (the forked child hung, measured).

Invariant: ``warm_up`` leaves the backend as it found it (no session open, no KV held).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from actors.backend import Backend, StepInput
from schemas.errors import BackendCrashedError
from schemas.session import SamplingParams

__all__ = ["BackendCrashedError", "describe_exit", "prove_in_child", "warm_up"]

DOCS = "docs/llamacpp-backend.md#cpus-amx-and-the-start-up-self-check"
WARM_UP_SESSION = "swarmroute-selfcheck"
"""The session id of the warm-up, which a node runs on its backend when it starts."""
_PREFILL_POSITIONS = 16
"""Enough rows for ggml's multi-row (gemm, repacked) kernels, not only the one-row decode path."""
_CHILD_CODE = "from actors.selfcheck import child_main; child_main()"
_TAIL_CHARS = 2000


def describe_exit(status: int) -> str:
    """A ``Popen.returncode`` -> 'exited with status 3' or 'killed by signal 11 (SIGSEGV)'."""
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-status} ({name})"
    return f"exited with status {status}"


def warm_up(backend: Backend) -> None:
    """One prefill of a few positions and one decode step through the backend's own layers, then free them."""
    positions = max(1, min(_PREFILL_POSITIONS, backend.info.context_length - 2))
    backend.open_session(WARM_UP_SESSION, prompt_tokens=[0] * positions, sampling=SamplingParams(temperature=0.0))
    try:
        next_token = 0
        for start, n in ((0, positions), (positions, 1)):
            item = StepInput(WARM_UP_SESSION, start, sample=backend.is_tail)
            if backend.is_head:
                item.tokens = [next_token] * n
            else:
                item.hidden = np.zeros((n, *backend.info.hidden_shape), dtype=np.float32)
            out = backend.step([item])[0]
            next_token = out.token if out.token is not None else 0
    finally:
        backend.close_session(WARM_UP_SESSION)


def prove_in_child(kind: str, options: dict[str, Any], *, timeout_s: float = 600.0,
                   python: list[str] | None = None) -> None:
    """Load backend ``kind`` with ``options`` in a child interpreter and warm it up there. Raises
    ``BackendCrashedError`` naming the signal or status (and the child's last words) if it does not come back
    cleanly. ``python`` replaces the child's command line (tests)."""
    argv = python or [sys.executable, "-c", _CHILD_CODE]
    payload = json.dumps({"kind": kind, "options": {k: str(v) if isinstance(v, Path) else v
                                                    for k, v in options.items()}})
    build = "the llama.cpp build on this machine" if kind == "llamacpp" else f"the {kind} backend"
    try:
        done = subprocess.run(argv, input=payload.encode(), capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise BackendCrashedError(f"{build} did not finish its start-up decode within {timeout_s:g}s; "
                                  f"see {DOCS}") from None
    if done.returncode == 0:
        return
    said = done.stderr.decode(errors="replace").strip()[-_TAIL_CHARS:]
    verb = "crashes on decode" if done.returncode < 0 else "fails its start-up decode"
    raise BackendCrashedError(f"{build} {verb} ({describe_exit(done.returncode)}); see {DOCS}"
                              + (f"\n{said}" if said else ""), details={"status": done.returncode, "backend": kind})


def child_main() -> None:
    """The child's side of ``prove_in_child``: options as JSON on stdin; the exit status is the verdict."""
    from actors.backends import load_backend

    request = json.loads(sys.stdin.read())
    backend = load_backend(request["kind"], **request["options"])
    try:
        warm_up(backend)
    finally:
        backend.close()
