"""Fleet test helpers: ``swarmroute fleet up`` and single members as real child processes, and the stub
backend's reference continuation computed in-process (one node, every layer) to compare fleets against."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import yaml

from actors.backend import StepInput
from actors.backends.stub import StubBackend, StubConfig
from schemas.session import Prompt, SamplingParams
from tests.support.actors import ChildProcess, swarmroute


class Proc(ChildProcess):
    """A ``swarmroute ...`` child process whose output is collected; ``wait_for`` a line matching a pattern. A
    child that outlives its SIGTERM is killed with its whole process group (``fleet up`` starts members)."""

    stop_timeout = 20.0

    def __init__(self, argv: list[str], *, env: dict[str, str] | None = None) -> None:
        super().__init__(swarmroute(*argv), env=env)
    def force(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def write_fleet(path: Path, doc: dict[str, object]) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def stub_reference(prompt: Prompt, n_tokens: int, *, model: str = "stub-model", n_layers: int = 8) -> str:
    """What a greedy stub model writes after ``prompt`` (no EOS stop), computed by one node holding every layer."""
    backend = StubBackend(StubConfig(model=model, n_layers=n_layers))
    sid = uuid.uuid4().hex
    tokens = backend.tokenize(prompt)
    backend.open_session(sid, prompt_tokens=tokens, sampling=SamplingParams(temperature=0.0))
    token = backend.step([StepInput(sid, 0, tokens=tokens, sample=True)])[0].token
    out: list[int] = []
    while True:
        assert token is not None
        out.append(token)
        if len(out) == n_tokens:
            break
        token = backend.step([StepInput(sid, len(tokens) + len(out) - 1, tokens=[token], sample=True)])[0].token
    return b"".join(backend.token_bytes(t) for t in out).decode()
