"""Per-session llama.cpp sampler chains, driven through the real backend and checked against numpy references."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from actors.backend import StepInput  # noqa: E402
from actors.backends import load_backend  # noqa: E402
from actors.backends.llamacpp import LlamaCppBackend  # noqa: E402
from schemas.session import Prompt, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

N = 16
PROMPT = "Write a short poem about the sea. The sea"


@pytest.fixture(scope="module")
def backend(gemma_path: Path) -> Iterator[LlamaCppBackend]:
    b = load_backend("llamacpp", model_path=gemma_path, n_ctx=512, max_sessions=2, threads=2)
    assert isinstance(b, LlamaCppBackend)
    yield b
    b.close()


def sample_run(backend: LlamaCppBackend, tokens: list[int], sampling: SamplingParams,
               forced: list[int] | None = None) -> tuple[list[int], list[np.ndarray]]:
    """``N`` picks (fed back, or ``forced`` tokens fed instead) and the raw logits each pick was drawn from."""
    backend.open_session("s", prompt_tokens=tokens, sampling=sampling)
    try:
        item = StepInput("s", 0, tokens=tokens, sample=True)
        picks, logits = [], []
        for i in range(N):
            out = backend.step([item])[0]
            assert out.token is not None
            picks.append(out.token)
            logits.append(backend.last_logits("s"))
            fed = forced[i] if forced is not None else out.token
            item = StepInput("s", len(tokens) + i, tokens=[fed], sample=True)
        return picks, logits
    finally:
        backend.close_session("s")


def test_seeded_sampling_is_reproducible(backend: LlamaCppBackend) -> None:
    tokens = backend.tokenize(Prompt(text=PROMPT))
    hot = {"temperature": 1.2, "top_k": 0, "top_p": 1.0}
    first, _ = sample_run(backend, tokens, SamplingParams(seed=1234, **hot))
    again, _ = sample_run(backend, tokens, SamplingParams(seed=1234, **hot))
    assert first == again
    others = [sample_run(backend, tokens, SamplingParams(seed=s, **hot))[0] for s in (1, 2)]
    assert any(o != first for o in others)
    greedy, _ = sample_run(backend, tokens, SamplingParams(temperature=0.0))
    assert first != greedy  # a hot sampler really sampled


def test_temperature_zero_is_argmax(backend: LlamaCppBackend) -> None:
    tokens = backend.tokenize(Prompt(text=PROMPT))
    picks, logits = sample_run(backend, tokens, SamplingParams(temperature=0.0))
    assert picks == [int(row.argmax()) for row in logits]


@pytest.mark.parametrize("truncation", [{"top_k": 1}, {"top_p": 0.0001}, {"min_p": 0.9999}],
                         ids=["top_k", "top_p", "min_p"])
def test_truncation_to_one_candidate_is_greedy_even_when_hot(backend: LlamaCppBackend,
                                                             truncation: dict[str, float]) -> None:
    tokens = backend.tokenize(Prompt(text=PROMPT))
    greedy, _ = sample_run(backend, tokens, SamplingParams(temperature=0.0))
    picks, _ = sample_run(backend, tokens, SamplingParams(temperature=2.0, seed=7, **truncation))  # type: ignore[arg-type]
    assert picks == greedy
    untruncated, _ = sample_run(backend, tokens, SamplingParams(temperature=2.0, seed=7))
    assert untruncated != greedy  # the truncation, not luck, made it greedy


def penalized(logits: np.ndarray, window: list[int], p: SamplingParams) -> np.ndarray:
    """llama.cpp's penalty sampler (llama-sampling.cpp) in numpy."""
    out = logits.astype(np.float64).copy()
    ids, counts = np.unique(np.asarray(window[-p.penalty_last_n:]), return_counts=True)
    x = out[ids]
    x = np.where(x <= 0, x * p.repeat_penalty, x / p.repeat_penalty)
    out[ids] = x - counts * p.frequency_penalty - p.presence_penalty
    return out


def test_penalties_see_the_prompt_and_the_generated_tokens(backend: LlamaCppBackend) -> None:
    tokens = backend.tokenize(Prompt(text="one two one two one two one two one two one two one"))
    params = SamplingParams(temperature=0.0, repeat_penalty=1.8, frequency_penalty=0.4, presence_penalty=0.3,
                            penalty_last_n=12)
    picks, raw = sample_run(backend, tokens, params)
    greedy, _ = sample_run(backend, tokens, SamplingParams(temperature=0.0))
    history = list(tokens)
    for pick, logits in zip(picks, raw, strict=True):
        assert pick == int(penalized(logits, history, params).argmax())
        history.append(pick)
    # Without penalties the model just repeats the prompt's pattern; the penalties (fed the prompt) break it.
    assert greedy[0] in tokens[-params.penalty_last_n:]
    assert picks[0] != greedy[0]
