"""How to load and run one GGUF with llama.cpp: ``LlamaCppConfig``, the options of ``load_backend("llamacpp")``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import llama_cpp

__all__ = ["RESIDENT_PREFIXES", "LlamaCppConfig"]


RESIDENT_PREFIXES = 2
"""Finished sessions whose KV a node keeps in its context by default (issue #26)."""


@dataclasses.dataclass
class LlamaCppConfig:
    """How to load and run one GGUF."""

    model_path: Path
    """A whole-model GGUF, or a shard GGUF written by ``artifacts.shard.write_shard``."""

    n_ctx: int = 4096
    """Context per session (prompt + generated tokens); capped at the model's training context."""

    max_sessions: int = 4
    """Sessions holding KV at once: llama.cpp sequences in the shared context."""

    threads: int = 0
    """CPU threads for decode and prefill; 0 means every core."""

    n_batch: int = 512
    """Most positions one step may carry across its sessions (one ubatch, so one graph per step)."""

    layer_start: int | None = None
    layer_end: int | None = None
    """Serve layers ``[layer_start, layer_end)`` of a whole-model file: the shard GGUF is cut (once) into
    ``shard_dir``. ``None`` means the file's own range (the whole model, or what a shard file holds)."""

    shard_dir: Path | None = None
    """Where cut shards go; default ``<model dir>/<model stem>.shards``."""

    allow_unproven: bool = False
    """Cut an architecture ``artifacts.arch_support`` has not proven bit-exact (the user accepts the risk)."""

    flash_attn: bool = False
    """llama.cpp flash attention; off by default like llama-cpp-python's ``Llama``."""

    sha256: str | None = None
    """The loaded file's sha256 when already known (a verified artifact); otherwise it is computed at load."""

    verbose: bool = False
    """Let llama.cpp's own log through (it is chatty: off by default)."""

    native_dir: Path | None = None
    """Where the layer-capture callback is compiled and cached; default ``<SWARMROUTE_HOME>/native``."""

    max_draft: int = 8
    """Tail: the most drafts of one verify window (issue #20); the context keeps that many more logits rows per
    session (one vocabulary-wide row each)."""

    allow_amx: bool = False
    """Let ggml put weights in its AMX buffer type. Off: on some AMX CPUs the first matrix multiply there crashes
    the process (``actors/backends/llamacpp/cpu_buffers.py``); the CPU_REPACK path stays on either way."""

    extra_buffers: bool = True
    """Let ggml use its extra CPU buffer types (CPU_REPACK: weights repacked for its tiled GEMM kernels). Off: the
    plain kernels, which round differently; the node then advertises another build (``build_id``: its CPU buffers
    are part of it). Issue #28's spot checks across builds test against such a node."""

    batch_invariant: str = "off"
    """Which sessions' tokens do not depend on what else the node computes at the same time (issue #31): ``off``
    (none: one unified KV cache, every step in one ubatch, results move with the batch's shape), ``request`` (the
    sessions whose ``SamplingParams.batch_invariant`` asks) or ``all`` (``True``/``False`` mean all/off). Either
    of the last two keeps one KV stream per sequence (``kv_unified = false``) and computes each invariant session
    in passes of its own (``LlamaCppBackend._passes``). Off by default: 4 streams all invariant decode at about
    0.6x the aggregate rate (docs/llamacpp-backend.md, "Batch invariance")."""

    resident_prefixes: int = RESIDENT_PREFIXES
    """Finished sessions whose KV stays in the context for prefix reuse (``resident``): sequence ids beyond
    ``max_sessions``. They take no cells of their own: a running session that needs their cells evicts them. Each
    costs a sliding window of cells in a windowed model's SWA cache (llama.cpp sizes it per sequence)."""

    def __post_init__(self) -> None:
        self.model_path = Path(self.model_path)
        self.shard_dir = Path(self.shard_dir) if self.shard_dir is not None else None
        self.native_dir = Path(self.native_dir) if self.native_dir is not None else None
        mode: object = self.batch_invariant
        if isinstance(mode, bool):
            self.batch_invariant = "all" if mode else "off"
        if self.batch_invariant not in ("off", "request", "all"):
            raise ValueError(f"batch_invariant {self.batch_invariant!r}: expected off, request or all")
        if self.n_ctx < 1 or self.max_sessions < 1 or self.n_batch < 1 or self.threads < 0 \
                or self.resident_prefixes < 0:
            raise ValueError("n_ctx, max_sessions and n_batch must be positive and threads and resident_prefixes "
                             "non-negative")
        if self.n_seq_max > llama_cpp.llama_max_parallel_sequences():
            raise ValueError(f"max_sessions {self.max_sessions} + resident_prefixes {self.resident_prefixes} + 1 "
                             f"exceed llama.cpp's "
                             f"{llama_cpp.llama_max_parallel_sequences()} sequences")

    @property
    def kv_streams(self) -> bool:
        """One KV stream per sequence: the layout a session computed apart from the others needs."""
        return self.batch_invariant != "off"

    @property
    def n_seq_max(self) -> int:
        """Sequences of the context: one per session, one per resident prefix (issue #26), and the scratch
        sequence KV segments are exported and imported through (issue #18)."""
        return self.max_sessions + self.resident_prefixes + 1
