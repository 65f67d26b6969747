"""The layout of a GGUF file: typed metadata, tensor byte ranges, and which tensor belongs to which layer or role."""

from __future__ import annotations

import dataclasses
import math
import mmap
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

from artifacts.gguf_split import ConcatReader, PartLayout, check_part, missing_parts, part_paths, split_count
from schemas.errors import BadRequestError

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_EMBEDDING_STEMS = frozenset({"token_embd", "token_embd_norm", "token_types", "position_embd"})
_OUTPUT_STEMS = frozenset({"output", "output_norm", "cls", "cls_out", "cls.output"})


@dataclasses.dataclass(frozen=True, slots=True)
class KV:
    """A metadata entry ready to hand to ``GGUFWriter.add_key_value`` (strings as ``bytes`` inside arrays)."""

    key: str
    type: GGUFValueType
    value: Any
    sub_type: GGUFValueType | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class TensorLayout:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    """GGML order: ne0 (the contiguous dimension) first."""
    offset: int
    """Absolute byte offset in the file."""
    size: int


@dataclasses.dataclass(frozen=True, slots=True)
class GGUFLayout:
    path: Path
    architecture: str
    fields: list[KV]
    tensors: list[TensorLayout]
    header_size: int
    """Bytes before the tensor data section (metadata, tensor infos, padding); the first part's for a split set."""
    alignment: int
    parts: tuple[PartLayout, ...] = ()
    """The files of a split set (``artifacts.gguf_split``), first part first; empty for a single file. Tensor
    offsets are then positions in the concatenation of the parts."""

    @property
    def data_files(self) -> list[tuple[Path, int]]:
        """(path, size) of every file holding the model, in order."""
        if self.parts:
            return [(p.path, p.size) for p in self.parts]
        return [(self.path, self.path.stat().st_size)]

    @property
    def total_size(self) -> int:
        return sum(size for _, size in self.data_files)

    def field(self, key: str) -> KV | None:
        return next((kv for kv in self.fields if kv.key == key), None)

    def value(self, key: str, default: Any = None) -> Any:
        kv = self.field(key)
        return default if kv is None else kv.value

    @property
    def n_layers(self) -> int:
        return int(self.value(f"{self.architecture}.block_count", 0))


_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d", GGUFValueType.BOOL: "<?",
}
_NUMPY = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4", GGUFValueType.FLOAT32: "<f4", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8", GGUFValueType.BOOL: "?",
}


