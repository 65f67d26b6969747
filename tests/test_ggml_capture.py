"""LayerCapture on the real bundled Gemma 3 270M through real llama.cpp.

What is proven here:
* the captured tensor is the residual stream after the chosen layer: applying output_norm and the (tied) lm_head to
  the capture of the last layer in numpy gives llama.cpp's own logits (up to its Q8 activation rounding);
* shard GGUFs (``artifacts.shard.write_shard``) chained by LayerCapture -> ``llama_batch.embd`` reproduce the full
  model's prompt logits bit for bit, for 2- and 3-way splits, across several ubatches, for two interleaved
  sequences in one batch, and for a decode step that reads each shard's own KV;
* with ``kv_unified=False`` captured rows come grouped by sequence (why the module demands ``kv_unified=True``);
* failures (rows missing, too many rows, no such layer) surface from ``take()`` as ``BackendError``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

from artifacts.gguf_layout import read_layout  # noqa: E402
from artifacts.shard import write_shard  # noqa: E402
from schemas.errors import BackendError  # noqa: E402
from tests.support.llama_stage import F32, Stage, open_chain, open_stage, run_chain, tokenize  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is Paris. The capital of Italy is"
OTHER_PROMPT = "<start_of_turn>user\nName three colours.<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def full(gemma_path: Path) -> Iterator[Stage]:
    stage = open_stage(gemma_path, capture_last=False)
    yield stage
    stage.close()


@pytest.fixture(scope="module")
def full_captured(gemma_path: Path) -> Iterator[Stage]:
    stage = open_stage(gemma_path, capture_last=True, stop_after=False)
    yield stage
    stage.close()


@pytest.fixture(scope="module")
def shard_dir(gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    for start, end in ((0, 12), (12, 18), (0, 6), (6, 12)):
        write_shard(gemma_path, out / f"shard-{start}-{end}.gguf", start, end)
    return out


def shard_chain(shard_dir: Path, bounds: Sequence[int], **options: object) -> list[Stage]:
    paths = [shard_dir / f"shard-{a}-{b}.gguf" for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return open_chain(paths, **options)


# --- the capture itself ------------------------------------------------------------------------------------------


def rms_norm_then_lm_head(hidden: F32, gemma_path: Path, vocab_ids: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
    """output_norm + the tied lm_head rows ``vocab_ids``, in float64 numpy from the GGUF's own tensors."""
    layout = read_layout(gemma_path)
    tensors = {t.name: t for t in layout.tensors}
    embd, norm_t = tensors["token_embd.weight"], tensors["output_norm.weight"]
    n_vocab = embd.shape[1]
    rows = np.memmap(gemma_path, dtype=np.uint8, mode="r", offset=embd.offset, shape=(n_vocab, embd.size // n_vocab))
    lm_head = gguf.quants.dequantize(np.asarray(rows[vocab_ids]), embd.ggml_type).astype(np.float64)
    norm = np.fromfile(gemma_path, dtype=np.float32, count=norm_t.shape[0], offset=norm_t.offset).astype(np.float64)
    eps = float(layout.value("gemma3.attention.layer_norm_rms_epsilon"))
    x = hidden.astype(np.float64)
    normed = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * norm
    return normed @ lm_head.T  # type: ignore[no-any-return]


def test_captured_last_layer_is_the_residual_llama_cpp_turns_into_logits(full: Stage, full_captured: Stage,
                                                                         gemma_path: Path) -> None:
    tokens = tokenize(full, PROMPT)
    pos, seq = list(range(len(tokens))), [0] * len(tokens)
    full.clear()
    full_captured.clear()
    logits = full.run(tokens=tokens, pos=pos, seq=seq)
    hidden = full_captured.run(tokens=tokens, pos=pos, seq=seq)

    assert hidden.shape == (len(tokens), full.n_embd) and hidden.dtype == np.float32
    assert np.isfinite(hidden).all() and np.abs(hidden).max() > 0
    # Every row's top token plus a random sample of the vocabulary (the whole lm_head would be 0.7 GB as float32).
    rng = np.random.default_rng(0)
    ids = np.unique(np.concatenate([logits.argmax(axis=-1), rng.choice(full.n_vocab, 4096, replace=False)]))
    reference = rms_norm_then_lm_head(hidden, gemma_path, ids)
    # llama.cpp rounds activations to Q8_0 before the Q8_0 lm_head: close, not equal. A row off by one position or
    # another layer's output misses by far more than this.
    scale = np.abs(logits[:, ids]).max()
    assert np.abs(reference - logits[:, ids]).max() < 0.03 * scale
    assert (ids[reference.argmax(axis=-1)] == logits.argmax(axis=-1)).all()
    stats = full_captured.capture.stats if full_captured.capture else None
    assert stats is not None and stats.captures >= 1 and stats.rows >= len(tokens)


def test_stop_after_skips_the_rest_of_the_graph_and_keeps_the_capture(gemma_path: Path, full: Stage) -> None:
    tokens = tokenize(full, PROMPT)
    pos, seq = list(range(len(tokens))), [0] * len(tokens)
    stopping = open_stage(gemma_path, capture_layer=5, stop_after=True, count_asks=True)
    going_on = open_stage(gemma_path, capture_layer=5, stop_after=False, count_asks=True)
    try:
        stopped = stopping.run(tokens=tokens, pos=pos, seq=seq)
        continued = going_on.run(tokens=tokens, pos=pos, seq=seq)
        assert stopping.capture is not None and going_on.capture is not None
        # Same computation up to layer 5 either way, so the same bits.
        assert np.array_equal(stopped, continued)
        # The scheduler asks node by node: after a stop it asks about nothing past l_out-5.
        assert 0 < stopping.capture.stats.ask_calls < going_on.capture.stats.ask_calls
        # Layer 5's output is not the final residual (the full model's last-layer capture of the same prompt).
        last = open_stage(gemma_path, capture_last=True)
        try:
            assert np.abs(last.run(tokens=tokens, pos=pos, seq=seq) - stopped).max() > 1.0
        finally:
            last.close()
    finally:
        stopping.close()
        going_on.close()


def test_take_reports_missing_and_surplus_rows(gemma_path: Path) -> None:
    stage = open_stage(gemma_path, capture_layer=3)
    try:
        assert stage.capture is not None
        tokens = tokenize(stage, PROMPT)
        batch_rows = len(tokens)
        # arm() for fewer rows than the ubatch brings: the copy is refused, take() says why.
        stage.capture.arm(batch_rows - 1)
        token_array = (llama_cpp.llama_token * batch_rows)(*tokens)
        assert llama_cpp.llama_decode(stage.ctx, llama_cpp.llama_batch_get_one(token_array, batch_rows)) == 0
        with pytest.raises(BackendError, match="room for"):
            stage.capture.take()
        with pytest.raises(BackendError, match="without arm"):
            stage.capture.take()
    finally:
        stage.close()
    ghost = open_stage(gemma_path, capture_layer=40)  # no such layer: never claimed, nothing captured
    try:
        tokens = tokenize(ghost, PROMPT)
        with pytest.raises(BackendError, match=f"captured 0 of {len(tokens)} rows"):
            ghost.run(tokens=tokens, pos=list(range(len(tokens))), seq=[0] * len(tokens))
    finally:
        ghost.close()


# --- shards chained through captures: exact --------------------------------------------------------------------

SPLITS = [(0, 12, 18), (0, 6, 12, 18)]


def split_id(bounds: Sequence[int]) -> str:
    return "+".join(f"[{a},{b})" for a, b in zip(bounds[:-1], bounds[1:], strict=True))


@pytest.mark.parametrize("bounds", SPLITS, ids=split_id)
def test_shards_reproduce_prompt_logits_and_a_decode_step_exactly(shard_dir: Path, full: Stage,
                                                                  bounds: tuple[int, ...]) -> None:
    stages = shard_chain(shard_dir, bounds)
    try:
        assert [s.n_layer for s in stages] == [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        tokens = tokenize(full, PROMPT)
        n = len(tokens)
        full.clear()
        expected = full.run(tokens=tokens, pos=list(range(n)), seq=[0] * n)
        got = run_chain(stages, tokens=tokens, pos=list(range(n)), seq=[0] * n)
        assert got.shape == expected.shape
        assert np.abs(got - expected).max() == 0.0

        # One decode step: each shard attends over the prompt KV it kept itself (without it, no exact match).
        token = int(expected[-1].argmax())
        expected_step = full.run(tokens=[token], pos=[n], seq=[0])
        got_step = run_chain(stages, tokens=[token], pos=[n], seq=[0])
        assert np.abs(got_step - expected_step).max() == 0.0
    finally:
        for s in stages:
            s.close()


def test_shards_exact_across_several_ubatches(shard_dir: Path, gemma_path: Path) -> None:
    """A ubatch of 8 splits the prompt: each ubatch's capture is appended in order."""
    whole = open_stage(gemma_path, n_ubatch=8)
    stages = shard_chain(shard_dir, (0, 6, 12, 18), n_ubatch=8)
    try:
        tokens = tokenize(whole, OTHER_PROMPT + PROMPT)
        n = len(tokens)
        assert n > 2 * 8
        expected = whole.run(tokens=tokens, pos=list(range(n)), seq=[0] * n)
        got = run_chain(stages, tokens=tokens, pos=list(range(n)), seq=[0] * n)
        assert stages[0].capture is not None and stages[0].capture.stats.captures == -(-n // 8)
        assert np.abs(got - expected).max() == 0.0
    finally:
        whole.close()
        for s in stages:
            s.close()


def test_shards_exact_with_two_sequences_interleaved_in_one_batch(shard_dir: Path, gemma_path: Path) -> None:
    """kv_unified=True keeps batch order in the capture, so rows meet the right sequence in the next shard."""
    whole = open_stage(gemma_path)
    stages = shard_chain(shard_dir, (0, 12, 18))
    try:
        a, b = tokenize(whole, PROMPT), tokenize(whole, OTHER_PROMPT)
        m = min(len(a), len(b))
        tokens = [t for pair in zip(a[:m], b[:m], strict=True) for t in pair]
        pos = [p for p in range(m) for _ in (0, 1)]
        seq = [0, 1] * m
        expected = whole.run(tokens=tokens, pos=pos, seq=seq)
        got = run_chain(stages, tokens=tokens, pos=pos, seq=seq)
        assert np.abs(got - expected).max() == 0.0
        # The two sequences really differ row by row, so a swapped or grouped row order could not pass.
        assert np.abs(expected[0::2] - expected[1::2]).max() > 1.0
    finally:
        whole.close()
        for s in stages:
            s.close()


def test_without_kv_unified_rows_come_grouped_by_sequence(gemma_path: Path) -> None:
    """Why LayerCapture's docs demand kv_unified=True: otherwise llama.cpp's ubatch groups rows by sequence."""
    unified = open_stage(gemma_path, capture_last=True)
    split = open_stage(gemma_path, capture_last=True, kv_unified=False)
    try:
        a, b = tokenize(unified, PROMPT), tokenize(unified, OTHER_PROMPT)
        m = min(len(a), len(b))
        tokens = [t for pair in zip(a[:m], b[:m], strict=True) for t in pair]
        pos, seq = [p for p in range(m) for _ in (0, 1)], [0, 1] * m
        in_batch_order = unified.run(tokens=tokens, pos=pos, seq=seq)
        rows = split.run(tokens=tokens, pos=pos, seq=seq)
        grouped = np.concatenate([in_batch_order[0::2], in_batch_order[1::2]])
        # Per-sequence KV streams change the attention kernels' layout, so equal only up to float rounding.
        assert np.abs(rows - grouped).max() < 1e-4 * np.abs(grouped).max()
        assert np.abs(rows - in_batch_order).max() > 0.5 * np.abs(grouped).max()
    finally:
        unified.close()
        split.close()


# --- the native (C) name check and its fallback --------------------------------------------------------------------


def test_the_native_callback_captures_the_same_bits_as_the_python_one(gemma_path: Path, full: Stage) -> None:
    import actors.backends.llamacpp.ggml_capture as capture_module

    if capture_module._native(capture_module.default_native_dir()) is None:
        pytest.skip("no working C compiler on this machine: the Python callback is the only one")
    tokens = tokenize(full, PROMPT)
    pos, seq = list(range(len(tokens))), [0] * len(tokens)
    native = open_stage(gemma_path, capture_layer=7)
    python = open_stage(gemma_path, capture_layer=7, count_asks=True)  # counting always uses the Python callback
    try:
        assert native.capture is not None and native.capture.native
        assert python.capture is not None and not python.capture.native
        assert np.array_equal(native.run(tokens=tokens, pos=pos, seq=seq), python.run(tokens=tokens, pos=pos, seq=seq))
        assert native.capture.stats.captures == 1 and python.capture.stats.ask_calls > 0
    finally:
        native.close()
        python.close()


def test_the_native_callback_is_built_under_the_given_directory_and_home(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import actors.backends.llamacpp.ggml_capture as capture_module

    if capture_module._native(capture_module.default_native_dir()) is None:
        pytest.skip("no working C compiler on this machine: the Python callback is the only one")
    capture = capture_module.LayerCapture(3, 640, native_dir=tmp_path / "native")
    assert capture.native and [p.name for p in (tmp_path / "native").iterdir()] == [
        capture_module.native_library_path(tmp_path / "native").name]
    monkeypatch.setenv("SWARMROUTE_HOME", str(tmp_path / "home"))
    assert capture_module.default_native_dir() == tmp_path / "home" / "native"


def test_without_a_compiler_the_python_callback_is_used_with_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import actors.backends.llamacpp.ggml_capture as capture_module

    monkeypatch.setattr(capture_module.sysconfig, "get_config_var", lambda name: "/nonexistent/cc")
    capture_module._native.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=capture_module.__name__):
            capture = capture_module.LayerCapture(3, 640, native_dir=tmp_path)
        assert not capture.native
        assert "could not compile the native layer-capture callback" in caplog.text
        assert list(tmp_path.iterdir()) == []  # nothing half-written left behind
    finally:
        capture_module._native.cache_clear()  # the next capture compiles (or finds) the real one again
