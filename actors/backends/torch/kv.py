"""One session's KV cache in and out of a torch shard (issue #18 snapshots, repair and prefix reuse; issue #20
rollback): export a range of positions as a blob, import blobs, truncate, copy a prefix into another session.

A session's cache is a transformers ``DynamicCache`` (``Shard.new_cache``) in which this node's layers are
``DynamicLayer`` (full attention: rows ``[0, position)``) or ``WindowLayer`` (sliding-window or chunked attention:
the last ``window - 1 + rollback`` positions); the other layers are empty ``DummyLayer`` placeholders.

A blob is raw tensor bytes behind a small little-endian header: ``magic, model tag, dtype, layer range, n_layers,
start, end``, then one record per layer ``index, window, first, rows, kv_heads, k_dim, v_dim``, then each layer's
keys and values, shape ``(kv_heads, rows, dim)`` in the cache's dtype, for positions ``[first, first + rows)``. A
full layer's rows are exactly ``[start, end)``. A window layer's are what it still held of that range when it was
exported: positions it had already let go are simply absent (``first > start``, possibly no rows at all). So an
import is checked as a whole: after the last blob every window layer must hold the ``window - 1`` positions before
``end`` (all of them below the window), which is everything a continuation from ``end`` reads. The header does not
checksum the tensor bytes: whoever stores or moves a blob checks it by hash (``actors.node.recovery.snapshots``).

Everything keeps the exact tensors (no recomputation, no dtype change), and attention is handed the same rows it
would have had without the round trip, so a session continues bit for bit. Not thread-safe: the backend calls
these under its lock, on its worker thread, between steps.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from schemas.errors import BackendError, BadRequestError, SnapshotError

_MAGIC = b"TKV1"
_HEAD = struct.Struct("<4s8sBIIIQQ")
"""magic, model tag, dtype code, layer start, layer end, the model's layer count, start, end."""
_LAYER = struct.Struct("<IIQQIII")
"""layer index, window (0: full attention), first position, rows, kv heads, key dim, value dim."""
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


class WindowLayer(DynamicSlidingWindowLayer):  # type: ignore[no-untyped-call]
    """A sliding-window (or chunked) layer's cache that keeps ``rollback`` positions beyond the ``window - 1`` the
    next position reads, so that ``truncate`` can go back that far. Attention gets exactly the rows transformers'
    own layer gives it (the mask is sized by ``get_mask_sizes``, inherited), so the outputs are the same bits
    whatever ``rollback``; with 0 this layer holds what transformers' does."""

    def __init__(self, sliding_window: int, rollback: int = 0) -> None:
        super().__init__(sliding_window=sliding_window)
        self.keep = sliding_window - 1 + rollback
        """Positions held at most."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # The mask was built from the length before this update: hand attention exactly that many rows.
        visible, _ = self.get_mask_sizes(key_states.shape[-2])
        self.cumulative_length += key_states.shape[-2]
        assert self.keys is not None and self.values is not None  # lazy_initialization set them
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        self.keys, self.values = _last(keys, self.keep), _last(values, self.keep)
        return _last(keys, visible), _last(values, visible)


@dataclasses.dataclass(frozen=True, slots=True)
class LayerSpec:
    index: int
    """Global layer index."""
    window: int
    """Sliding window (or attention chunk); 0 for full attention."""
    kv_heads: int
    k_dim: int
    v_dim: int


@dataclasses.dataclass(frozen=True, slots=True)
class KvLayout:
    """What this node's blobs hold and what it accepts: only blobs of the same model, layers and dtype."""

    tag: bytes
    """8 bytes naming the model (``TorchBackend``'s ``_model_tag``)."""
    start: int
    end: int
    n_layers: int
    dtype: torch.dtype
    layers: tuple[LayerSpec, ...]


def _last(t: torch.Tensor, n: int) -> torch.Tensor:
    """The last ``n`` rows (positions) of a ``(batch, heads, rows, dim)`` tensor; ``t[..., -0:, :]`` would be all."""
    return t[:, :, max(t.shape[-2] - n, 0):, :]


def _needed_from(window: int, position: int) -> int:
    """First position a window layer must hold for a continuation from ``position`` (which reads the ``window - 1``
    positions before it)."""
    return max(0, position - window + 1)


def _rows(layer: DynamicLayer) -> int:
    keys = layer.keys
    return int(keys.shape[-2]) if layer.is_initialized and keys is not None and keys.dim() == 4 else 0


def _span(layer: DynamicLayer) -> tuple[int, int]:
    """Positions ``[first, end)`` the layer holds."""
    rows = _rows(layer)
    end = int(layer.cumulative_length) if isinstance(layer, WindowLayer) else rows
    return end - rows, end


