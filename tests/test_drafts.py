"""actors.node.drafts: prompt lookup proposes what followed the latest earlier occurrence of the recent tokens, and a
draft model proposes its own greedy continuation, following the history as drafts are accepted or dropped."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.backends.stub import StubBackend, StubConfig
from actors.node.drafts import ModelDraft, NgramDraft


def test_prompt_lookup_continues_a_repeated_passage() -> None:
    ngram = NgramDraft(max_n=3, min_n=2)
    text = [1, 2, 3, 4, 5, 6, 7, 9, 9, 2, 3, 4]
    assert ngram.lookup(text, 3) == [5, 6, 7]
    assert ngram.lookup(text, 10) == [5, 6, 7, 9, 9, 2, 3, 4]
    assert ngram.lookup([*text, 5], 2) == [6, 7]  # extends incrementally
    assert ngram.lookup([8, 8, 1, 2], 3) == []  # rolled back: re-indexed, and nothing repeats
    assert ngram.lookup([1, 2, 1, 2], 0) == []


def test_the_most_recent_occurrence_and_the_longest_ngram_win() -> None:
    ngram = NgramDraft(max_n=3, min_n=1)
    assert ngram.lookup([7, 1, 2, 7, 3, 4, 7], 2) == [3, 4]  # the latest 7 was followed by 3
    assert ngram.lookup([5, 7, 1, 6, 7, 2, 5, 7], 1) == [1]  # "5 7" beats the more recent "7"


async def test_a_draft_model_proposes_its_greedy_continuation() -> None:
    backend = StubBackend(StubConfig(n_layers=4))
    reference = StubBackend(StubConfig(n_layers=4))
    from actors.backend import StepInput
    from schemas.session import SamplingParams

    prompt = [256, *b"hello world"]
    reference.open_session("r", prompt_tokens=prompt, sampling=SamplingParams(temperature=0.0))
    token = reference.step([StepInput("r", 0, tokens=prompt, sample=True)])[0].token
    greedy = [token]
    for i in range(7):
        token = reference.step([StepInput("r", len(prompt) + i, tokens=[greedy[-1]], sample=True)])[0].token
        greedy.append(token)
    from actors.node.engine import StepEngine

    engine = StepEngine(backend)
    await engine.start()
    draft = ModelDraft(engine, session_id="draft")
    try:
        assert await draft.propose(prompt, 4) == greedy[:4]
        # Two drafts accepted, the third replaced by the route's own token: the model cuts back and follows.
        history = [*prompt, *greedy[:2], 99]
        again = await draft.propose(history, 3)
        assert len(again) == 3 and backend.positions_computed("draft") > 0
        assert await draft.propose([*prompt, *greedy[:5]], 2) == greedy[5:7]
    finally:
        await draft.close()
        await engine.stop()


def test_a_draft_model_must_be_a_whole_model(tmp_path: Path) -> None:
    from actors.node.engine import StepEngine

    with pytest.raises(ValueError, match="whole model"):
        ModelDraft(StepEngine(StubBackend(StubConfig(n_layers=4, layer_end=2))), session_id="x")
