"""Shard GGUFs: one contiguous layer range of a model as a file llama.cpp loads on its own.

Contents of the shard for layers ``[start, end)`` of an ``n``-layer model (layers renumbered ``0..end-start-1``,
metadata keyed on layer index rewritten by ``artifacts.layer_metadata``, provenance in ``swarmroute.layer_start``,
``swarmroute.layer_end``, ``swarmroute.n_layers_total``, ``swarmroute.manifest_id``):

===========  ==========================================================================================
whole        ``[0, n)``: every tensor of the model.
head         ``start == 0``: full tokenizer, full ``token_embd`` (llama.cpp does the token lookup), ``output_norm``;
             no ``output.weight`` (the executor stops after the last layer, the lm_head never runs).
middle       no tokenizer (``tokenizer.ggml.model = "none"``, ``{arch}.vocab_size = 1``), a 1-row all-zero
             ``token_embd`` generated locally (never downloaded), ``output_norm``; fed embeddings.
tail         ``end == n``: full tokenizer, ``output_norm``, ``output.weight``; for a tied model the full
             ``token_embd`` (it is the lm_head); for an untied one a zero ``token_embd`` of full shape the loader
             demands, written as a sparse hole.
===========  ==========================================================================================

Tensor data is copied byte-for-byte from the source file (quantized blocks untouched). Tensors used by every
layer (e.g. ``rope_freqs``) go into every shard.

Entry points: ``write_shard`` (a shard from a GGUF file or from a partial store file + manifest),
``plan_shard`` (what goes in), ``needed_tensors`` / ``needed_byte_ranges`` (what a node must download).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFEndian, GGUFValueType, GGUFWriter

from artifacts.arch_support import CutRequest, check_cut, metadata_map, output_required
from artifacts.gguf_layout import KV, TensorLayout, read_layout, read_part, renumber, role_of
from artifacts.gguf_split import ConcatReader
from artifacts.layer_metadata import RangeSpec, shard_fields
from artifacts.manifest import data_files
from schemas.errors import ArtifactError, BadRequestError
from schemas.manifest import KVEntry, ModelManifest, TensorEntry

# GGUFWriter logs every file it writes at INFO; a node writes shards as routine work.
logging.getLogger("gguf.gguf_writer").setLevel(logging.WARNING)

TOKEN_EMBD = "token_embd.weight"
OUTPUT = "output.weight"
_COPY_CHUNK = 8 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class SyntheticTensor:
    """A tensor the loader requires but the shard never uses: all zeros, generated, never downloaded."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return int(np.prod(self.shape)) // block * type_size


@dataclasses.dataclass(frozen=True, slots=True)
class ShardPlan:
    """What the shard for ``[start, end)`` holds. ``copied`` are source tensor names in file order."""

    start: int
    end: int
    n_layers: int
    copied: tuple[str, ...]
    synthetic: tuple[SyntheticTensor, ...]
    keep_tokenizer: bool

    @property
    def is_head(self) -> bool:
        return self.start == 0

    @property
    def is_tail(self) -> bool:
        return self.end == self.n_layers

    @property
    def is_whole(self) -> bool:
        return self.is_head and self.is_tail


def check_range(start: int, end: int, n_layers: int) -> None:
    if not 0 <= start < end <= n_layers:
        raise BadRequestError(f"layer range [{start}, {end}) is not within [0, {n_layers})")


def _include(t: TensorLayout, start: int, end: int, n_layers: int, tied: bool) -> bool:
    role = role_of(t.name)
    if role == "layer":
        il = int(t.name.split(".", 2)[1])
        return start <= il < end
    if role == "shared" or t.name.startswith("output_norm."):
        return True
    if role == "embedding":
        return start == 0 or (t.name == TOKEN_EMBD and tied and end == n_layers)
    return end == n_layers  # output group: the lm_head side lives on the tail


