"""The content-addressed artifact store of one node.

Layout (``<home>/store/<model_id>/``, ``model_id`` = sha256 of the GGUF)::

    manifest.json            the Model Artifact manifest (its manifest_id is checked on every load)
    model.gguf               the torrent's one file: complete, or sparse with only the pieces this node fetched
    model/model-0000i-of-0000n.gguf   instead, for a split GGUF set: the multi-file torrent's parts
    shard-<a>-<b>.gguf       shard GGUFs written from it (verified before use)
    .resume                  libtorrent resume data (which pieces are on disk), written while fetching

A model has exactly one directory whatever it was called on disk, so the same bytes are never stored twice.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from artifacts.gguf_layout import read_layout
from artifacts.manifest import build_manifest, check_manifest, data_files, load_manifest, save_manifest
from artifacts.shard import shard_file_name
from schemas.errors import ArtifactError, NotFoundError
from schemas.manifest import ModelManifest

MANIFEST_NAME = "manifest.json"
RESUME_NAME = ".resume"


class Store:
    """One node's store under ``<home>/store``."""

    def __init__(self, home: Path) -> None:
        self.root = home / "store"

    def model_dir(self, model_id: str) -> Path:
        if not model_id or not all(c in "0123456789abcdef" for c in model_id):
            raise ArtifactError(f"model id {model_id!r} is not a lowercase hex digest")
        return self.root / model_id

    def manifest_path(self, model_id: str) -> Path:
        return self.model_dir(model_id) / MANIFEST_NAME

    def data_path(self, manifest: ModelManifest) -> Path:
        """The model's file, or for a split set its first part (llama.cpp finds the others next to it)."""
        base = self.model_dir(manifest.model_id) / manifest.torrent.file_name
        return base / manifest.parts[0].name if manifest.parts else base

    def data_files(self, manifest: ModelManifest) -> list[tuple[Path, int]]:
        return data_files(manifest, self.data_path(manifest))

    def shard_path(self, model_id: str, start: int, end: int) -> Path:
        return self.model_dir(model_id) / shard_file_name(start, end)

    def resume_path(self, model_id: str) -> Path:
        return self.model_dir(model_id) / RESUME_NAME

    def model_ids(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if (p / MANIFEST_NAME).is_file())

    def load(self, model_id: str) -> ModelManifest:
        path = self.manifest_path(model_id)
        if not path.is_file():
            raise NotFoundError(f"model {model_id[:16]}... is not in the store at {self.root}")
        manifest = load_manifest(path)
        if manifest.model_id != model_id:
            raise ArtifactError(f"{path} describes model {manifest.model_id[:16]}..., not {model_id[:16]}...")
        return manifest

    def resolve(self, prefix: str) -> str:
        """A model id from a unique prefix of it (as printed by the CLI)."""
        matches = [m for m in self.model_ids() if m.startswith(prefix)]
        if len(matches) != 1:
            raise NotFoundError(f"{'no' if not matches else 'several'} models in {self.root} match {prefix!r}")
        return matches[0]

    def add_manifest(self, manifest: ModelManifest) -> Path:
        """Record a manifest (e.g. received from a peer) before fetching; refuses one whose id does not match."""
        check_manifest(manifest)
        directory = self.model_dir(manifest.model_id)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / MANIFEST_NAME
        if path.is_file():
            existing = load_manifest(path)
            if existing.manifest_id == manifest.manifest_id:
                return path
            raise ArtifactError(f"{path} already holds manifest {existing.manifest_id[:16]}... for this model; "
                                f"refusing {manifest.manifest_id[:16]}... (different piece size?)")
        return save_manifest(manifest, path)

    def import_gguf(self, source: Path, *, link: bool = False, piece_size: int | None = None) -> ModelManifest:
        """Build the manifest of a complete local GGUF and place the file in the store.

        ``link`` hard-links instead of copying (same filesystem only): no second copy on disk, but a change to
        either name changes both. An artifact already in the store is not copied again.
        """
        manifest = build_manifest(source, piece_size=piece_size)
        existing = self.manifest_path(manifest.model_id)
        if existing.is_file():
            manifest = load_manifest(existing)
        else:
            self.add_manifest(manifest)
        # A split set's parts take the store's names (model-0000i-of-0000n.gguf) whatever they were called.
        sources = [path for path, _ in read_layout(source).data_files] if manifest.parts else [source]
        for src, (target, size) in zip(sources, self.data_files(manifest), strict=True):
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists() and target.stat().st_size == size and _same_file(target, src):
                continue
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            if link:
                os.link(src, tmp)
            else:
                shutil.copyfile(src, tmp)
            tmp.replace(target)
        return manifest


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b) or _content_equal(a, b)
    except OSError:
        return False


def _content_equal(a: Path, b: Path) -> bool:
    chunk = 8 << 20
    with a.open("rb") as fa, b.open("rb") as fb:
        while True:
            x, y = fa.read(chunk), fb.read(chunk)
            if x != y:
                return False
            if not x:
                return True
