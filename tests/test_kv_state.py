"""A session's KV in and out of llama.cpp (actors/backends/llamacpp/kv_state.py, the ``KvBackend`` methods of the
llama.cpp backend), issue #18: on the real bundled Gemma 3 270M, whole and as shards. A session rebuilt on an idle
backend from its exported pieces continues with the very logits of the undisturbed run (max abs diff 0.0), past the
512-token sliding window; truncating and recomputing is exact; a foreign or cut blob is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from actors.backend import KvBackend, StepInput
from schemas.errors import BadRequestError, SnapshotError
from schemas.session import SamplingParams

llama_cpp = pytest.importorskip("llama_cpp")

from actors.backends.llamacpp.backend import LlamaCppBackend, load_llamacpp  # noqa: E402

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0)
PROMPT = [2, *[(i * 37) % 5000 + 300 for i in range(700)]]  # past the 512-token window


def load(path: Path, **kw: object) -> LlamaCppBackend:
    return load_llamacpp(model_path=path, n_ctx=1024, max_sessions=2, threads=1, **kw)


@pytest.fixture(scope="module")
def whole(gemma_path: Path) -> Iterator[LlamaCppBackend]:
    backend = load(gemma_path)
    yield backend
    backend.close()


def prefill(backend: LlamaCppBackend, sid: str, tokens: list[int], chunk: int = 256) -> int:
    backend.open_session(sid, prompt_tokens=tokens, sampling=GREEDY)
    out = None
    for start in range(0, len(tokens), chunk):
        part = tokens[start:start + chunk]
        out = backend.step([StepInput(sid, start, tokens=part, sample=start + len(part) >= len(tokens))])[0]
    assert out is not None and out.token is not None
    return out.token


def decode(backend: LlamaCppBackend, sid: str, first: int, start: int, n: int) -> tuple[list[int], list[np.ndarray]]:
    tokens, logits, token = [first], [], first
    for i in range(n):
        token = backend.step([StepInput(sid, start + i, tokens=[token], sample=True)])[0].token  # type: ignore[assignment]
        tokens.append(token)
        logits.append(backend.last_logits(sid))
    return tokens, logits


def test_a_session_rebuilt_from_its_pieces_continues_bit_for_bit(whole: LlamaCppBackend, gemma_path: Path) -> None:
    assert isinstance(whole, KvBackend)
    first = prefill(whole, "orig", PROMPT)
    P = len(PROMPT)
    tokens, _ = decode(whole, "orig", first, P, 20)
    blobs = [whole.export_kv("orig", 0, P), whole.export_kv("orig", P, P + 10), whole.export_kv("orig", P + 10, P + 20)]
    later, reference = decode(whole, "orig", tokens[-1], P + 20, 12)
    whole.close_session("orig")
    fresh = load(gemma_path)
    try:
        fresh.open_session("copy", prompt_tokens=PROMPT, sampling=GREEDY)
        fresh.import_kv("copy", blobs, P + 20)
        assert fresh.session_position("copy") == P + 20 and fresh.kv_continues("copy")
        again, logits = decode(fresh, "copy", tokens[-1], P + 20, 12)
        assert again == later
        assert max(float(np.abs(a - b).max()) for a, b in zip(logits, reference, strict=True)) == 0.0
    finally:
        fresh.close()


def test_truncating_and_recomputing_is_exact(whole: LlamaCppBackend) -> None:
    first = prefill(whole, "t", PROMPT[:300])
    tokens, logits = decode(whole, "t", first, 300, 10)
    whole.truncate("t", 305)
    assert whole.kv_cells("t") == (0, 304)
    again, relogits = decode(whole, "t", tokens[5], 305, 5)
    assert again == tokens[5:] and all(np.array_equal(a, b) for a, b in zip(relogits, logits[5:], strict=True))
    with pytest.raises(BadRequestError):
        whole.truncate("t", 999)
    whole.close_session("t")


def test_foreign_and_cut_blobs_are_refused_and_change_nothing(whole: LlamaCppBackend, gemma_path: Path,
                                                              tmp_path: Path) -> None:
    prefill(whole, "src", PROMPT[:40])
    blob = whole.export_kv("src", 0, 40)
    whole.close_session("src")
    tail = load(gemma_path, layer_start=9, layer_end=18, shard_dir=tmp_path)
    try:
        tail.open_session("x", prompt_tokens=PROMPT[:40], sampling=GREEDY)
        with pytest.raises(SnapshotError):
            tail.import_kv("x", [blob], 40)  # the whole model's layers into a shard of 9
        assert tail.session_position("x") == 0 and tail.kv_cells("x") == (-1, -1)
    finally:
        tail.close()
    whole.open_session("y", prompt_tokens=PROMPT[:40], sampling=GREEDY)
    for bad in (blob[:-7], blob[:3], blob + b"\x00"):
        with pytest.raises(SnapshotError):
            whole.import_kv("y", [bad], 40)
        assert whole.kv_cells("y") == (-1, -1)
    with pytest.raises(SnapshotError, match="up to"):
        whole.import_kv("y", [blob], 41)
    whole.close_session("y")