class _Cursor:
    """A little-endian reader over the header bytes.

    gguf's own GGUFReader builds one numpy view per array element and takes ~10 s on a 262k-token vocabulary;
    this parser reads the same header in well under a second.
    """

    def __init__(self, buf: bytes | mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def raw_string(self) -> bytes:
        n = self.unpack("<Q")
        data = bytes(self.buf[self.pos : self.pos + n])
        if len(data) != n:
            raise ValueError("string runs past the end of the file")
        self.pos += n
        return data

    def _strings(self, n: int) -> list[bytes]:
        # Raw bytes: tokenizer vocabularies are not guaranteed to be valid UTF-8. A tight loop: a vocabulary has
        # hundreds of thousands of entries.
        buf, pos = self.buf, self.pos
        out: list[bytes] = []
        append, from_bytes = out.append, int.from_bytes
        for _ in range(n):
            size = from_bytes(buf[pos : pos + 8], "little")
            pos += 8
            append(buf[pos : pos + size])
            pos += size
        if pos > len(buf):
            raise ValueError("string array runs past the end of the file")
        self.pos = pos
        return out

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.raw_string().decode("utf-8")
        return self.unpack(_SCALAR[vtype])

    def array(self) -> tuple[GGUFValueType, list[Any]]:
        sub = GGUFValueType(self.unpack("<I"))
        n = self.unpack("<Q")
        if sub == GGUFValueType.STRING:
            return sub, self._strings(n)
        if sub == GGUFValueType.ARRAY:
            raise ValueError("nested GGUF arrays are not supported")
        dtype = np.dtype(_NUMPY[sub])
        items = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
        self.pos += n * dtype.itemsize
        return sub, items.tolist()


def _read_kv(cur: _Cursor) -> KV:
    key = cur.raw_string().decode("utf-8")
    vtype = GGUFValueType(cur.unpack("<I"))
    if vtype == GGUFValueType.ARRAY:
        sub, items = cur.array()
        return KV(key, vtype, items, sub)
    return KV(key, vtype, cur.value(vtype))


def _read_tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = cur.raw_string().decode("utf-8")
    n_dims = cur.unpack("<I")
    shape = tuple(int(cur.unpack("<Q")) for _ in range(n_dims))
    return name, shape, GGMLQuantizationType(cur.unpack("<I")), int(cur.unpack("<Q"))


def _tensor_size(ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    n = math.prod(shape)
    if shape and shape[0] % block:
        raise ValueError(f"row of {shape[0]} elements is not a multiple of the {ggml_type.name} block ({block})")
    return n // block * type_size


def _parse(path: Path, buf: mmap.mmap) -> GGUFLayout:
    cur = _Cursor(buf)
    if cur.unpack("<I") != GGUF_MAGIC:
        raise ValueError("bad magic (not a GGUF file, or a big-endian one)")
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    fields = [_read_kv(cur) for _ in range(n_kv)]
    infos = [_read_tensor_info(cur) for _ in range(n_tensors)]
    alignment = int(next((kv.value for kv in fields if kv.key == "general.alignment"), GGUF_DEFAULT_ALIGNMENT))
    header_size = -(-cur.pos // alignment) * alignment
    tensors = [TensorLayout(name, qtype, shape, header_size + rel, _tensor_size(qtype, shape))
               for name, shape, qtype, rel in infos]
    arch = next((str(kv.value) for kv in fields if kv.key == "general.architecture"), None)
    if arch is None and not any(kv.key == "split.no" and int(kv.value) > 0 for kv in fields):
        raise ValueError("no general.architecture")  # parts after the first of a split set carry none
    return GGUFLayout(path=path, architecture=arch or "", fields=fields, tensors=tensors, header_size=header_size,
                      alignment=alignment)


def read_part(path: Path) -> GGUFLayout:
    """Parse the header of one file, a whole model or one part of a split set (offsets relative to it)."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(path, buf)
    except (ValueError, OSError, struct.error) as exc:
        raise BadRequestError(f"{path} is not a readable GGUF file: {exc}") from exc


def read_layout(path: Path) -> GGUFLayout:
    """Parse the header of the model at ``path``: a single GGUF, or the first part of a split set (then every part
    is read and checked, see ``artifacts.gguf_split``). Tensor data is not read: a partially downloaded file works
    once its header is."""
    layout = read_part(path)
    count = split_count(layout.fields)
    return _combine(layout, count) if count > 1 else layout


def _combine(first: GGUFLayout, count: int) -> GGUFLayout:
    paths = part_paths(first.path, count)
    missing = missing_parts(paths)
    if missing:
        raise BadRequestError(f"split set {first.path.name} ({count} parts) is incomplete: missing "
                              f"{', '.join(p.name for p in missing)} in {first.path.parent}")
    total = int(first.value("split.tensors.count", -1))
    parts: list[PartLayout] = []
    tensors: list[TensorLayout] = []
    base = 0
    for i, path in enumerate(paths):
        part = first if i == 0 else read_part(path)
        check_part(path, i, count, total, first.alignment, part.fields, first.architecture)
        size = path.stat().st_size
        for t in part.tensors:
            if t.offset + t.size > size:
                raise BadRequestError(f"{path} is truncated: {t.name} runs to byte {t.offset + t.size:,}, the file "
                                      f"has {size:,}")
            tensors.append(dataclasses.replace(t, offset=base + t.offset))
        parts.append(PartLayout(path, size, part.header_size, base))
        base += size
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise BadRequestError(f"split set {first.path.name}: tensor {twice} is in two parts (parts of two sets?)")
    if len(tensors) != total:
        raise BadRequestError(f"split set {first.path.name}: its parts hold {len(tensors)} tensors, "
                              f"split.tensors.count says {total}")
    fields = [kv for kv in first.fields if not kv.key.startswith("split.")]
    return dataclasses.replace(first, fields=fields, tensors=tensors, parts=tuple(parts))


def open_data(layout: GGUFLayout) -> ConcatReader:
    """The model's bytes as one stream, whatever number of files hold them (tensor offsets index it)."""
    return ConcatReader(layout.data_files)


def layer_of(name: str) -> int | None:
    """The block index of a tensor name (``blk.12.attn_q.weight`` -> 12), ``None`` for non-layer tensors."""
    m = _BLOCK.match(name)
    return int(m.group(1)) if m else None


def renumber(name: str, start: int) -> str:
    """``blk.<i>.x`` -> ``blk.<i - start>.x``; other names unchanged."""
    m = _BLOCK.match(name)
    return f"blk.{int(m.group(1)) - start}.{m.group(2)}" if m else name


def stem(name: str) -> str:
    """Tensor name without its ``.weight``/``.bias`` suffix."""
    return name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name


def role_of(name: str) -> str:
    """``layer``, ``embedding`` (head only), ``output`` (tail; output_norm also everywhere) or ``shared`` (all)."""
    if layer_of(name) is not None:
        return "layer"
    s = stem(name)
    if s in _EMBEDDING_STEMS:
        return "embedding"
    if s in _OUTPUT_STEMS:
        return "output"
    return "shared"
