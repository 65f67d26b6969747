"""LayerCapture on the real bundled Gemma 3 270M through real llama.cpp.

What is proven here:
* the captured tensor is the residual stream after the chosen layer: applying output_norm and the (tied) lm_head to
  the capture of the last layer in numpy gives llama.cpp's own logits (up to its Q8 activation rounding);
* shard GGUFs (``artifacts.shard.write_shard``) chained by LayerCapture -> ``llama_batch.embd`` reproduce the full
  model's prompt logits bit for bit, for 2- and 3-way splits, across several ubatches, for two interleaved
  sequences in one batch, and for a decode step that reads each shard's own KV;
* failures (rows missing, too many rows, no such layer) surface from ``take()`` as ``BackendError``.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

from llama_cpp import _logger  # noqa: E402

from actors.backends.ggml_capture import LayerCapture  # noqa: E402
from schemas.errors import BackendError  # noqa: E402

pytestmark = pytest.mark.slow

N_CTX = 256
PROMPT = "The capital of France is Paris. The capital of Italy is"
OTHER_PROMPT = "<start_of_turn>user\nName three colours.<end_of_turn>\n<start_of_turn>model\n"

F32 = npt.NDArray[np.float32]


@dataclasses.dataclass
class Stage:
    """One llama.cpp model + context: a whole model or a shard, optionally capturing its last layer."""

    model: object
    ctx: object
    n_embd: int
    n_layer: int
    n_vocab: int
    capture: LayerCapture | None

    def run(self, *, pos: Sequence[int], seq: Sequence[int], tokens: Sequence[int] | None = None,
            hidden: F32 | None = None) -> F32:
        """Decode one batch with every row as an output: the captured hidden rows, or (no capture) the logits."""
        n = len(pos)
        batch = llama_cpp.llama_batch_init(n, self.n_embd if hidden is not None else 0, 1)
        try:
            batch.n_tokens = n
            if hidden is not None:
                src = np.ascontiguousarray(hidden, dtype=np.float32)
                assert src.shape == (n, self.n_embd)
                ctypes.memmove(batch.embd, src.ctypes.data, src.nbytes)
            else:
                assert tokens is not None and len(tokens) == n
                for i, t in enumerate(tokens):
                    batch.token[i] = t
            for i in range(n):
                batch.pos[i], batch.n_seq_id[i], batch.logits[i] = pos[i], 1, 1
                batch.seq_id[i][0] = seq[i]
            if self.capture is not None:
                self.capture.arm(n)
            rc = llama_cpp.llama_decode(self.ctx, batch)
        finally:
            llama_cpp.llama_batch_free(batch)
        assert rc == 0, f"llama_decode returned {rc}"
        if self.capture is not None:
            return self.capture.take()
        return np.stack([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                         for i in range(n)]).copy()

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)

    def close(self) -> None:
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


def open_stage(path: Path, *, capture_layer: int | None = None, capture_last: bool = False, n_ubatch: int = 512,
               kv_unified: bool = True, stop_after: bool = True, count_asks: bool = False) -> Stage:
    """Load ``path`` into a context; capture ``capture_layer`` (or the last layer with ``capture_last``)."""
    _logger.set_verbose(False)
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    assert model, f"llama.cpp could not load {path}"
    n_embd, n_layer = llama_cpp.llama_model_n_embd(model), llama_cpp.llama_model_n_layer(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    layer = n_layer - 1 if capture_last else capture_layer
    capture = None if layer is None else LayerCapture(layer, n_embd, stop_after=stop_after, count_asks=count_asks)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = N_CTX, N_CTX, n_ubatch, 2
    params.n_threads = params.n_threads_batch = 2
    params.kv_unified, params.no_perf = kv_unified, True
    if capture is not None:
        capture.install(params)
    ctx = llama_cpp.llama_init_from_model(model, params)
    assert ctx, f"llama.cpp could not make a context for {path}"
    return Stage(model, ctx, n_embd, n_layer, n_vocab, capture)


def tokenize(stage: Stage, text: str) -> list[int]:
    vocab = llama_cpp.llama_model_get_vocab(stage.model)
    raw = text.encode()
    buf = (llama_cpp.llama_token * N_CTX)()
    n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, N_CTX, True, True)
    assert 0 < n <= N_CTX
    return list(buf[:n])


def run_chain(stages: Sequence[Stage], *, tokens: Sequence[int], pos: Sequence[int], seq: Sequence[int]) -> F32:
    """Head by tokens, every later stage by the previous stage's captured rows; returns the tail's logits."""
    out = stages[0].run(tokens=tokens, pos=pos, seq=seq)
    for stage in stages[1:]:
        out = stage.run(hidden=out, pos=pos, seq=seq)
    return out


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
    shard = pytest.importorskip("artifacts.shard")
    out = tmp_path_factory.mktemp("shards")
    for start, end in ((0, 12), (12, 18), (0, 6), (6, 12)):
        shard.write_shard(gemma_path, out / f"shard-{start}-{end}.gguf", start, end)
    return out


def open_chain(shard_dir: Path, bounds: Sequence[int], **options: object) -> list[Stage]:
    ranges = list(zip(bounds[:-1], bounds[1:], strict=True))
    return [open_stage(shard_dir / f"shard-{a}-{b}.gguf", capture_last=b != bounds[-1], **options)  # type: ignore[arg-type]
            for a, b in ranges]


def fresh(stages: Sequence[Stage]) -> None:
    for stage in stages:
        stage.clear()


# --- the capture itself ------------------------------------------------------------------------------------------


def rms_norm_then_lm_head(hidden: F32, gemma_path: Path) -> npt.NDArray[np.float64]:
    """output_norm + tied lm_head in float64 numpy, from the GGUF's own tensors."""
    reader = gguf.GGUFReader(gemma_path)
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors["token_embd.weight"]
    lm_head = gguf.quants.dequantize(embd.data, embd.tensor_type).astype(np.float64)
    norm = np.asarray(tensors["output_norm.weight"].data, dtype=np.float64)
    eps = float(reader.fields["gemma3.attention.layer_norm_rms_epsilon"].parts[-1][0])
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
    reference = rms_norm_then_lm_head(hidden, gemma_path)
    # llama.cpp rounds activations to Q8_0 before the Q8_0 lm_head: close, not equal. A row off by one position or
    # another layer's output misses by far more than this.
    scale = np.abs(logits).max()
    assert np.abs(reference - logits).max() < 0.03 * scale
    assert (reference.argmax(axis=-1) == logits.argmax(axis=-1)).all()
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


@pytest.mark.parametrize("bounds", SPLITS, ids=lambda b: "+".join(f"[{x},{y})" for x, y in zip(b[:-1], b[1:])))
def test_shards_reproduce_prompt_logits_and_a_decode_step_exactly(shard_dir: Path, full: Stage,
                                                                  bounds: tuple[int, ...]) -> None:
    stages = open_chain(shard_dir, bounds)
    try:
        assert [s.n_layer for s in stages] == [b - a for a, b in zip(bounds[:-1], bounds[1:])]
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
    stages = open_chain(shard_dir, (0, 6, 12, 18), n_ubatch=8)
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
    stages = open_chain(shard_dir, (0, 12, 18))
    try:
        a, b = tokenize(whole, PROMPT), tokenize(whole, OTHER_PROMPT)
        m = min(len(a), len(b))
        tokens = [t for pair in zip(a[:m], b[:m]) for t in pair]
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
