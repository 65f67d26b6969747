"""DeepSeek V4 routes bit-exactly across shards on llama.cpp (issue #25), on the tiny V4 of the matrix
(``artifacts.synthetic.matrix.TINY_V4``: every V4 part at width 64).

* chains of backends and routes through real nodes, tracker, gateway and nats-server, for the 2-way, 3-way and
  unaligned splits (the first cut right after the hash layers; cuts between CSA and HCA layers), F16 and Q8_0:
  greedy tokens identical and tail logits max abs diff 0.0 against the whole GGUF, after a 318-token prompt (past the
  128-position window; the HCA layers compress two 128-token blocks during prefill);
* the hop carries all four hyper-connection streams (they differ from one another), and they are what makes the
  next shard exact: fed their mean in every stream (what ``llama_get_embeddings_layer_inp`` gives for deepseek4) the
  tail computes other logits;
* the guard refuses a cut that takes a hash-routed layer off the head, naming the layers, and a shard without a CSA
  layer (llama.cpp divides by zero loading it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

llama_cpp = pytest.importorskip("llama_cpp")  # a skip fails under CI=true (tests/support/ci_strict.py)

from actors.backend import StepInput  # noqa: E402
from actors.backends.llamacpp.backend import LlamaCppBackend  # noqa: E402
from artifacts.synthetic.matrix import case, ranges  # noqa: E402
from bus.server import EmbeddedNats  # noqa: E402
from schemas.errors import BadRequestError, SnapshotError  # noqa: E402
from tests.support.arch_matrix import GREEDY, RouteHarness, Run, build, greedy  # noqa: E402
from tests.support.deepseek4 import (  # noqa: E402
    HCA_RATIO,
    PREFILL_CHUNK,
    WINDOW,
    close_all,
    open_hop,
    open_hops,
    prompt_tokens,
)

pytestmark = pytest.mark.slow

V4 = case("deepseek4")
SPLITS = [pytest.param(q, s, id=f"{q}-{s}") for q in V4.quants for s in V4.splits]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deepseek4")


_reference: dict[str, tuple[list[int], Run]] = {}


def reference(quant: str, models: Path) -> tuple[list[int], Run]:
    if quant not in _reference:
        whole = open_hop(build(V4, quant, models), models / "shards")
        try:
            tokens = prompt_tokens(whole)
            _reference[quant] = (tokens, greedy([whole], tokens))
        finally:
            whole.close()
    return _reference[quant]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def harness(module_nats: EmbeddedNats, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RouteHarness]:
    h = await RouteHarness.start(module_nats, tmp_path_factory.mktemp("home"), namespace="deepseek4",
                                 prefill_chunk=PREFILL_CHUNK)
    yield h
    await h.stop()


def test_the_prompt_reaches_every_cache(models: Path) -> None:
    tokens, whole = reference("F16", models)
    assert len(tokens) > max(WINDOW, 2 * HCA_RATIO)  # past the window; two HCA blocks complete during prefill
    assert len(tokens) <= PREFILL_CHUNK  # one prefill step, in the route as in the reference
    assert len(set(whole.picks)) > 1


@pytest.mark.parametrize(("quant", "split"), SPLITS)
def test_chain_equals_the_whole_model(quant: str, split: str, models: Path) -> None:
    tokens, whole = reference(quant, models)
    hops = open_hops(build(V4, quant, models), models / f"{quant}.shards", V4.splits[split])
    try:
        assert all(h.info.hidden_shape == [V4.dims.hc_mult, V4.dims.n_embd] for h in hops)
        chain = greedy(hops, tokens)
    finally:
        close_all(hops)
    assert chain.picks == whole.picks
    assert whole.max_diff(chain) == 0.0


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(("quant", "split"), SPLITS)
async def test_route_through_real_nodes_equals_the_whole_model(quant: str, split: str, models: Path,
                                                               harness: RouteHarness) -> None:
    tokens, whole = reference(quant, models)
    hops = open_hops(build(V4, quant, models), models / f"{quant}.shards", V4.splits[split])
    try:
        got, route = await harness.route(hops, tokens)
    finally:
        close_all(hops)
    assert len(route) == len(hops) == len(ranges(V4.splits[split])) and len(set(route)) == len(hops)
    assert got.picks == whole.picks
    assert whole.max_diff(got) == 0.0


def _tail_logits(head_hidden: np.ndarray[Any, np.dtype[np.float32]], hops: list[LlamaCppBackend],
                 tokens: list[int]) -> np.ndarray[Any, np.dtype[np.float32]]:
    tail = hops[-1]
    tail.open_session("t", prompt_tokens=tokens, sampling=GREEDY)
    try:
        out = tail.step([StepInput("t", 0, hidden=head_hidden, sample=True)])
        assert out[0].token is not None
        return tail.last_logits("t")
    finally:
        tail.close_session("t")


def test_the_hop_carries_four_distinct_streams_and_needs_them(models: Path) -> None:
    tokens, whole = reference("F16", models)
    hops = open_hops(build(V4, "F16", models), models / "F16.shards", V4.splits["2-way"])
    try:
        head = hops[0]
        head.open_session("h", prompt_tokens=tokens, sampling=GREEDY)
        try:
            hidden = head.step([StepInput("h", 0, tokens=tokens, sample=True)])[0].hidden
        finally:
            head.close_session("h")
        assert hidden is not None and hidden.shape == (len(tokens), V4.dims.hc_mult, V4.dims.n_embd)
        streams = hidden.transpose(1, 0, 2)
        assert all(not np.array_equal(streams[0], s) for s in streams[1:])  # not one stream repeated
        exact = _tail_logits(hidden, hops, tokens)
        mean = np.repeat(hidden.mean(axis=1, keepdims=True), V4.dims.hc_mult, axis=1)
        averaged = _tail_logits(mean.astype(np.float32), hops, tokens)
    finally:
        close_all(hops)
    assert np.array_equal(exact, whole.logits[0])  # the first pick's logits, as the whole model computed them
    # Random weights mix the streams only mildly (the tiny model's seed 16 gives ~2e-3): enough to tell them apart.
    assert float(np.abs(averaged - exact).max()) > 1e-4


def test_a_cut_taking_hash_layers_off_the_head_is_refused(models: Path) -> None:
    path = build(V4, "F16", models)
    for a, b, names in ((0, 2, "layers 2..2 would go to a shard fed hidden states"),
                        (2, 10, "this shard would take layers 2..2 of them")):
        with pytest.raises(BadRequestError) as refused:
            open_hop(path, models / "refused", a, b).close()
        message = refused.value.message
        assert f"[{a}, {b})" in message and "layers 0..2 route experts by token id" in message and names in message


def test_a_shard_without_a_csa_layer_is_refused(models: Path) -> None:
    with pytest.raises(BadRequestError) as refused:
        open_hop(build(V4, "F16", models), models / "refused", 3, 4).close()
    assert "no CSA (compress ratio 4) layer" in refused.value.message
    assert "layers 3..3" in refused.value.message


def _step(hops: list[LlamaCppBackend], session: str, item: StepInput) -> tuple[int, np.ndarray[Any, Any]]:
    outs = hops[0].step([item])
    for hop in hops[1:]:
        outs = hop.step([StepInput(session, item.start_position, hidden=outs[0].hidden, sample=True)])
    token = outs[0].token
    assert token is not None
    return token, hops[-1].last_logits(session)


def _decode(hops: list[LlamaCppBackend], session: str, start: int, tokens: list[int]) -> list[np.ndarray[Any, Any]]:
    return [_step(hops, session, StepInput(session, start + i, tokens=[t], sample=True))[1]
            for i, t in enumerate(tokens)]


def test_rejected_positions_roll_back_within_the_ring_and_deeper_cuts_are_refused(models: Path) -> None:
    """Speculation's rollback (issue #20) on V4: the backend gives the cache a rollback ring as deep as a verify
    window; dropping the last 3 positions and computing them again gives the same logits, bit for bit."""
    tokens, whole = reference("F16", models)
    hops = open_hops(build(V4, "F16", models), models / "F16.shards", V4.splits["2-way"])
    try:
        for h in hops:
            h.open_session("r", prompt_tokens=tokens, sampling=GREEDY)
        _step(hops, "r", StepInput("r", 0, tokens=tokens, sample=True))
        first = _decode(hops, "r", len(tokens), whole.picks[:5])
        end = len(tokens) + 5
        for h in hops:
            h.truncate("r", end - 3)
        again = _decode(hops, "r", end - 3, whole.picks[2:5])
        with pytest.raises(SnapshotError) as refused:
            hops[0].truncate("r", 10)
        assert "drops at most the last" in refused.value.message
    finally:
        close_all(hops)
    assert all(np.array_equal(a, b) for a, b in zip(first[2:], again, strict=True))
    assert np.array_equal(first[0], whole.logits[1])


def test_a_whole_sequence_snapshot_rebuilds_every_hop_exactly(models: Path) -> None:
    """Snapshots and repair on V4: each hop exports its session's whole KV (compressor state included), fresh
    sessions import it and decode on with the logits of the uninterrupted run; a range after 0 is refused."""
    tokens, whole = reference("F16", models)
    hops = open_hops(build(V4, "F16", models), models / "F16.shards", V4.splits["3-way"])
    try:
        for h in hops:
            h.open_session("a", prompt_tokens=tokens, sampling=GREEDY)
        _step(hops, "a", StepInput("a", 0, tokens=tokens, sample=True))
        _decode(hops, "a", len(tokens), whole.picks[:2])
        end = len(tokens) + 2
        blobs = [h.export_kv("a", 0, end) for h in hops]
        with pytest.raises(SnapshotError) as refused:
            hops[1].export_kv("a", 8, end)
        assert "exports only a whole sequence" in refused.value.message
        for h, blob in zip(hops, blobs, strict=True):
            h.close_session("a")
            h.open_session("b", prompt_tokens=tokens, sampling=GREEDY)
            h.import_kv("b", [blob], end)
            assert h.kv_continues("b")
        hops[-1].replay_sampled("b", whole.picks[:3])
        rebuilt = _decode(hops, "b", end, whole.picks[2:5])
    finally:
        close_all(hops)
    assert all(np.array_equal(a, b) for a, b in zip(whole.logits[3:6], rebuilt, strict=True))
