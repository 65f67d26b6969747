"""Building, saving and loading Model Artifact manifests (the schema is ``schemas.manifest``).

One sequential pass over the GGUF computes every hash: the file's sha256 (the model id), the header's sha256, one
sha256 per tensor and one SHA-1 per torrent piece.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gguf import GGUFValueType, LlamaFileType

from artifacts.bencode import bencode
from artifacts.gguf_layout import KV, GGUFLayout, TensorLayout, layer_of, open_data, read_layout, role_of
from artifacts.gguf_split import part_name
from schemas.errors import ArtifactError, BadRequestError
from schemas.manifest import KVEntry, ModelManifest, PartEntry, TensorEntry, TensorGroups, TorrentFile, TorrentLayout

DATA_FILE_NAME = "model.gguf"
SPLIT_DIR_NAME = "model"
"""A split set's torrent directory; its parts are ``model-0000i-of-0000n.gguf`` there (the names llama.cpp looks
for when it loads the first part), whatever the files were called on import."""
MIN_PIECE = 64 << 10
MAX_PIECE = 16 << 20
TARGET_PIECES = 1024
"""Small pieces keep partial fetch close to the bytes needed: a contiguous range wastes at most two pieces."""


def choose_piece_size(file_size: int) -> int:
    """The smallest power of two giving at most ~TARGET_PIECES pieces, within [64 KiB, 16 MiB]."""
    piece = MIN_PIECE
    while piece < MAX_PIECE and piece * TARGET_PIECES < file_size:
        piece *= 2
    return piece


def info_dict(torrent: TorrentLayout, file_size: int) -> dict[str, Any]:
    """The v1 info dictionary; ``private`` keeps clients off DHT and peer exchange for this torrent."""
    info: dict[str, Any] = {"name": torrent.file_name, "piece length": torrent.piece_size,
                            "pieces": b"".join(bytes.fromhex(h) for h in torrent.piece_sha1), "private": 1}
    if torrent.files:
        info["files"] = [{"length": f.length, "path": [f.path]} for f in torrent.files]
    else:
        info["length"] = file_size
    return info


def torrent_bytes(manifest: ModelManifest) -> bytes:
    """A .torrent (no announce list: peers come from the control plane) rebuilt from the manifest alone."""
    return bencode({"info": info_dict(manifest.torrent, manifest.file_size)})


class _Hasher:
    """Feeds consecutive chunks of the file to every hash that covers them."""

    def __init__(self, tensors: list[TensorLayout], header_size: int, piece_size: int,
                 regions: Sequence[tuple[int, int]] = ()) -> None:
        self.file = hashlib.sha256()
        self.header = hashlib.sha256()
        self.header_size = header_size
        self.regions = [(lo, hi, hashlib.sha256()) for lo, hi in regions]
        """Extra byte ranges hashed on their own (the parts of a split set, and their headers)."""
        self.piece_size = piece_size
        self.pieces: list[str] = []
        self.piece = hashlib.sha1()
        self.piece_fill = 0
        self.tensors = sorted(tensors, key=lambda t: t.offset)
        self.tensor_hashes: dict[str, str] = {}
        self._next = 0
        self._open: list[tuple[TensorLayout, Any]] = []
        self.pos = 0

    def feed(self, chunk: memoryview) -> None:
        lo, hi = self.pos, self.pos + len(chunk)
        self.file.update(chunk)
        if lo < self.header_size:
            self.header.update(chunk[: min(hi, self.header_size) - lo])
        for a, b, h in self.regions:
            if a < hi and lo < b:
                h.update(chunk[max(a, lo) - lo : min(b, hi) - lo])
        self._feed_pieces(chunk)
        self._feed_tensors(chunk, lo, hi)
        self.pos = hi

    def _feed_pieces(self, chunk: memoryview) -> None:
        while len(chunk):
            take = min(len(chunk), self.piece_size - self.piece_fill)
            self.piece.update(chunk[:take])
            self.piece_fill += take
            chunk = chunk[take:]
            if self.piece_fill == self.piece_size:
                self._close_piece()

    def _close_piece(self) -> None:
        self.pieces.append(self.piece.hexdigest())
        self.piece = hashlib.sha1()
        self.piece_fill = 0

    def _feed_tensors(self, chunk: memoryview, lo: int, hi: int) -> None:
        while self._next < len(self.tensors) and self.tensors[self._next].offset < hi:
            self._open.append((self.tensors[self._next], hashlib.sha256()))
            self._next += 1
        still_open = []
        for t, h in self._open:
            a, b = max(t.offset, lo), min(t.offset + t.size, hi)
            if a < b:
                h.update(chunk[a - lo : b - lo])
            if t.offset + t.size <= hi:
                self.tensor_hashes[t.name] = h.hexdigest()
            else:
                still_open.append((t, h))
        self._open = still_open

    def finish(self) -> None:
        if self.piece_fill:
            self._close_piece()
        for t, h in self._open:
            self.tensor_hashes[t.name] = h.hexdigest()  # only zero-size tensors at EOF can remain
        self._open = []


def _json_value(kv: KV) -> Any:
    if kv.type == GGUFValueType.ARRAY and kv.sub_type == GGUFValueType.STRING:
        return [v.decode("utf-8") if isinstance(v, bytes) else v for v in kv.value]
    return kv.value


def _entries(layout: GGUFLayout) -> list[KVEntry]:
    return [KVEntry(key=kv.key, type=kv.type.name, sub_type=kv.sub_type.name if kv.sub_type else None,
                    value=_json_value(kv))
            for kv in layout.fields if not kv.key.startswith("tokenizer.")]


def _groups(layout: GGUFLayout) -> TensorGroups:
    layers: list[list[str]] = [[] for _ in range(layout.n_layers)]
    by_role: dict[str, list[str]] = {"embedding": [], "output": [], "shared": []}
    for t in layout.tensors:
        role = role_of(t.name)
        if role == "layer":
            il = layer_of(t.name)
            assert il is not None
            if il >= layout.n_layers:
                raise BadRequestError(f"tensor {t.name} is beyond block_count={layout.n_layers}")
            layers[il].append(t.name)
        else:
            by_role[role].append(t.name)
    return TensorGroups(layers=layers, embedding=by_role["embedding"], output=by_role["output"],
                        shared=by_role["shared"])


def _file_type(layout: GGUFLayout) -> str:
    raw = layout.value("general.file_type")
    if raw is None:
        return ""
    try:
        return LlamaFileType(int(raw)).name.removeprefix("MOSTLY_")
    except ValueError:
        return str(raw)


def _n_vocab(layout: GGUFLayout) -> int:
    tokens = layout.value("tokenizer.ggml.tokens")
    if isinstance(tokens, list):
        return len(tokens)
    return int(layout.value(f"{layout.architecture}.vocab_size", 0))


def _part_regions(layout: GGUFLayout) -> list[tuple[int, int]]:
    """For a split set: each part, then each part's header, as ranges of the concatenated stream."""
    parts = [(p.base, p.end) for p in layout.parts]
    return parts + [(p.base, p.base + p.header_size) for p in layout.parts]