def plan_shard(tensors: Sequence[TensorLayout], n_layers: int, start: int, end: int, *,
               architecture: str = "") -> ShardPlan:
    """Decide the shard's tensors from the model's tensors (in file order). ``architecture`` matters where
    llama.cpp requires a tensor the shard never uses (``arch_support.output_required``)."""
    check_range(start, end, n_layers)
    names = [t.name for t in tensors]
    if start == 0 and end == n_layers:
        return ShardPlan(start, end, n_layers, tuple(names), (), True)
    tied = OUTPUT not in names
    copied = tuple(t.name for t in tensors if _include(t, start, end, n_layers, tied))
    keep_tokenizer = start == 0 or end == n_layers
    synthetic: tuple[SyntheticTensor, ...] = ()
    embd = next((t for t in tensors if t.name == TOKEN_EMBD), None)
    if embd is not None and TOKEN_EMBD not in copied:
        shape = embd.shape if keep_tokenizer else (embd.shape[0], 1)
        synthetic = (SyntheticTensor(TOKEN_EMBD, embd.ggml_type, shape),)
    out = next((t for t in tensors if t.name == OUTPUT), None)
    if out is not None and OUTPUT not in copied and output_required(architecture):
        # The lm_head never runs off the tail (the capture stops the graph), but the loader demands it.
        shape = out.shape if keep_tokenizer else (out.shape[0], 1)
        synthetic += (SyntheticTensor(OUTPUT, out.ggml_type, shape),)
    return ShardPlan(start, end, n_layers, copied, synthetic, keep_tokenizer)


def manifest_plan(manifest: ModelManifest, start: int, end: int) -> ShardPlan:
    return plan_shard(manifest_layouts(manifest), manifest.n_layers, start, end, architecture=manifest.architecture)


def manifest_layouts(manifest: ModelManifest) -> list[TensorLayout]:
    return [TensorLayout(t.name, GGMLQuantizationType[t.ggml_type], tuple(t.shape), t.offset, t.size)
            for t in manifest.tensors]


def needed_tensors(manifest: ModelManifest, start: int, end: int) -> list[TensorEntry]:
    """The tensors a node serving ``[start, end)`` must download (file order); synthetic ones are not listed."""
    plan = manifest_plan(manifest, start, end)
    wanted = set(plan.copied)
    return [t for t in manifest.tensors if t.name in wanted]


def needed_byte_ranges(manifest: ModelManifest, start: int, end: int) -> list[tuple[int, int]]:
    """Merged half-open byte ranges of the file a node serving ``[start, end)`` needs: its tensors, plus the
    header when the shard keeps the tokenizer (the vocabulary is stored there, not in the manifest)."""
    plan = manifest_plan(manifest, start, end)
    spans = [(t.offset, t.end) for t in needed_tensors(manifest, start, end) if t.size]
    if plan.keep_tokenizer:
        spans.append((0, manifest.header_size))
    if plan.is_whole:
        # The whole model may be served from the parts themselves: llama.cpp then reads every part's header.
        spans += [(p.offset, p.offset + p.header_size) for p in manifest.parts]
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def kv_from_entry(entry: KVEntry) -> KV:
    sub = GGUFValueType[entry.sub_type] if entry.sub_type else None
    return KV(entry.key, GGUFValueType[entry.type], entry.value, sub)


