"""A thin driver over llama-cpp-python's low-level API for tests and benchmarks of layer-range execution.

A ``Stage`` is one model file (whole model or shard GGUF) with one context, optionally with a ``LayerCapture``
on a layer; ``run_chain`` feeds the head tokens and every later stage the previous stage's captured rows through
``llama_batch.embd``. Every row is requested as an output (non-tail shards need that: llama.cpp prunes the last
layer to output rows), and ``kv_unified`` defaults to True so captured rows come back in batch order.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt
from llama_cpp import _logger

from actors.backends.llamacpp.cpu_buffers import buffer_types
from actors.backends.llamacpp.ggml_capture import LayerCapture

F32 = npt.NDArray[np.float32]


@dataclasses.dataclass
class Stage:
    """One llama.cpp model + context: a whole model or a shard, optionally capturing one layer."""

    model: Any
    ctx: Any
    n_embd: int
    n_layer: int
    n_vocab: int
    n_ctx: int
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
                if src.shape != (n, self.n_embd):
                    raise ValueError(f"hidden has shape {src.shape}, expected {(n, self.n_embd)}")
                ctypes.memmove(batch.embd, src.ctypes.data, src.nbytes)
            elif tokens is not None and len(tokens) == n:
                for i, t in enumerate(tokens):
                    batch.token[i] = t
            else:
                raise ValueError("pass tokens or hidden, one row per position")
            for i in range(n):
                batch.pos[i], batch.n_seq_id[i], batch.logits[i] = pos[i], 1, 1
                batch.seq_id[i][0] = seq[i]
            if self.capture is not None:
                self.capture.arm(n)
            rc = llama_cpp.llama_decode(self.ctx, batch)
        finally:
            llama_cpp.llama_batch_free(batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        if self.capture is not None:
            return self.capture.take()
        return np.stack([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                         for i in range(n)]).copy()

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)

    def close(self) -> None:
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


def open_stage(path: Path, *, capture_layer: int | None = None, capture_last: bool = False, n_ctx: int = 256,
               n_ubatch: int = 512, n_threads: int = 2, kv_unified: bool = True, stop_after: bool = True,
               count_asks: bool = False) -> Stage:
    """Load ``path`` into a context; capture ``capture_layer`` (or the file's last layer with ``capture_last``)."""
    _logger.set_verbose(False)
    llama_cpp.llama_backend_init()
    buffer_types().allow_amx(False)  # as the node loads it (actors/backends/llamacpp/cpu_buffers.py)
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    n_embd, n_layer = llama_cpp.llama_model_n_embd(model), llama_cpp.llama_model_n_layer(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    layer = n_layer - 1 if capture_last else capture_layer
    capture = None if layer is None else LayerCapture(layer, n_embd, stop_after=stop_after, count_asks=count_asks)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, n_ctx, min(n_ubatch, n_ctx), 2
    params.n_threads = params.n_threads_batch = n_threads
    params.kv_unified, params.no_perf = kv_unified, True
    if capture is not None:
        capture.install(params)
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        llama_cpp.llama_model_free(model)
        raise RuntimeError(f"llama.cpp could not make a context for {path}")
    return Stage(model, ctx, n_embd, n_layer, n_vocab, n_ctx, capture)


def tokenize(stage: Stage, text: str) -> list[int]:
    """Token ids with BOS, special tokens parsed (the Gemma turn markers)."""
    vocab = llama_cpp.llama_model_get_vocab(stage.model)
    raw = text.encode()
    buf = (llama_cpp.llama_token * stage.n_ctx)()
    n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, stage.n_ctx, True, True)
    if not 0 < n <= stage.n_ctx:
        raise ValueError(f"tokenize gave {n} tokens for a {stage.n_ctx}-token context")
    return list(buf[:n])


def run_chain(stages: Sequence[Stage], *, tokens: Sequence[int], pos: Sequence[int], seq: Sequence[int]) -> F32:
    """Head by tokens, every later stage by the previous stage's captured rows; returns the tail's logits."""
    out = stages[0].run(tokens=tokens, pos=pos, seq=seq)
    for stage in stages[1:]:
        out = stage.run(hidden=out, pos=pos, seq=seq)
    return out


def open_chain(shard_paths: Sequence[Path], **options: Any) -> list[Stage]:
    """One stage per shard; every stage but the last captures its own last layer."""
    return [open_stage(p, capture_last=i < len(shard_paths) - 1, **options) for i, p in enumerate(shard_paths)]
