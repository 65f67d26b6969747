"""What a GGUF node does before it serves: put the model in the content-addressed store, cut its shard, verify it.

A node advertises a range only after ``artifacts.verify`` has checked every tensor of it against the manifest, and
it advertises the manifest's content-derived model id, so nodes agree on identity without a registry.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from artifacts.manifest import build_manifest
from artifacts.shard import ShardSource, write_shard
from artifacts.store import Store
from artifacts.verify import check_data_file, data_range_verdict, require_verified_shard
from schemas.errors import ArtifactError
from schemas.manifest import ModelManifest

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PreparedArtifact:
    path: Path
    """The file the backend loads: the store's data file (whole model) or a verified shard."""
    manifest: ModelManifest
    start: int
    end: int


def import_model(home: Path, source: Path) -> ModelManifest:
    """Place a local GGUF in the store (hard link when possible: no second copy) and return its manifest."""
    store = Store(home)
    try:
        return store.import_gguf(source, link=True)
    except OSError:
        return store.import_gguf(source, link=False)


def _manifest_for(store: Store, source: Path) -> ModelManifest:
    """The stored manifest for a file already imported (cheap), else import it."""
    for model_id in store.model_ids():
        manifest = store.load(model_id)
        data = store.data_path(manifest)
        if data.exists() and data.stat().st_size == source.stat().st_size and data.samefile(source):
            return manifest
    return import_model(store.root.parent, source)


def prepare(home: Path, source: Path | None, *, model_id: str | None, start: int | None,
            end: int | None, allow_unproven: bool = False) -> PreparedArtifact:
    """Verified file for layers [start, end) of a model given as a local GGUF or as an id already in the store.
    ``allow_unproven`` lets an architecture ``artifacts.arch_support`` has not proven be cut (the CLI's override)."""
    store = Store(home)
    if model_id is not None:
        manifest = store.load(store.resolve(model_id))
    elif source is not None:
        manifest = _manifest_for(store, source)
    else:
        raise ArtifactError("a node needs a model file or a model id in its store")
    n = manifest.n_layers
    a, b = (0 if start is None else start), (n if end is None else end)
    if not 0 <= a < b <= n:
        raise ArtifactError(f"layer range [{a}, {b}) is not within the {n} layers of model {manifest.model_id[:12]}")
    data = store.data_path(manifest)
    if (a, b) == (0, n):
        verdict = data_range_verdict(manifest, check_data_file(manifest, data), a, b)
        if not verdict.ok:
            raise ArtifactError(f"model {manifest.model_id[:12]}: {verdict.describe()}")
        return PreparedArtifact(data, manifest, a, b)
    shard = store.shard_path(manifest.model_id, a, b)
    if not shard.exists():
        log.info("writing shard [%d, %d) of %s", a, b, manifest.model_id[:12])
        write_shard(ShardSource.from_manifest(manifest, data), shard, a, b, allow_unproven=allow_unproven)
    return PreparedArtifact(require_verified_shard(store, manifest.model_id, a, b, allow_unproven=allow_unproven),
                            manifest, a, b)


__all__ = ["PreparedArtifact", "build_manifest", "import_model", "prepare"]