def hash_file(layout: GGUFLayout, path: Path, piece_size: int, file_size: int) -> _Hasher:
    hasher = _Hasher(layout.tensors, layout.header_size, piece_size, _part_regions(layout))
    chunk = piece_size * max(1, (8 << 20) // piece_size)
    if layout.parts:
        with open_data(layout) as f:
            while data := f.read(chunk):
                hasher.feed(memoryview(data))
    else:  # one file: read into one reused buffer, no copy per chunk
        buf = bytearray(chunk)
        view = memoryview(buf)
        with path.open("rb", buffering=0) as raw:
            while n := raw.readinto(buf):
                hasher.feed(view[:n])
    hasher.finish()
    if hasher.pos != file_size:
        raise ArtifactError(f"{path} changed size while it was hashed")
    return hasher


def _parts(layout: GGUFLayout, h: _Hasher) -> list[PartEntry]:
    n = len(layout.parts)
    digests = [d.hexdigest() for _, _, d in h.regions]
    return [PartEntry(name=part_name(SPLIT_DIR_NAME, i + 1, n), offset=p.base, size=p.size, header_size=p.header_size,
                      header_sha256=digests[n + i], sha256=digests[i]) for i, p in enumerate(layout.parts)]


def build_manifest(path: Path, *, piece_size: int | None = None) -> ModelManifest:
    """Describe ``path`` completely; ``piece_size`` (a power of two >= 16 KiB) defaults to ``choose_piece_size``."""
    layout = read_layout(path)
    size = layout.total_size
    piece = piece_size or choose_piece_size(size)
    if piece < 16 << 10 or piece & (piece - 1):
        raise BadRequestError(f"piece size {piece} must be a power of two of at least 16 KiB")
    end = max((t.offset + t.size for t in layout.tensors), default=layout.header_size)
    if end > size:
        raise ArtifactError(f"{path} is truncated: tensors end at byte {end}, the file has {size}")
    if layout.n_layers < 1:
        raise BadRequestError(f"{path}: {layout.architecture}.block_count is missing or zero")
    h = hash_file(layout, path, piece, size)
    tensors = [TensorEntry(name=t.name, ggml_type=t.ggml_type.name, shape=list(t.shape), offset=t.offset,
                           size=t.size, sha256=h.tensor_hashes[t.name]) for t in layout.tensors]
    # A fixed file name keeps the torrent (and manifest) a function of the bytes alone: two nodes that built
    # manifests of the same file under different names still join the same swarm.
    parts = _parts(layout, h) if layout.parts else []
    torrent = TorrentLayout(file_name=SPLIT_DIR_NAME if parts else DATA_FILE_NAME, piece_size=piece,
                            piece_sha1=h.pieces, info_hash="",
                            files=[TorrentFile(path=p.name, length=p.size) for p in parts])
    torrent.info_hash = hashlib.sha1(bencode(info_dict(torrent, size))).hexdigest()
    manifest = ModelManifest(
        model_id=h.file.hexdigest(), name=str(layout.value("general.name", "")), architecture=layout.architecture,
        n_layers=layout.n_layers, hidden_size=int(layout.value(f"{layout.architecture}.embedding_length", 1)),
        n_vocab=_n_vocab(layout), file_type=_file_type(layout), file_size=size, file_sha256=h.file.hexdigest(),
        header_size=layout.header_size, header_sha256=h.header.hexdigest(), alignment=layout.alignment,
        tied_output="output.weight" not in {t.name for t in layout.tensors}, metadata=_entries(layout),
        tensors=tensors, groups=_groups(layout), torrent=torrent, parts=parts)
    return manifest.with_id()


def data_files(manifest: ModelManifest, data_path: Path) -> list[tuple[Path, int]]:
    """(path, size) of every file of the model whose first (or only) file is ``data_path``."""
    if not manifest.parts:
        return [(data_path, manifest.file_size)]
    return [(data_path.with_name(p.name), p.size) for p in manifest.parts]


def save_manifest(manifest: ModelManifest, path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(manifest.to_json())
    tmp.replace(path)
    return path


def load_manifest(path: Path, *, expect_id: str | None = None) -> ModelManifest:
    """Load and check integrity: ``manifest_id`` must be the hash of the content (and ``expect_id`` if given)."""
    try:
        manifest = ModelManifest.model_validate(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path}: not a readable manifest: {exc}") from exc
    return check_manifest(manifest, expect_id=expect_id, where=str(path))


def check_manifest(manifest: ModelManifest, *, expect_id: str | None = None, where: str = "manifest") -> ModelManifest:
    actual = manifest.compute_id()
    if manifest.manifest_id != actual:
        raise ArtifactError(f"{where}: manifest_id {manifest.manifest_id[:16]}... does not match its content "
                            f"({actual[:16]}...): edited or corrupt")
    if expect_id is not None and actual != expect_id:
        raise ArtifactError(f"{where}: manifest {actual[:16]}... is not the expected {expect_id[:16]}...")
    names = [manifest.torrent.file_name, *(f.path for f in manifest.torrent.files), *(p.name for p in manifest.parts)]
    for name in names:
        if "/" in name or "\\" in name or name in ("", ".", ".."):
            raise ArtifactError(f"{where}: unsafe torrent file name {name!r}")
    if [p.name for p in manifest.parts] != [f.path for f in manifest.torrent.files]:
        raise ArtifactError(f"{where}: the torrent's files are not the split set's parts")
    return manifest
