"""A hop's receipt for a spot check (issue #28): frames from position 0 to the limit, sealed once."""

from __future__ import annotations

import numpy as np

from actors.backend import StepInput, TopLogits
from actors.node.spot_receipt import Sealed, SpotRecorder, top_of
from schemas.node import LayerRange
from schemas.spot_check import SpotReceipt


def recorder(sealed: list[Sealed], limit: int = 6) -> SpotRecorder:
    return SpotRecorder(session_id="s" * 32, model_id="m", manifest_id="", layers=LayerRange(start=2, end=4),
                        node_id="n1", build_id="b", hidden_shape=(3,), limit=limit, ready=sealed.append)


def hidden(n: int, value: float) -> np.ndarray:
    return np.full((n, 3), value, dtype=np.float32)


def test_frames_are_sealed_at_the_limit_with_their_inputs_and_outputs() -> None:
    sealed: list[Sealed] = []
    rec = recorder(sealed)
    for start, n in ((0, 4), (4, 1), (5, 1)):
        rec.computed(start, StepInput("s", start, hidden=hidden(n, start)), batch_size=1 if start else 2)
        rec.sent(start, hidden(n, start + 100))
    assert len(sealed) == 1 and rec.stopped
    receipt, inputs, outputs = SpotReceipt.decode(sealed[0].encode())
    assert [(f.start, f.n, f.alone) for f in receipt.frames] == [(0, 4, False), (4, 1, True), (5, 1, True)]
    assert receipt.positions == 6 and receipt.layers == LayerRange(start=2, end=4)
    assert np.frombuffer(inputs[1] or b"", "<f4").tolist() == [4.0] * 3
    assert np.frombuffer(outputs[2], "<f4").tolist() == [105.0] * 3
    rec.seal()  # once only
    assert len(sealed) == 1


def test_a_head_records_tokens_and_close_seals_what_went_out() -> None:
    sealed: list[Sealed] = []
    rec = recorder(sealed, limit=100)
    rec.computed(0, StepInput("s", 0, tokens=[1, 2]), batch_size=1)
    rec.sent(0, hidden(2, 1))
    rec.computed(2, StepInput("s", 2, tokens=[3]), batch_size=1)  # never sent: not in the receipt
    rec.seal()
    receipt, inputs, _ = SpotReceipt.decode(sealed[0].encode())
    assert [f.tokens for f in receipt.frames] == [[1, 2]] and inputs == [None]


def test_a_session_not_starting_at_zero_or_with_a_gap_records_nothing() -> None:
    sealed: list[Sealed] = []
    rec = recorder(sealed)
    rec.computed(3, StepInput("s", 3, hidden=hidden(1, 0)), batch_size=1)
    rec.seal()
    gap = recorder(sealed)
    gap.computed(0, StepInput("s", 0, hidden=hidden(2, 0)), batch_size=1)
    gap.sent(0, hidden(2, 0))
    gap.computed(5, StepInput("s", 5, hidden=hidden(1, 0)), batch_size=1)
    gap.seal()
    assert sealed == [] and rec.stopped and gap.stopped


def test_a_tail_records_the_top_logits_it_sampled_from() -> None:
    sealed: list[Sealed] = []
    rec = SpotRecorder(session_id="s" * 32, model_id="m", manifest_id="", layers=LayerRange(start=4, end=8),
                       node_id="t1", build_id="b", hidden_shape=(3,), limit=6, ready=sealed.append, top_k=4)
    logits = np.arange(10, dtype=np.float32)[::-1].copy()  # ids 0..3 are the largest
    rec.computed(0, StepInput("s", 0, hidden=hidden(3, 0)), batch_size=1)
    rec.answered(0, False, None)  # a prefill chunk that sampled nothing
    rec.computed(3, StepInput("s", 3, hidden=hidden(2, 0)), batch_size=1)
    rec.answered(3, True, TopLogits.of(logits, 4))
    rec.computed(5, StepInput("s", 5, hidden=hidden(1, 0)), batch_size=1)
    rec.answered(5, True, TopLogits.of(logits + 1, 4))
    assert len(sealed) == 1
    receipt, _, outputs = SpotReceipt.decode(sealed[0].encode())
    assert receipt.top_k == 4 and [f.sample for f in receipt.frames] == [False, True, True]
    assert outputs[0] == b""
    top = top_of(outputs[2], 4)
    assert top.ids.tolist() == [0, 1, 2, 3] and top.values.tolist() == [10.0, 9.0, 8.0, 7.0]


def test_a_tail_whose_backend_gives_no_top_logits_records_nothing() -> None:
    sealed: list[Sealed] = []
    rec = SpotRecorder(session_id="s" * 32, model_id="m", manifest_id="", layers=LayerRange(start=4, end=8),
                       node_id="t1", build_id="b", hidden_shape=(3,), limit=6, ready=sealed.append, top_k=4)
    rec.computed(0, StepInput("s", 0, hidden=hidden(2, 0)), batch_size=1)
    rec.answered(0, True, None)
    rec.seal()
    assert rec.stopped and sealed == []


def test_top_logits_are_the_largest_first_with_ties_by_id() -> None:
    top = TopLogits.of(np.asarray([1.0, 5.0, 3.0, 5.0, -9.0], dtype=np.float32), 3)
    assert top.ids.tolist() == [1, 3, 2] and top.values.tolist() == [5.0, 5.0, 3.0]
