"""Resident prefixes in the llama.cpp context (actors/backends/llamacpp/resident.py, the parking methods of the
backend), issue #26, on the real bundled Gemma 3 270M: a parked session's cells are adopted by a new session
(``llama_memory_seq_cp``, nothing computed), which then continues as a session that computed them itself; memory
pressure evicts parked sequences, never a running session's KV; a parked sequence can be exported (demotion to host
memory) and is gone once dropped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.backend import StepInput
from actors.node.reuse import ResidentKv
from schemas.errors import SnapshotError
from schemas.session import SamplingParams

llama_cpp = pytest.importorskip("llama_cpp")

from actors.backends.llamacpp.backend import LlamaCppBackend, load_llamacpp  # noqa: E402

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0)
PROMPT = [2, *[(i * 37) % 5000 + 300 for i in range(299)]]
OTHER = [2, *[(i * 53) % 4000 + 700 for i in range(379)]]


def load(path: Path, **kw: object) -> LlamaCppBackend:
    options: dict[str, object] = dict(model_path=path, n_ctx=1024, max_sessions=2, threads=1)
    return load_llamacpp(**{**options, **kw})


@pytest.fixture(scope="module")
def backend(gemma_path: Path) -> Iterator[LlamaCppBackend]:
    b = load(gemma_path)
    yield b
    b.close()


def run(backend: LlamaCppBackend, sid: str, tokens: list[int], *, start: int = 0, n: int = 8,
        chunk: int = 256) -> list[int]:
    """Prefill ``tokens[start:]`` of an open session in chunks that end where a cold prefill's do, then decode
    greedily; the ``n`` tokens sampled."""
    stops = [*range((start // chunk + 1) * chunk, len(tokens), chunk), len(tokens)]
    out, at = None, start
    for stop in stops:
        out = backend.step([StepInput(sid, at, tokens=tokens[at:stop], sample=stop == len(tokens))])[0]
        at = stop
    assert out is not None and out.token is not None
    sampled = [out.token]
    for i in range(n - 1):
        step = backend.step([StepInput(sid, len(tokens) + i, tokens=[sampled[-1]], sample=True)])[0]
        assert step.token is not None
        sampled.append(step.token)
    return sampled


def cold(backend: LlamaCppBackend, sid: str, tokens: list[int], n: int = 8) -> list[int]:
    backend.open_session(sid, prompt_tokens=tokens, sampling=GREEDY)
    try:
        return run(backend, sid, tokens, n=n)
    finally:
        backend.close_session(sid)


def test_a_parked_prefix_is_adopted_and_the_session_goes_on_as_a_cold_one(backend: LlamaCppBackend) -> None:
    assert isinstance(backend, ResidentKv) and backend.resident_slots == 2
    backend.open_session("first", prompt_tokens=PROMPT, sampling=GREEDY)
    run(backend, "first", PROMPT)
    assert backend.park_session("first", "kept")
    assert backend.parked_prefixes() == {"kept": len(PROMPT) + 7}
    assert all(backend.seq_cells(s) == (-1, -1) for s in range(backend.max_sessions))  # sessions' ids all free
    diverging = [*PROMPT[:290], 901, 902, 903]
    for prompt, n in ((PROMPT, len(PROMPT) - 1), (diverging, 290)):  # the same prompt again; one that diverges
        backend.open_session("warm", prompt_tokens=prompt, sampling=GREEDY)
        backend.adopt_parked("kept", "warm", n)
        assert backend.kv_cells("warm") == (0, n - 1) and backend.kv_continues("warm")
        warm = run(backend, "warm", prompt, start=n)
        backend.close_session("warm")
        assert warm == cold(backend, "cold", prompt)
    assert backend.parked_prefixes() == {"kept": len(PROMPT) + 7}  # adopting copies the cells, the parked stay
    exported = backend.export_parked("kept", 0, 256)
    assert len(exported) > 0
    backend.drop_parked("kept")
    assert backend.parked_prefixes() == {}
    backend.open_session("late", prompt_tokens=PROMPT, sampling=GREEDY)
    with pytest.raises(SnapshotError):
        backend.adopt_parked("kept", "late", 10)
    backend.close_session("late")


def park_two_then_run(backend: LlamaCppBackend, *, free_by_hand: bool) -> list[int]:
    """Park a 300- and a 40-token prefix (340 of the 512 cells), then run a session that needs 395 cells: memory
    pressure evicts the oldest parked prefix in the middle of its first pass, unless ``free_by_hand`` drops that one
    beforehand, as the eviction does. The running session's greedy tokens."""
    for name, tokens in (("big", PROMPT), ("small", PROMPT[:40])):
        backend.open_session(name, prompt_tokens=tokens, sampling=GREEDY)
        run(backend, name, tokens, n=1)
        assert backend.park_session(name, name)
    assert backend.parked_prefixes() == {"big": len(PROMPT), "small": 40}
    if free_by_hand:
        backend.drop_parked("big")
    backend.open_session("running", prompt_tokens=OTHER, sampling=GREEDY)
    return run(backend, "running", OTHER, n=16)


def test_memory_pressure_evicts_parked_prefixes_never_a_running_session(gemma_path: Path) -> None:
    """The reference frees the same cells by hand, not a cold run in an empty context: the running session's cells
    lie around the parked prefix that stays, and where its cells lie moves llama.cpp's attention sums and, on some
    CPUs, its greedy text (CI's machine failed a comparison with a cold run, which measured the fragmentation, not
    the eviction). With the same cells, a failed pass that evicts and
    retries must leave nothing behind: the tokens are equal on any CPU."""
    reference = load(gemma_path, n_ctx=512, max_sessions=1, resident_prefixes=2)  # 512 cells for everything
    try:
        expected = park_two_then_run(reference, free_by_hand=True)
    finally:
        reference.close()
    tight = load(gemma_path, n_ctx=512, max_sessions=1, resident_prefixes=2)
    try:
        got = park_two_then_run(tight, free_by_hand=False)
        assert got == expected
        assert tight.parked_prefixes() == {"small": 40}  # only the oldest gave its cells up
        assert tight.kv_cells("running") == (0, len(OTHER) + 14)
    finally:
        tight.close()


def test_parking_takes_the_oldest_slot_when_all_are_taken(backend: LlamaCppBackend) -> None:
    for name in ("p1", "p2", "p3"):
        backend.open_session(name, prompt_tokens=PROMPT[:40], sampling=GREEDY)
        run(backend, name, PROMPT[:40], n=1)
        assert backend.park_session(name, name)
    assert list(backend.parked_prefixes()) == ["p2", "p3"]
    for name in ("p2", "p3"):
        backend.drop_parked(name)
    assert not backend.park_session("never-opened", "x")
