"""A recurrent state cannot be truncated: what the llama.cpp backend does for a whole ``qwen35moe`` (Gated DeltaNet
layers, one recurrent state per sequence) on one node.

* snapshots / repair: a range ``[a, b)`` short of the session's position is refused (``SnapshotError``); without the
  refusal llama.cpp exports the state of the session's *last* position and a session resumed at ``b`` computes
  other logits. A whole-sequence export imported into an empty session continues bit-exactly;
* speculation: a verify window's rejected positions are dropped through the rollback ring (``n_rs_seq``);
* prefix reuse: dropping further back than the ring is refused.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")  # a skip fails under CI=true (tests/support/ci_strict.py)

from actors.backend import StepInput  # noqa: E402
from actors.backends import load_backend  # noqa: E402
from actors.backends.llamacpp.backend import LlamaCppBackend  # noqa: E402
from artifacts.synthetic.matrix import case  # noqa: E402
from schemas.errors import SnapshotError  # noqa: E402
from tests.support.arch_matrix import GREEDY, N_CTX, prompt_tokens  # noqa: E402


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaCppBackend]:
    path = case("qwen35moe").builder().write(tmp_path_factory.mktemp("q35") / "qwen35moe.gguf", quant="F16", seed=16)
    # A stream per sequence: both sessions' cells then lie alike, so "continues exactly" compares bit for bit (in
    # the unified cache the imported cells sit elsewhere, and on AVX-512 CPUs that moves attention by ~1e-3).
    b = load_backend("llamacpp", model_path=path, n_ctx=N_CTX, max_sessions=2, threads=1, max_draft=4,
                     batch_invariant="all")
    assert isinstance(b, LlamaCppBackend)
    yield b
    b.close()


def _step(b: LlamaCppBackend, sid: str, tokens: list[int], start: int) -> np.ndarray:
    b.step([StepInput(sid, start, tokens=tokens, sample=True)])
    return b.last_logits(sid).copy()


def test_a_range_of_a_recurrent_state_is_refused_and_a_whole_one_continues_exactly(backend: LlamaCppBackend) -> None:
    tokens = prompt_tokens(backend)[:20]
    backend.open_session("a", prompt_tokens=tokens, sampling=GREEDY)
    backend.open_session("b", prompt_tokens=tokens, sampling=GREEDY)
    try:
        _step(backend, "a", tokens, 0)
        with pytest.raises(SnapshotError, match=r"not \[0, 10\)"):
            backend.export_kv("a", 0, 10)
        backend.import_kv("b", [backend.export_kv("a", 0, 20)], 20)
        assert float(np.abs(_step(backend, "b", [5], 20) - _step(backend, "a", [5], 20)).max()) == 0.0
    finally:
        backend.close_session("a")
        backend.close_session("b")


def test_speculation_rolls_back_through_the_ring_and_deeper_cuts_are_refused(backend: LlamaCppBackend) -> None:
    tokens = prompt_tokens(backend)[:20]
    backend.open_session("s", prompt_tokens=tokens, sampling=GREEDY)
    try:
        _step(backend, "s", tokens, 0)
        _step(backend, "s", [7, 8, 9], 20)  # a verify window of 3 positions
        backend.truncate("s", 21)  # two of them rejected
        assert backend.session_position("s") == 21
        with pytest.raises(SnapshotError, match="from 10 on"):
            backend.truncate("s", 10)  # a shorter prefix: what reuse would need
    finally:
        backend.close_session("s")
