"""Which file a llama.cpp backend loads, and which layers of the whole model it holds: the file itself (a whole model
or a shard GGUF that says its range), or a shard cut once from a whole model for the range asked."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path

from actors.backends.llamacpp.config import LlamaCppConfig
from actors.backends.llamacpp.gguf_check import GGUFFacts, inspect_gguf
from artifacts.gguf_split import part_name, split_prefix
from schemas.errors import ModelLoadError
from schemas.node import LayerRange

__all__ = ["Placement", "file_sha256", "place"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """Which file is loaded and which layers of the whole model it holds."""

    facts: GGUFFacts
    layers: LayerRange
    n_layers_total: int

    @property
    def is_head(self) -> bool:
        return self.layers.start == 0

    @property
    def is_tail(self) -> bool:
        return self.layers.end == self.n_layers_total


def place(config: LlamaCppConfig) -> Placement:
    """Inspect the file and, when asked for a sub-range of a whole model, cut (or reuse) the shard GGUF."""
    facts = inspect_gguf(config.model_path)
    shard = facts.shard
    if shard is not None:
        own = (shard.start, shard.end)
        wanted = (config.layer_start if config.layer_start is not None else shard.start,
                  config.layer_end if config.layer_end is not None else shard.end)
        if wanted != own:
            raise ModelLoadError(f"{config.model_path} is a shard of layers [{own[0]}, {own[1]}), "
                                 f"not [{wanted[0]}, {wanted[1]})")
        return Placement(facts, LayerRange(start=shard.start, end=shard.end), shard.n_layers_total)
    n = facts.layout.n_layers
    start = config.layer_start if config.layer_start is not None else 0
    end = config.layer_end if config.layer_end is not None else n
    if not 0 <= start < end <= n:
        raise ModelLoadError(f"layer range [{start}, {end}) is not within the {n} layers of {config.model_path}")
    if (start, end) == (0, n):
        return Placement(facts, LayerRange(start=0, end=n), n)
    return Placement(inspect_gguf(cut_shard(config, start, end)), LayerRange(start=start, end=end), n)


def cut_shard(config: LlamaCppConfig, start: int, end: int) -> Path:
    from artifacts.shard import shard_file_name, write_shard

    directory = config.shard_dir or config.model_path.parent / f"{config.model_path.stem}.shards"
    # Named after the source's identity too: a shard directory shared by several models (or a model file replaced
    # in place) must never hand one model's layers to another.
    stat = config.model_path.stat()
    source = hashlib.sha256(f"{config.model_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    path = directory / shard_file_name(start, end).replace(".gguf", f"-{source[:12]}.gguf")
    if not path.exists():
        log.info("cutting layers [%d, %d) of %s into %s", start, end, config.model_path, path)
        write_shard(config.model_path, path, start, end, allow_unproven=config.allow_unproven)
    return path


def file_sha256(path: Path) -> str:
    """sha256 of the model's bytes: the file, or for the first part of a split set the concatenation of its parts
    (what its manifest's id is)."""
    parsed = split_prefix(path)
    if parsed is None or parsed[1] != 1 or parsed[2] < 2:
        with path.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    prefix, _, count = parsed
    digest = hashlib.sha256()
    for i in range(1, count + 1):
        with path.with_name(part_name(prefix, i, count)).open("rb") as f:
            while chunk := f.read(8 << 20):
                digest.update(chunk)
    return digest.hexdigest()