@dataclasses.dataclass(frozen=True)
class ShardSource:
    """Where a shard's bytes come from: a GGUF file laid out as the original model (complete, or a partially
    downloaded torrent file whose needed pieces are present), and the model's metadata.

    Build it with ``from_gguf`` (a complete local file) or ``from_manifest`` (a store: metadata from the manifest,
    tokenizer read from the file's header, which is checked against ``header_sha256`` first).
    """

    data_path: Path
    architecture: str
    n_layers: int
    alignment: int
    tensors: tuple[TensorLayout, ...]
    metadata: tuple[KV, ...]
    """Every key but ``tokenizer.*``."""
    tokenizer: tuple[KV, ...] | None = None
    """``tokenizer.*`` keys when already parsed; otherwise read from the header on demand."""
    manifest_id: str = ""
    header_size: int = 0
    header_sha256: str | None = None
    n_vocab: int = 0
    """Tokens in the vocabulary (llama.cpp keys a few settings on it)."""
    files: tuple[tuple[Path, int], ...] = ()
    """(path, size) of each part when the model is a split set (tensor offsets index their concatenation)."""

    @classmethod
    def from_gguf(cls, path: Path, *, manifest_id: str = "") -> ShardSource:
        layout = read_layout(path)
        meta = tuple(kv for kv in layout.fields if not kv.key.startswith("tokenizer."))
        tok = tuple(kv for kv in layout.fields if kv.key.startswith("tokenizer."))
        tokens = layout.value("tokenizer.ggml.tokens")
        n_vocab = len(tokens) if isinstance(tokens, list) else int(layout.value(f"{layout.architecture}.vocab_size", 0))
        return cls(path, layout.architecture, layout.n_layers, layout.alignment, tuple(layout.tensors), meta, tok,
                   manifest_id, layout.header_size, n_vocab=n_vocab,
                   files=tuple(layout.data_files) if layout.parts else ())

    @classmethod
    def from_manifest(cls, manifest: ModelManifest, data_path: Path) -> ShardSource:
        meta = tuple(kv_from_entry(e) for e in manifest.metadata)
        return cls(data_path, manifest.architecture, manifest.n_layers, manifest.alignment,
                   tuple(manifest_layouts(manifest)), meta, None, manifest.manifest_id, manifest.header_size,
                   manifest.header_sha256, n_vocab=manifest.n_vocab,
                   files=tuple(data_files(manifest, data_path)) if manifest.parts else ())

    def open_data(self) -> BinaryIO | ConcatReader:
        return ConcatReader(self.files) if self.files else self.data_path.open("rb")

    def cut_request(self, start: int, end: int) -> CutRequest:
        return CutRequest(self.architecture, self.n_layers, self.n_vocab, metadata_map(self.metadata), start, end,
                          where=str(self.data_path))

    def tokenizer_fields(self) -> list[KV]:
        if self.tokenizer is not None:
            return list(self.tokenizer)
        if self.header_sha256 is not None:
            with self.data_path.open("rb") as f:
                digest = hashlib.sha256(f.read(self.header_size)).hexdigest()
            if digest != self.header_sha256:
                raise ArtifactError(f"{self.data_path}: header (tokenizer) bytes do not match the manifest's "
                                    "header_sha256: not downloaded yet, or corrupt")
        # read_part: a split set's tokenizer is in its first part, which may be all this node downloaded.
        return [kv for kv in read_part(self.data_path).fields if kv.key.startswith("tokenizer.")]


_NUMPY_TYPES = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4", GGUFValueType.FLOAT32: "<f4", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8", GGUFValueType.BOOL: "?",
}


class _ArrayWriter(GGUFWriter):
    """GGUFWriter that packs arrays in bulk: the stock one packs a 262k-token vocabulary element by element (~1-4 s
    per shard); the bytes written are identical."""

    def _pack_val(self, val: Any, vtype: GGUFValueType, add_vtype: bool, sub_type: GGUFValueType | None = None
                  ) -> bytes:
        if vtype != GGUFValueType.ARRAY or sub_type is None or self.endianess != GGUFEndian.LITTLE or not val:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        head = struct.pack("<I", vtype) if add_vtype else b""
        head += struct.pack("<IQ", sub_type, len(val))
        if sub_type == GGUFValueType.STRING:
            pack = struct.Struct("<Q").pack
            items = [v.encode("utf-8") if isinstance(v, str) else v for v in val]
            return head + b"".join([pack(len(v)) + v for v in items])
        return head + np.asarray(val, dtype=_NUMPY_TYPES[sub_type]).tobytes()


def _add_fields(writer: GGUFWriter, fields: list[KV]) -> None:
    for kv in fields:
        writer.add_key_value(kv.key, kv.value, kv.type, kv.sub_type)


