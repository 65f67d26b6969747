"""Refuse a model file llama.cpp would choke on, before llama.cpp sees it.

llama.cpp reports most bad files as a NULL model, but some (a header that lies about tensor sizes, a file cut short
while it is memory-mapped) end in an abort or a SIGBUS far from the cause. So the backend first parses the GGUF
header itself (``artifacts.gguf_layout``, built on the ``gguf`` package's type tables: gguf's own ``GGUFReader``
takes 10-20 s on a 262k-token vocabulary) and checks that every tensor's bytes lie inside the file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gguf import GGUF_MAGIC, LlamaFileType

from artifacts.gguf_layout import GGUFLayout, read_layout
from schemas.errors import ModelLoadError, SwarmrouteError

_MAGIC_BYTES = GGUF_MAGIC.to_bytes(4, "little")
_HEADER_MIN = 24
"""magic + version + tensor count + kv count."""


@dataclasses.dataclass(frozen=True, slots=True)
class ShardRange:
    """The original layer range a shard GGUF holds (``swarmroute.*`` metadata written by ``artifacts.shard``)."""

    start: int
    end: int
    n_layers_total: int


@dataclasses.dataclass(frozen=True, slots=True)
class GGUFFacts:
    """What the backend needs to know about a GGUF file before and besides loading it."""

    path: Path
    size: int
    layout: GGUFLayout

    @property
    def architecture(self) -> str:
        return self.layout.architecture

    @property
    def name(self) -> str:
        return str(self.layout.value("general.name", "") or self.path.stem)

    @property
    def file_type(self) -> str:
        """``Q4_K_M``-style label from ``general.file_type``; empty when absent or unknown."""
        raw = self.layout.value("general.file_type")
        try:
            return LlamaFileType(int(raw)).name.removeprefix("MOSTLY_") if raw is not None else ""
        except ValueError:
            return ""

    @property
    def chat_template(self) -> str | None:
        value = self.layout.value("tokenizer.chat_template")
        return str(value) if value else None

    @property
    def shard(self) -> ShardRange | None:
        start, end = self.layout.value("swarmroute.layer_start"), self.layout.value("swarmroute.layer_end")
        total = self.layout.value("swarmroute.n_layers_total")
        if start is None or end is None or total is None:
            return None
        return ShardRange(int(start), int(end), int(total))


def inspect_gguf(path: Path) -> GGUFFacts:
    """Parse and sanity-check ``path``; raises ``ModelLoadError`` naming the file and what is wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file {path} does not exist (or is not a regular file)")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(_HEADER_MIN)
    if head[:4] != _MAGIC_BYTES:
        raise ModelLoadError(f"model file {path} is not a GGUF file (starts with {head[:4]!r}, expected b'GGUF')")
    if len(head) < _HEADER_MIN:
        raise ModelLoadError(f"model file {path} is truncated: {size} bytes, shorter than a GGUF header")
    try:
        layout = read_layout(path)
    except SwarmrouteError as e:
        raise ModelLoadError(f"model file {path} has a broken GGUF header (truncated?): {e.message}") from e
    # A split set's tensor offsets run over all its parts (read_layout checked each part holds its tensors).
    size = layout.total_size
    _check_tensors(path, size, layout)
    return GGUFFacts(path=path, size=size, layout=layout)


def _check_tensors(path: Path, size: int, layout: GGUFLayout) -> None:
    if not layout.tensors:
        raise ModelLoadError(f"model file {path} holds no tensors")
    last = max(layout.tensors, key=lambda t: t.offset + t.size)
    end = last.offset + last.size
    if end > size:
        raise ModelLoadError(f"model file {path} is truncated: tensor data runs to byte {end:,} ({last.name}) "
                             f"but the file has {size:,} bytes")
