"""Split GGUF sets (``<prefix>-00001-of-00004.gguf`` ...), as ``llama-gguf-split`` and gguf-py's writer produce them.

Format (llama.cpp ``llama-model-loader.cpp``, gguf-py ``GGUFWriter(split_max_tensors=...)``): every part is a complete
GGUF file carrying ``split.no`` (0-based), ``split.count`` and ``split.tensors.count`` (tensors of the whole set);
the first part carries every other metadata key, the tokenizer included; each part lists and stores its own tensors,
offsets relative to its own data section. llama.cpp loads a set from its first part and finds the others by name.

swarmroute treats a set as one model laid out as the **concatenation of its parts in order**: a tensor's offset is
its part's start in that byte stream plus its offset in the part. That stream is exactly the piece space of a v1
multi-file torrent, so hashing, pieces, partial fetch and byte ranges work unchanged; ``ConcatReader`` reads it.

A set is checked when it is read: every part present, numbered as its name says, agreeing on ``split.count`` and
``split.tensors.count`` and alignment, no metadata but ``split.*`` outside the first part, no tensor twice, the
tensor total right, every part long enough for its tensors. gguf-split writes no set identifier, so a part taken
from another set with an identical layout (same tensors, same types) cannot be told apart by its bytes; once a set
is in the store its manifest pins every part's sha256, and verification names a substituted part.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

from schemas.errors import BadRequestError

SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def part_name(prefix: str, no: int, count: int) -> str:
    """``no`` is 1-based, as in the file names (llama.cpp ``llama_split_path``)."""
    return f"{prefix}-{no:05d}-of-{count:05d}.gguf"


def split_prefix(path: Path) -> tuple[str, int, int] | None:
    """(prefix, 1-based number, count) when ``path`` is named like a part of a split set."""
    m = SPLIT_NAME.match(path.name)
    return (m.group("prefix"), int(m.group("no")), int(m.group("count"))) if m else None


@dataclasses.dataclass(frozen=True, slots=True)
class PartLayout:
    """One file of a split set, placed in the set's byte stream at ``base``."""

    path: Path
    size: int
    header_size: int
    base: int

    @property
    def end(self) -> int:
        return self.base + self.size


def split_count(fields: Sequence[Any]) -> int:
    return int(next((kv.value for kv in fields if kv.key == "split.count"), 0) or 0)


def _value(fields: Sequence[Any], key: str) -> Any:
    return next((kv.value for kv in fields if kv.key == key), None)


def part_paths(first: Path, count: int) -> list[Path]:
    parsed = split_prefix(first)
    if parsed is None:
        raise BadRequestError(f"{first} declares split.count={count} but is not named <prefix>-00001-of-"
                              f"{count:05d}.gguf, so its other parts cannot be found")
    prefix, no, named_count = parsed
    if named_count != count:
        raise BadRequestError(f"{first}: its name says {named_count} parts, its split.count says {count}")
    if no != 1:
        raise BadRequestError(f"{first} is part {no} of a split set: give the first part, "
                              f"{part_name(prefix, 1, count)}")
    return [first.with_name(part_name(prefix, i + 1, count)) for i in range(count)]


def check_part(path: Path, index: int, count: int, tensors_total: int, alignment: int, fields: Sequence[Any],
               first_arch: str) -> None:
    """Raise ``BadRequestError`` naming ``path`` when it is not part ``index`` (0-based) of this set."""
    what = f"{path} is not part {index + 1} of this {count}-part set"
    if split_count(fields) != count:
        raise BadRequestError(f"{what}: it belongs to a set of {split_count(fields)} parts (another set?)")
    if _value(fields, "split.no") != index:
        raise BadRequestError(f"{what}: its split.no is {_value(fields, 'split.no')}")
    if int(_value(fields, "split.tensors.count") or -1) != tensors_total:
        raise BadRequestError(f"{what}: its set has {_value(fields, 'split.tensors.count')} tensors, this one "
                              f"{tensors_total} (another set)")
    arch = _value(fields, "general.architecture")
    if arch is not None and arch != first_arch:
        raise BadRequestError(f"{what}: it is a {arch!r} model, the first part a {first_arch!r} one (another set)")
    extra = [kv.key for kv in fields if kv.key not in SPLIT_KEYS and kv.key not in ("general.architecture",
                                                                                     "general.alignment")]
    if index and extra:
        raise BadRequestError(f"{what}: it carries metadata ({extra[0]}...) only a first part has (another set?)")
    if int(_value(fields, "general.alignment") or alignment) != alignment:
        raise BadRequestError(f"{what}: its alignment differs from the first part's")


def missing_parts(paths: Sequence[Path]) -> list[Path]:
    return [p for p in paths if not p.is_file()]


class ConcatReader:
    """A read-only, seekable file over consecutive parts of known sizes. A part file that is absent or shorter than
    its size reads as zeros there, as a sparse file being downloaded does; past the last part, reads return b""."""

    def __init__(self, parts: Sequence[tuple[Path, int]]) -> None:
        self._parts = list(parts)
        self._bases = []
        base = 0
        for _, size in self._parts:
            self._bases.append(base)
            base += size
        self._size = base
        self._pos = 0
        self._files: dict[int, BinaryIO | None] = {}

    @property
    def size(self) -> int:
        return self._size

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else (self._pos + offset if whence == 1 else self._size + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def _file(self, i: int) -> BinaryIO | None:
        if i not in self._files:
            path = self._parts[i][0]
            self._files[i] = path.open("rb") if path.is_file() else None
        return self._files[i]

    def read(self, n: int = -1) -> bytes:
        end = self._size if n < 0 else min(self._size, self._pos + n)
        out = bytearray()
        while self._pos < end:
            i = max(j for j, b in enumerate(self._bases) if b <= self._pos)
            part_end = self._bases[i] + self._parts[i][1]
            take = min(end, part_end) - self._pos
            f = self._file(i)
            data = b""
            if f is not None:
                f.seek(self._pos - self._bases[i])
                data = f.read(take)
            out += data + b"\0" * (take - len(data))
            self._pos += take
        return bytes(out)

    def close(self) -> None:
        for f in self._files.values():
            if f is not None:
                f.close()
        self._files.clear()

    def __enter__(self) -> ConcatReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

