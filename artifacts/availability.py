"""What a stalled fetch is waiting for, in the words of a model: which layers (and which non-layer parts) have bytes
in pieces that this node still needs and no connected peer has."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from artifacts.shard import manifest_plan, needed_tensors
from schemas.manifest import ModelManifest


@dataclasses.dataclass(frozen=True, slots=True)
class Unseeded:
    layers: tuple[tuple[int, int], ...]
    """Maximal runs of layers with a missing tensor."""
    parts: tuple[str, ...]
    """Non-layer parts with missing bytes: ``header (tokenizer)``, ``token embedding``, ``output``, ``shared``."""

    def __bool__(self) -> bool:
        return bool(self.layers or self.parts)

    def describe(self) -> str:
        names = [f"layers [{a}, {b})" if b - a > 1 else f"layer {a}" for a, b in self.layers] + list(self.parts)
        return ", ".join(names)


def _runs(indices: Iterable[int]) -> tuple[tuple[int, int], ...]:
    runs: list[tuple[int, int]] = []
    for i in sorted(set(indices)):
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return tuple(runs)


def unseeded(manifest: ModelManifest, start: int, end: int, pieces: Iterable[int]) -> Unseeded:
    """The parts of ``[start, end)``'s download that lie in ``pieces`` (piece indices nobody offers)."""
    size = manifest.torrent.piece_size
    spans = sorted((p * size, min((p + 1) * size, manifest.file_size)) for p in set(pieces))
    if not spans:
        return Unseeded((), ())

    def hit(lo: int, hi: int) -> bool:
        return any(a < hi and lo < b for a, b in spans)

    layer_of = {name: il for il, names in enumerate(manifest.groups.layers) for name in names}
    role_of = {**{n: "token embedding" for n in manifest.groups.embedding},
               **{n: "output" for n in manifest.groups.output}, **{n: "shared" for n in manifest.groups.shared}}
    layers: set[int] = set()
    parts: list[str] = []
    if manifest_plan(manifest, start, end).keep_tokenizer and hit(0, manifest.header_size):
        parts.append("header (tokenizer)")
    for t in needed_tensors(manifest, start, end):
        if not t.size or not hit(t.offset, t.offset + t.size):
            continue
        if t.name in layer_of:
            layers.add(layer_of[t.name])
        elif (role := role_of.get(t.name, t.name)) not in parts:
            parts.append(role)
    return Unseeded(_runs(layers), tuple(parts))
