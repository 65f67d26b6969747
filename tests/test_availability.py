"""artifacts/availability.py: naming what a stalled fetch waits for, in layers and model parts."""

from __future__ import annotations

from pathlib import Path

from artifacts.availability import unseeded
from artifacts.manifest import build_manifest
from artifacts.shard import needed_byte_ranges, needed_tensors
from artifacts.torrent import wanted_pieces
from schemas.manifest import ModelManifest
from tests.support.gguf_factory import write_tiny_gguf


def tiny(tmp_path: Path) -> ModelManifest:
    return build_manifest(write_tiny_gguf(tmp_path / "t.gguf", n_layers=6, n_embd=128, n_ff=512, n_vocab=64),
                          piece_size=16384)


def pieces_of(manifest: ModelManifest, names: list[str]) -> set[int]:
    size = manifest.torrent.piece_size
    return {p for n in names for t in [manifest.tensor(n)] for p in range(t.offset // size,
                                                                           (t.offset + t.size - 1) // size + 1)}


def test_missing_pieces_are_named_by_layer_and_part(tmp_path: Path) -> None:
    m = tiny(tmp_path)
    inner = {p for p in pieces_of(m, m.groups.layers[3])} - pieces_of(m, m.groups.layers[2] + m.groups.layers[4])
    found = unseeded(m, 2, 5, inner)
    assert found.layers == ((3, 4),) and found.parts == () and found.describe() == "layer 3"
    everything = set(wanted_pieces(m, needed_byte_ranges(m, 0, 6)))
    whole = unseeded(m, 0, 6, everything)
    assert whole.layers == ((0, 6),)
    assert {"header (tokenizer)", "token embedding", "output"} <= set(whole.parts)
    assert whole.describe().startswith("layers [0, 6), header (tokenizer)")


def test_pieces_outside_the_range_are_not_reported(tmp_path: Path) -> None:
    m = tiny(tmp_path)
    elsewhere = pieces_of(m, m.groups.layers[5]) - pieces_of(m, [t.name for t in needed_tensors(m, 1, 3)])
    assert elsewhere and not unseeded(m, 1, 3, elsewhere)
    assert not unseeded(m, 1, 3, [])