def _own(cache: DynamicCache, spec: LayerSpec) -> DynamicLayer:
    layer = cache.layers[spec.index]
    if not isinstance(layer, DynamicLayer) or isinstance(layer, DynamicSlidingWindowLayer) != bool(spec.window):
        raise BackendError(f"layer {spec.index} of the cache is a {type(layer).__name__}, not this shard's kind")
    if spec.window and not isinstance(layer, WindowLayer):
        raise BackendError(f"layer {spec.index} of the cache is not a WindowLayer (Shard.new_cache makes them)")
    return layer


def _held(layer: DynamicLayer, spec: LayerSpec, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's keys and values, ``(1, kv_heads, rows, dim)``, with 0 rows when it holds none."""
    if _rows(layer):
        assert layer.keys is not None and layer.values is not None
        return layer.keys, layer.values
    return (torch.empty((1, spec.kv_heads, 0, spec.k_dim), dtype=dtype),
            torch.empty((1, spec.kv_heads, 0, spec.v_dim), dtype=dtype))


def _assign(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor, end: int) -> None:
    if not layer.is_initialized:
        layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    if isinstance(layer, WindowLayer):
        layer.cumulative_length = end


def _raw(t: torch.Tensor) -> bytes:
    # Viewed as bytes first: numpy has no bfloat16.
    return bytes(t.contiguous().view(torch.uint8).numpy().tobytes())


def export(cache: DynamicCache, layout: KvLayout, start: int, end: int) -> bytes:
    """The blob of positions ``[start, end)`` (``end`` at most the session's position)."""
    records, payload = [], []
    with torch.inference_mode():
        for spec in layout.layers:
            layer = _own(cache, spec)
            first, held_end = _span(layer)
            if end > held_end:
                raise BackendError(f"layer {spec.index} holds positions [{first}, {held_end}), not [{start}, {end})")
            low = min(max(start, first), end)  # a window layer may have let the range's first positions go
            keys, values = _held(layer, spec, layout.dtype)
            keys, values = keys[0, :, low - first:end - first, :], values[0, :, low - first:end - first, :]
            if tuple(keys.shape) != (spec.kv_heads, end - low, spec.k_dim) or values.shape[-1] != spec.v_dim:
                raise BackendError(f"layer {spec.index} caches keys of shape {tuple(keys.shape)}, not the layout's")
            records.append(_LAYER.pack(spec.index, spec.window, low, end - low, spec.kv_heads, spec.k_dim,
                                       spec.v_dim))
            payload += [_raw(keys), _raw(values)]
    head = _HEAD.pack(_MAGIC, layout.tag, _DTYPE_CODES[layout.dtype], layout.start, layout.end, layout.n_layers,
                      start, end)
    return b"".join([head, *records, *payload])


@dataclasses.dataclass(slots=True)
class _Segment:
    start: int
    end: int
    rows: list[tuple[int, torch.Tensor, torch.Tensor]]
    """Per layer of the layout: first position, keys, values (``(1, kv_heads, rows, dim)``)."""


def _parse(blob: bytes, layout: KvLayout) -> _Segment:
    view = memoryview(blob)
    if len(view) < _HEAD.size:
        raise SnapshotError(f"a KV blob of {len(view)} bytes is shorter than its header")
    magic, tag, code, first_layer, end_layer, n_layers, start, end = _HEAD.unpack_from(view)
    if magic != _MAGIC or tag != layout.tag or n_layers != layout.n_layers:
        raise SnapshotError("not a torch KV blob of this model")
    if (first_layer, end_layer) != (layout.start, layout.end):
        raise SnapshotError(f"a KV blob of layers [{first_layer}, {end_layer}); this node holds "
                            f"[{layout.start}, {layout.end})")
    if code != _DTYPE_CODES[layout.dtype]:
        raise SnapshotError(f"a KV blob of dtype code {code}; this node caches {layout.dtype}")
    if not start < end:
        raise SnapshotError(f"a KV blob of positions [{start}, {end})")
    at = _HEAD.size + _LAYER.size * len(layout.layers)
    if len(view) < at:
        raise SnapshotError("a KV blob cut short in its layer records")
    element = torch.empty((), dtype=layout.dtype).element_size()
    segment = _Segment(start, end, [])
    for i, spec in enumerate(layout.layers):
        index, window, first, rows, heads, k_dim, v_dim = _LAYER.unpack_from(view, _HEAD.size + i * _LAYER.size)
        if (index, window, heads, k_dim, v_dim) != (spec.index, spec.window, spec.kv_heads, spec.k_dim, spec.v_dim):
            raise SnapshotError(f"record {i} of the KV blob is layer {index} (window {window}, {heads} heads of "
                                f"{k_dim}/{v_dim}); this node's is layer {spec.index} (window {spec.window}, "
                                f"{spec.kv_heads} heads of {spec.k_dim}/{spec.v_dim})")
        if first + rows != end or first < start or (not spec.window and first != start):
            raise SnapshotError(f"layer {index} of a KV blob of [{start}, {end}) holds [{first}, {first + rows})")
        tensors = []
        for dim in (k_dim, v_dim):
            size = heads * rows * dim * element
            if at + size > len(view):
                raise SnapshotError("a KV blob cut short in its tensors")
            # bytearray: a writable copy, which torch.frombuffer shares rather than copies again.
            flat = torch.frombuffer(bytearray(view[at:at + size]), dtype=torch.uint8) if size else \
                torch.empty(0, dtype=torch.uint8)
            tensors.append(flat.view(layout.dtype).reshape(1, heads, rows, dim))
            at += size
        segment.rows.append((first, tensors[0], tensors[1]))
    if at != len(view):
        raise SnapshotError(f"{len(view) - at} bytes after the last tensor of a KV blob")
    return segment


def load(cache: DynamicCache, layout: KvLayout, position: int, blobs: list[bytes], end: int) -> None:
    """Append ``blobs`` (consecutive ranges, the first starting at ``position``, the session's) so the cache ends
    at ``end``. All or nothing: ``SnapshotError`` leaves the cache as it was."""
    segments = [_parse(blob, layout) for blob in blobs]
    at = position
    for segment in segments:
        if segment.start != at:
            raise SnapshotError(f"a KV blob of positions [{segment.start}, {segment.end}) does not continue at {at}")
        at = segment.end
    if at != end:
        raise SnapshotError(f"the KV blobs end at position {at}, not {end}")
    planned = []
    with torch.inference_mode():
        for i, spec in enumerate(layout.layers):
            layer = _own(cache, spec)
            first, held_end = _span(layer)
            keys, values = _held(layer, spec, layout.dtype)
            for segment in segments:
                low, seg_keys, seg_values = segment.rows[i]
                if low == held_end:
                    keys, values = torch.cat([keys, seg_keys], dim=-2), torch.cat([values, seg_values], dim=-2)
                else:  # a window layer's blob without its range's first positions: what came before is stale
                    keys, values, first = seg_keys, seg_values, low
                held_end = segment.end
                if spec.window:
                    assert isinstance(layer, WindowLayer)
                    keys, values = _last(keys, layer.keep), _last(values, layer.keep)
                    first = held_end - int(keys.shape[-2])
            if spec.window and first > _needed_from(spec.window, end):
                raise SnapshotError(f"layer {spec.index} (window {spec.window}) would hold positions [{first}, "
                                    f"{end}); continuing from {end} reads [{_needed_from(spec.window, end)}, {end})")
            planned.append((layer, keys, values))
        for layer, keys, values in planned:
            _assign(layer, keys, values, end)


def truncate(cache: DynamicCache, layout: KvLayout, position: int) -> None:
    """Drop every layer's positions from ``position`` on. ``BadRequestError`` (and nothing dropped) when a window
    layer has already let go of positions a continuation from ``position`` reads: it keeps ``window - 1`` positions
    plus its rollback (``TorchConfig.kv_rollback``)."""
    layers = [(_own(cache, spec), spec) for spec in layout.layers]
    for layer, spec in layers:
        first, end = _span(layer)
        if spec.window and position < end and first > _needed_from(spec.window, position):
            raise BadRequestError(f"layer {spec.index} (window {spec.window}) holds positions [{first}, {end}): "
                                  f"it cannot go back to {position}, which reads from "
                                  f"{_needed_from(spec.window, position)} (kv_rollback sets how far it can)")
    with torch.inference_mode():
        for layer, spec in layers:
            first, end = _span(layer)
            if position < end:
                keys, values = _held(layer, spec, layout.dtype)
                _assign(layer, keys[:, :, :position - first, :], values[:, :, :position - first, :], position)


def reusable(cache: DynamicCache, layout: KvLayout, held: int, length: int) -> int:
    """``length`` (at most ``held``, the session's position) if another session can continue from the cache's first
    ``length`` positions, else 0: a window layer must still hold the ``window - 1`` positions before ``length``."""
    length = min(length, held)
    if length <= 0:
        return 0
    for spec in layout.layers:
        if spec.window and _span(_own(cache, spec))[0] > _needed_from(spec.window, length):
            return 0
    return length


def copy_prefix(source: DynamicCache, target: DynamicCache, layout: KvLayout, length: int) -> None:
    """Give ``target`` (empty) copies of the first ``length`` positions of ``source`` (``reusable`` says which
    lengths work). Copies, not views: a view would keep the source's whole tensors alive after it closes, memory
    that ``kv_bytes_in_use`` would not count (no cache op writes in place, so sharing would be correct otherwise)."""
    with torch.inference_mode():
        for spec in layout.layers:
            layer, into = _own(source, spec), _own(target, spec)
            first, _ = _span(layer)
            keys, values = _held(layer, spec, layout.dtype)
            keys, values = keys[:, :, :length - first, :], values[:, :, :length - first, :]
            if isinstance(into, WindowLayer):
                keys, values = _last(keys, into.keep), _last(values, into.keep)
            _assign(into, keys.clone(), values.clone(), length)
