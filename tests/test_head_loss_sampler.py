"""Issue #31: a sampled session's random state survives a repair. A llama.cpp tail whose sampler is rebuilt (a tail
cut back by a repair, a replacement tail, a replacement head that is its own tail) replays the tokens generated so
far and then draws exactly what the unfaulted sampler would have drawn next: every token consumes the same number
of random draws, so the state after ``k`` tokens is ``(seed, k * draws_per_token)``. Real llama.cpp, the bundled
model; every configuration of the sampler (plain temperature, truncation down to one candidate, penalties, a grammar
on the chain's path and on the keyed numpy path, no seed at all)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from actors.backend import StepInput  # noqa: E402
from actors.backends import load_backend  # noqa: E402
from actors.backends.llamacpp.backend import LlamaCppBackend  # noqa: E402
from schemas.constraint import JsonObjectConstraint  # noqa: E402
from schemas.session import Prompt, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

N = 16
CUT = 7
PROMPT = "Write a short poem about the sea. The sea"
CONFIGS = {
    "plain": SamplingParams(temperature=1.2, seed=5),
    "top-k-1-then-hot": SamplingParams(temperature=1.0, top_k=2, top_p=0.5, seed=9),
    "top-p-chaos": SamplingParams(temperature=0.9, top_p=0.95, seed=7),
    "penalties": SamplingParams(temperature=1.0, frequency_penalty=1.0, top_k=40, seed=2),
    "grammar-chain": SamplingParams(temperature=1.0, top_k=40, seed=4, constraint=JsonObjectConstraint()),
    "grammar-keyed": SamplingParams(temperature=1.0, seed=6, constraint=JsonObjectConstraint()),
    "no-seed": SamplingParams(temperature=1.3),
}


@pytest.fixture(scope="module")
def backend(gemma_path: Path) -> Iterator[LlamaCppBackend]:
    b = load_backend("llamacpp", model_path=gemma_path, n_ctx=512, max_sessions=2, threads=2)
    assert isinstance(b, LlamaCppBackend)
    yield b
    b.close()


def step(backend: LlamaCppBackend, sid: str, start: int, tokens: list[int], sample: bool) -> int | None:
    return backend.step([StepInput(sid, start, tokens=tokens, sample=sample)])[0].token


def generate(backend: LlamaCppBackend, sid: str, prompt: list[int], first: int | None, count: int,
             done: int = 0) -> list[int]:
    """``count`` tokens, each fed back; ``first`` is token ``done``, just sampled (the KV ends before it)."""
    picks: list[int] = []
    token = first
    for _ in range(count):
        assert token is not None
        picks.append(token)
        token = step(backend, sid, len(prompt) + done + len(picks) - 1, [token], True)
    return picks


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_rebuilt_sampler_draws_what_the_unfaulted_one_would_have(backend: LlamaCppBackend, name: str) -> None:
    sampling = CONFIGS[name]
    prompt = backend.tokenize(Prompt(text=PROMPT))
    backend.open_session("a", prompt_tokens=prompt, sampling=sampling)
    try:
        picks = generate(backend, "a", prompt, step(backend, "a", 0, prompt, True), N)
        # A repair cuts the tail back: its KV ends before token CUT's feed, its sampler starts over from the tokens.
        backend.truncate("a", len(prompt) + CUT - 1)
        backend.replay_sampled("a", picks[:CUT])
        again = step(backend, "a", len(prompt) + CUT - 1, [picks[CUT - 1]], True)
        assert picks[:CUT] + generate(backend, "a", prompt, again, N - CUT, CUT) == picks
    finally:
        backend.close_session("a")
    if sampling.seed is None:
        return  # another node's sampler cannot know a seed llama.cpp drew
    # A replacement tail on another node: a new session with the same seed, rebuilt from the tokens alone.
    backend.open_session("b", prompt_tokens=prompt, sampling=sampling)
    try:
        step(backend, "b", 0, prompt, False)
        for i, token in enumerate(picks[:CUT - 1]):
            step(backend, "b", len(prompt) + i, [token], False)
        backend.replay_sampled("b", picks[:CUT])
        again = step(backend, "b", len(prompt) + CUT - 1, [picks[CUT - 1]], True)
        assert picks[:CUT] + generate(backend, "b", prompt, again, N - CUT, CUT) == picks
    finally:
        backend.close_session("b")


def test_a_rebuilt_sampler_without_the_draws_would_have_diverged(backend: LlamaCppBackend) -> None:
    """The test above can fail: a sampler that starts over from its seed (what a repair did before) draws another
    stream for this prompt."""
    from actors.backends.llamacpp.sampling import Sampler
    sampling = CONFIGS["plain"]
    prompt = backend.tokenize(Prompt(text=PROMPT))
    backend.open_session("a", prompt_tokens=prompt, sampling=sampling)
    try:
        picks = generate(backend, "a", prompt, step(backend, "a", 0, prompt, True), N)
        backend.truncate("a", len(prompt) + CUT - 1)
        session = backend._sessions["a"]  # noqa: SLF001 - the old behaviour, rebuilt by hand
        assert session.sampler is not None
        session.sampler.close()
        session.sampler = Sampler(sampling, n_vocab=backend.info.n_vocab, prompt_tokens=prompt)
        again = step(backend, "a", len(prompt) + CUT - 1, [picks[CUT - 1]], True)
        assert picks[:CUT] + generate(backend, "a", prompt, again, N - CUT, CUT) != picks
    finally:
        backend.close_session("a")


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, top_p=0.95, seed=3),
                                    SamplingParams(temperature=1.0, top_k=40, top_p=0.5, seed=8),
                                    SamplingParams(temperature=1.0, min_p=0.5, top_k=40, seed=5)],
                         ids=["top-p", "top-k-top-p", "min-p"])
def test_a_token_truncated_to_one_candidate_costs_what_its_replay_costs(params: SamplingParams) -> None:
    """The chaos matrix's seeded session that lost its middle node mid-decode (issue #31): a peaked row that the
    truncation leaves one candidate of draws as often as replaying its token does, whatever the loaded llama.cpp's
    ``dist`` sampler does with one candidate; otherwise a rebuilt sampler drifts from the original on the first
    flat row after it."""
    from actors.backends.llamacpp.sampling import Sampler
    vocab = 1024
    peaked = np.zeros(vocab, dtype=np.float32)
    peaked[17] = 60.0
    flat = np.zeros(vocab, dtype=np.float32)
    original = Sampler(params, n_vocab=vocab)
    rebuilt = Sampler(params, n_vocab=vocab)
    try:
        first, _ = original.pick(peaked)
        assert first == 17
        rebuilt.accept(first)
        assert [original.pick(flat)[0] for _ in range(8)] == [rebuilt.pick(flat)[0] for _ in range(8)]
    finally:
        original.close()
        rebuilt.close()
