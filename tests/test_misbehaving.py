"""The test-only bad backends (issue #28): they compute wrong as asked, and are the wrapped backend otherwise."""

from __future__ import annotations

import numpy as np
import pytest

from actors.backend import Backend, KvBackend, StepInput
from actors.backends.misbehaving import Misbehaviour, misbehaving
from schemas.session import SamplingParams
from tests.support.swarm import stub


def test_parse_refuses_anything_else() -> None:
    assert Misbehaviour.parse("noise:0.5") == Misbehaviour("noise", sigma=0.5)
    assert Misbehaviour.parse("quant:/x.gguf").path == "/x.gguf"
    assert Misbehaviour.parse("draw") == Misbehaviour("draw")
    for bad in ("noise", "skip:1", "draw:2", "quant:", "honest"):
        with pytest.raises(ValueError):
            Misbehaviour.parse(bad)


def step(backend: Backend, sid: str) -> np.ndarray:
    backend.open_session(sid, prompt_tokens=[1], sampling=SamplingParams())
    out = backend.step([StepInput(sid, 0, hidden=np.ones((2, 8), np.float32))])[0].hidden
    assert out is not None
    return np.array(out)


def test_noise_and_skip_change_what_a_hop_sends_and_nothing_else() -> None:
    honest = step(stub(2, 4, hidden_shape=(8,)), "a")
    noisy = misbehaving(stub(2, 4, hidden_shape=(8,)), Misbehaviour.parse("noise:0.5"))
    assert isinstance(noisy, KvBackend) and noisy.layers == stub(2, 4).layers
    assert not np.array_equal(step(noisy, "b"), honest)
    skipper = misbehaving(stub(2, 4, hidden_shape=(8,)), Misbehaviour("skip"))
    assert np.array_equal(step(skipper, "c"), np.ones((2, 8), np.float32))
    with pytest.raises(ValueError):
        misbehaving(stub(0, 4), Misbehaviour("skip"))


def test_a_noisy_tail_computes_its_logits_from_noisy_inputs() -> None:
    def top(backend: Backend) -> np.ndarray:
        backend.open_session("t", prompt_tokens=[1], sampling=SamplingParams(temperature=0))
        out = backend.step([StepInput("t", 0, hidden=np.ones((2, 8), np.float32), sample=True, top_k=4)])[0]
        assert out.top is not None and out.token is not None
        return out.top.values

    honest = top(stub(4, 8, hidden_shape=(8,)))
    assert np.array_equal(top(stub(4, 8, hidden_shape=(8,))), honest)
    assert not np.array_equal(top(misbehaving(stub(4, 8, hidden_shape=(8,)), Misbehaviour.parse("noise:0.5"))), honest)


def test_a_misdrawing_tail_computes_right_and_draws_the_runner_up() -> None:
    def sampled(backend: Backend) -> tuple[int, np.ndarray, np.ndarray]:
        backend.open_session("t", prompt_tokens=[1], sampling=SamplingParams(temperature=0))
        out = backend.step([StepInput("t", 0, hidden=np.ones((2, 8), np.float32), sample=True, top_k=4)])[0]
        assert out.top is not None and out.token is not None
        return out.token, out.top.ids, out.top.values

    token, ids, values = sampled(stub(4, 8, hidden_shape=(8,)))
    wrong, wrong_ids, wrong_values = sampled(misbehaving(stub(4, 8, hidden_shape=(8,)), Misbehaviour("draw")))
    assert token == ids[0] and wrong == ids[1]
    assert np.array_equal(wrong_ids, ids) and np.array_equal(wrong_values, values)
    with pytest.raises(ValueError):
        misbehaving(stub(0, 4), Misbehaviour("draw"))
