"""actors.node.speculation.drafts: prompt lookup proposes what followed the latest earlier occurrence of the recent
tokens, and a
draft model proposes its own greedy continuation, following the history as drafts are accepted or dropped."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from actors.backends.stub import StubBackend, StubConfig
from actors.node.speculation.drafts import ModelDraft, NgramDraft


def test_prompt_lookup_continues_a_repeated_passage() -> None:
    ngram = NgramDraft(max_n=3, min_n=2)
    text = [1, 2, 3, 4, 5, 6, 7, 9, 9, 2, 3, 4]
    assert ngram.lookup(text, 3) == [5, 6, 7]
    # What followed runs into the end of the text: a loop of period 8, which the proposal goes on repeating.
    assert ngram.lookup(text, 10) == [5, 6, 7, 9, 9, 2, 3, 4, 5, 6]
    assert ngram.lookup([*text, 5], 2) == [6, 7]  # extends incrementally
    assert ngram.lookup([8, 8, 1, 2], 3) == []  # rolled back: re-indexed, and nothing repeats
    assert ngram.lookup([1, 2, 1, 2], 0) == []


def test_a_loop_shorter_than_the_window_is_proposed_round_and_round() -> None:
    assert NgramDraft(max_n=3, min_n=2).lookup([5, 1, 2, 3, 1, 2, 3, 1, 2], 7) == [3, 1, 2, 3, 1, 2, 3]
    assert NgramDraft(max_n=2, min_n=1).lookup([4, 4, 4], 3) == [4, 4, 4]


def test_rolling_back_rejected_drafts_leaves_the_index_of_a_fresh_lookup() -> None:
    """Windows in flight put drafts into the history that a rejection takes out again: the index rolls back to
    what a lookup that never saw them would hold, whatever was cut and added."""
    rng = random.Random(1)
    for _ in range(200):
        ngram = NgramDraft(max_n=4, min_n=rng.choice([1, 2]))
        history = [rng.randrange(5) for _ in range(rng.randrange(2, 40))]
        for _ in range(20):
            if rng.random() < 0.5:
                history = history + [rng.randrange(5) for _ in range(rng.randrange(1, 6))]
            else:
                cut = rng.randrange(1, len(history) + 1)
                history = history[:cut] + [rng.randrange(5) for _ in range(rng.randrange(0, 6))]
            k = rng.randrange(1, 10)
            fresh = NgramDraft(max_n=4, min_n=ngram.min_n)
            assert ngram.lookup(history, k) == fresh.lookup(history, k)
            assert ngram._last == fresh._last and ngram._seen == fresh._seen


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
