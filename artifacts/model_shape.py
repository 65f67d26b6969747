"""What a layer planner needs to know about a model: per-layer weight bytes, per-layer cache growth, the shape of
what crosses a layer boundary, and which layer boundaries must not (or should not) become node boundaries.

Built from a GGUF or manifest (``artifacts.gguf_shape``) or from a hand-written shape file (``artifacts.shape_file``)
for models we cannot download; ``artifacts.layer_split`` only ever sees this description.
"""

from __future__ import annotations

import dataclasses
import math

STATE_ITEMSIZE = 4
"""Recurrent and compressor state is kept in f32 by llama.cpp whatever the KV cache type (see docs/models/)."""


@dataclasses.dataclass(frozen=True, slots=True)
class KVTerm:
    """One cache a layer grows while a session runs: ``elements`` values per row, one row per ``tokens_per_row``
    positions, keeping only the last ``window`` positions when set (sliding-window attention)."""

    elements: int
    """Values stored per row (e.g. ``2 * n_kv_heads * head_dim`` for plain attention, K and V together)."""
    tokens_per_row: int = 1
    """Positions pooled into one row: 1 for ordinary KV, 4 or 128 for DeepSeek-V4's compressed caches."""
    window: int | None = None
    """Only the last ``window`` positions are kept; ``None`` keeps all of them."""

    def rows(self, context: int) -> int:
        positions = context if self.window is None else min(context, self.window)
        return math.ceil(positions / self.tokens_per_row)

    def elements_per_token(self) -> float:
        """Long-context growth: a windowed cache stops growing, so it contributes nothing."""
        return 0.0 if self.window is not None else self.elements / self.tokens_per_row


@dataclasses.dataclass(frozen=True, slots=True)
class LayerShape:
    index: int
    kind: str
    """Attention kind, for humans: full, sliding, mla, compressed-sparse, heavily-compressed, recurrent, mtp..."""
    weight_bytes: int
    kv: tuple[KVTerm, ...] = ()
    state_elements: int = 0
    """Per-session state that does not grow with context (recurrent state, compressor frontier), in f32 values."""

    def kv_bytes(self, context: int, kv_itemsize: float) -> int:
        cache = sum(t.rows(context) * t.elements for t in self.kv) * kv_itemsize
        return math.ceil(cache) + self.state_elements * STATE_ITEMSIZE

    def kv_bytes_per_token(self, kv_itemsize: float) -> float:
        return sum(t.elements_per_token() for t in self.kv) * kv_itemsize


@dataclasses.dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers ``[start, end)`` that should share a node. ``hard`` groups are never cut; soft ones are cut only when
    nothing else fits, with a warning carrying ``reason``."""

    start: int
    end: int
    hard: bool
    reason: str
    carry_bytes: int = 0
    """Bytes per position a frame would have to carry besides the hidden state if a hard group were cut anyway
    (top-k indices, token ids); 0 means the group cannot be cut at all."""

    def splits_at(self, boundary: int) -> bool:
        return self.start < boundary < self.end


@dataclasses.dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    arch: str
    hidden_size: int
    hop_shape: tuple[int, ...]
    """Values per position that cross a node boundary (``(hidden,)``, or ``(streams, hidden)`` for mHC models)."""
    context_length: int
    """Longest context the model was trained for."""
    layers: tuple[LayerShape, ...]
    head_bytes: int = 0
    """Weights only the first node needs (token embedding)."""
    tail_bytes: int = 0
    """Weights only the last node needs (final norm, lm_head; the embedding again when tied or used by MTP)."""
    shared_bytes: int = 0
    """Weights every node needs (e.g. rope_freqs)."""
    tail_needs_embedding: bool = False
    """The tail also holds the token embedding (tied lm_head, or MTP re-embedding the drafted token)."""
    mtp_layers: tuple[LayerShape, ...] = ()
    """Multi-token-prediction / drafter blocks: they read the last layer's output, so they sit with the tail."""
    groups: tuple[LayerGroup, ...] = ()
    source: str = ""
    """Where the description came from (file path, quant profile)."""
    notes: tuple[str, ...] = ()

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def weight_bytes(self, start: int, end: int) -> int:
        return sum(layer.weight_bytes for layer in self.layers[start:end])

    def kv_bytes(self, start: int, end: int, context: int, kv_itemsize: float) -> int:
        return sum(layer.kv_bytes(context, kv_itemsize) for layer in self.layers[start:end])

    def kv_bytes_per_token(self, start: int, end: int, kv_itemsize: float) -> float:
        return sum(layer.kv_bytes_per_token(kv_itemsize) for layer in self.layers[start:end])

    def total_weight_bytes(self) -> int:
        mtp = sum(m.weight_bytes for m in self.mtp_layers)
        return self.weight_bytes(0, self.n_layers) + self.head_bytes + self.tail_bytes + self.shared_bytes + mtp
