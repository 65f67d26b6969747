"""Fleet test helpers: ``swarmroute fleet up`` and single members as real child processes, and the stub
backend's reference continuation computed in-process (one node, every layer) to compare fleets against."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import yaml

from actors.backend import StepInput
from actors.backends.stub import StubBackend, StubConfig
from schemas.session import Prompt, SamplingParams


class Proc:
    """A ``swarmroute ...`` child process whose output is collected; ``wait_for`` a line matching a pattern."""

    def __init__(self, argv: list[str], *, env: dict[str, str] | None = None) -> None:
        self.argv = [sys.executable, "-m", "swarmroute", *argv]
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     start_new_session=True)
        self.output: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with self._changed:
                self.output.append(raw.decode(errors="replace").rstrip())
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        regex = re.compile(pattern)
        seen = 0
        with self._changed:
            while True:
                for line in self.output[seen:]:
                    m = regex.search(line)
                    if m:
                        return m
                seen = len(self.output)
                if self.proc.poll() is not None and seen == len(self.output):
                    raise RuntimeError(f"{' '.join(self.argv[2:])} exited:\n" + "\n".join(self.output[-40:]))
                if not self._changed.wait(timeout):
                    raise TimeoutError(f"no line matching {pattern!r} within {timeout:g}s:\n"
                                       + "\n".join(self.output[-40:]))

    def run(self, timeout: float) -> int:
        """Wait for the process to exit (a one-shot command); returns its exit code."""
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
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