def _copy_range(src: BinaryIO | ConcatReader, dst: BinaryIO, t: TensorLayout) -> None:
    src.seek(t.offset)
    left = t.size
    while left:
        chunk = src.read(min(left, _COPY_CHUNK))
        if not chunk:
            raise ArtifactError(f"{t.name}: source file ends {left} bytes before the end of the tensor")
        dst.write(chunk)
        left -= len(chunk)


def _pad(f: BinaryIO, alignment: int) -> None:
    pos = f.tell()
    pad = -pos % alignment
    if pad:
        f.write(b"\0" * pad)


def _write_zeros(f: BinaryIO, size: int) -> None:
    # Large zero tensors become a hole: they take no disk space and llama.cpp reads zeros through mmap.
    if size >= 1 << 20:
        f.seek(size, os.SEEK_CUR)
    else:
        f.write(b"\0" * size)


def manifest_cut_request(manifest: ModelManifest, start: int, end: int) -> CutRequest:
    meta = {e.key: kv_from_entry(e).value for e in manifest.metadata}
    return CutRequest(manifest.architecture, manifest.n_layers, manifest.n_vocab, meta, start, end,
                      where=f"model {manifest.model_id[:12]} ({manifest.name or manifest.architecture})")


def _writer_for(source: ShardSource, plan: ShardPlan, dst: Path, pins: tuple[KV, ...]) -> GGUFWriter:
    spec = RangeSpec(source.architecture, source.n_layers, plan.start, plan.end, plan.keep_tokenizer,
                     source.manifest_id, pins)
    fields = list(source.metadata) + (source.tokenizer_fields() if plan.keep_tokenizer else [])
    writer = _ArrayWriter(dst, source.architecture)
    if source.alignment != writer.data_alignment:
        writer.add_custom_alignment(source.alignment)
    _add_fields(writer, shard_fields(fields, spec))
    return writer


def _tensor_list(source: ShardSource, plan: ShardPlan) -> list[TensorLayout | SyntheticTensor]:
    by_name = {t.name: t for t in source.tensors}
    items: list[TensorLayout | SyntheticTensor] = [by_name[n] for n in plan.copied]
    return items + list(plan.synthetic)


def write_shard(source: Path | ShardSource, dst: Path, start: int, end: int, *,
                allow_unproven: bool = False) -> Path:
    """Write the shard GGUF for layers ``[start, end)`` to ``dst`` (atomically: temp file, then rename).

    ``source`` is a complete GGUF path (then ``swarmroute.manifest_id`` is empty) or a ``ShardSource`` (from a
    store: ``ShardSource.from_manifest(manifest, data_file)``, which only needs the bytes ``needed_byte_ranges``
    lists). The source's tensor bytes are not re-hashed here: verify the shard (``artifacts.verify``) before use.
    The cut is checked first (``arch_support.check_cut``): an unproven architecture is refused unless
    ``allow_unproven``, a refused one always. Returns ``dst``.
    """
    src = source if isinstance(source, ShardSource) else ShardSource.from_gguf(source)
    check_range(start, end, src.n_layers)
    pins = check_cut(src.cut_request(start, end), allow_unproven=allow_unproven)
    plan = plan_shard(src.tensors, src.n_layers, start, end, architecture=src.architecture)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    writer = _writer_for(src, plan, tmp, pins)
    items = _tensor_list(src, plan)
    for t in items:
        # The writer wants numpy order (slowest dim first); raw_dtype keeps the quantized type as-is.
        writer.add_tensor_info(renumber(t.name, start), tuple(reversed(t.shape)), np.dtype(np.float32), t.size,
                               raw_dtype=t.ggml_type)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        out = writer.fout[0]
        with src.open_data() as data:
            for t in items:
                _pad(out, writer.data_alignment)
                if isinstance(t, SyntheticTensor):
                    _write_zeros(out, t.size)
                else:
                    _copy_range(data, out, t)
            out.truncate(out.tell())
        writer.close()
        os.replace(tmp, dst)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return dst


def shard_file_name(start: int, end: int) -> str:
    return f"shard-{start}-{end}.gguf"
