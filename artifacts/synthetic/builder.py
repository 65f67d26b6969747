"""Collect a synthetic model's metadata and tensor table, then write it as a GGUF with seeded random weights.

Shapes are given in GGML order (``ne0`` first), exactly as llama.cpp's ``create_tensor`` calls list them, so an
architecture's table can be checked line by line against ``src/models/<arch>.cpp``. Each tensor's values come from a
generator seeded by (seed, tensor name): adding or reordering tensors never changes the others.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import quantize

from artifacts.synthetic.vocab import Vocabulary, build_vocabulary, write_vocabulary

logging.getLogger("gguf.gguf_writer").setLevel(logging.WARNING)  # it logs every file it writes at INFO

TensorKind = Literal["weight", "embedding", "norm", "bias", "router", "positive", "negative", "small", "expert_ids"]
"""How values are drawn: ``weight`` ~ N(0, 1/ne0) and quantized; ``embedding`` likewise; ``norm`` ~ 1 + N(0, 0.1);
``bias``/``small`` ~ N(0, 0.1); ``router`` a matrix kept in F32 (llama-quantize never quantizes expert routers);
``positive`` in [1, 4) (rope frequency factors); ``negative`` in (-4, -1] (a recurrent decay rate, so the
state decays); ``expert_ids`` I32 rows of ``ne0`` distinct ids below
``TensorSpec.bound`` (a hash router's token -> experts table)."""

STREAM_ELEMENTS = 1 << 28
"""Models with more weights than this are written tensor by tensor, large tensors in row chunks, so that memory
stays near one chunk (a real-width model's embedding alone is 0.5 G values): GGUFWriter otherwise holds every
tensor until the end."""
_CHUNK_ELEMENTS = 1 << 24

QUANT_TYPES: dict[str, GGMLQuantizationType] = {
    "F16": GGMLQuantizationType.F16, "Q8_0": GGMLQuantizationType.Q8_0, "Q4_0": GGMLQuantizationType.Q4_0,
}
_FILE_TYPES = {"F16": LlamaFileType.MOSTLY_F16, "Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q4_0": LlamaFileType.MOSTLY_Q4_0}


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    """GGML order: ``ne0`` (the contiguous dimension) first."""
    kind: TensorKind = "weight"
    bound: int = 0
    """``expert_ids``: the number of experts."""


@dataclasses.dataclass
class ModelBuilder:
    """The GGUF of one synthetic model, before it is written."""

    arch: str
    name: str
    vocab: Vocabulary = dataclasses.field(default_factory=build_vocabulary)
    metadata: list[tuple[str, Any, GGUFValueType, GGUFValueType | None]] = dataclasses.field(default_factory=list)
    tensors: list[TensorSpec] = dataclasses.field(default_factory=list)

    @property
    def n_vocab(self) -> int:
        return self.vocab.size

    # --- metadata (keys relative to the architecture unless they contain a dot at the front) ---------------------

    def _key(self, key: str) -> str:
        return key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"

    def _put(self, key: str, value: Any, vtype: GGUFValueType, sub: GGUFValueType | None = None) -> None:
        """Set ``key``, replacing an earlier value (an architecture may override a common default)."""
        full = self._key(key)
        self.metadata = [m for m in self.metadata if m[0] != full]
        self.metadata.append((full, value, vtype, sub))

    def u32(self, key: str, value: int) -> None:
        self._put(key, int(value), GGUFValueType.UINT32)

    def f32(self, key: str, value: float) -> None:
        self._put(key, float(value), GGUFValueType.FLOAT32)

    def boolean(self, key: str, value: bool) -> None:
        self._put(key, bool(value), GGUFValueType.BOOL)

    def string(self, key: str, value: str) -> None:
        self._put(key, value, GGUFValueType.STRING)

    def array(self, key: str, values: list[Any], sub: GGUFValueType) -> None:
        self._put(key, list(values), GGUFValueType.ARRAY, sub)

    # --- tensors ------------------------------------------------------------------------------------------------

    def tensor(self, name: str, *shape: int, kind: TensorKind = "weight", bound: int = 0) -> None:
        self.tensors.append(TensorSpec(name, tuple(shape), kind, bound))

    def block(self, il: int, stem: str, *shape: int, kind: TensorKind = "weight", bound: int = 0) -> None:
        """``blk.<il>.<stem>`` (``stem`` ends in .weight or .bias)."""
        self.tensor(f"blk.{il}.{stem}", *shape, kind=kind, bound=bound)

    # --- writing ------------------------------------------------------------------------------------------------

    def write(self, path: Path, *, quant: str = "F16", seed: int = 0, split_max_tensors: int = 0) -> Path:
        """Write the model to ``path``; with ``split_max_tensors`` as a split set of parts holding at most that many
        tensors each (gguf-py's writer: ``<stem>-0000i-of-0000n.gguf`` next to ``path``), returning the first."""
        if quant not in QUANT_TYPES:
            raise ValueError(f"quantization {quant!r} is not one of {sorted(QUANT_TYPES)}")
        path.parent.mkdir(parents=True, exist_ok=True)
        if split_max_tensors:
            writer = GGUFWriter(path, self.arch, split_max_tensors=split_max_tensors)
            self._fill(writer, quant, seed)
            first = writer.format_shard_names(path)[0]
            writer.close()
            return first
        tmp = path.with_name(f".{path.name}.tmp")
        writer = GGUFWriter(tmp, self.arch)
        if sum(int(np.prod(t.shape)) for t in self.tensors) > STREAM_ELEMENTS:
            self._stream(writer, quant, seed)
        else:
            self._fill(writer, quant, seed)
        writer.close()
        tmp.replace(path)
        return path

    def _header(self, writer: GGUFWriter, quant: str) -> None:
        writer.add_name(self.name)
        writer.add_file_type(int(_FILE_TYPES[quant]))
        for key, value, vtype, sub in self.metadata:
            writer.add_key_value(key, value, vtype, sub)
        write_vocabulary(writer, self.vocab)

    def _stream(self, writer: GGUFWriter, quant: str, seed: int) -> None:
        self._header(writer, quant)
        types = [_ggml_type(spec, quant) for spec in self.tensors]
        for spec, qtype in zip(self.tensors, types, strict=True):
            writer.add_tensor_info(spec.name, tuple(reversed(spec.shape)), np.dtype(np.float32),
                                   _nbytes(spec.shape, qtype), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        out = writer.fout[0]
        for spec in self.tensors:
            out.write(b"\0" * (-out.tell() % writer.data_alignment))
            for chunk in _chunks(spec, quant, seed):
                chunk.tofile(out)

    def _fill(self, writer: GGUFWriter, quant: str, seed: int) -> None:
        self._header(writer, quant)
        for spec in self.tensors:
            data, raw = _values(spec, quant, seed)
            writer.add_tensor(spec.name, data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _expert_ids(rng: np.random.Generator, shape: tuple[int, ...], bound: int) -> np.ndarray[Any, Any]:
    rows, used = int(np.prod(shape[:-1])), shape[-1]
    if bound < used:
        raise ValueError(f"{used} distinct expert ids per row need at least {used} experts, got {bound}")
    return np.argsort(rng.random((rows, bound)), axis=1)[:, :used].astype(np.int32).reshape(shape)


def _ggml_type(spec: TensorSpec, quant: str) -> GGMLQuantizationType:
    """The type ``_values`` gives ``spec``, without drawing its values."""
    if spec.kind == "expert_ids":
        return GGMLQuantizationType.I32
    if spec.kind in ("norm", "bias", "small", "positive", "negative", "router") or len(spec.shape) < 2:
        return GGMLQuantizationType.F32
    qtype = QUANT_TYPES[quant]
    if qtype == GGMLQuantizationType.F16 or spec.shape[0] % GGML_QUANT_SIZES[qtype][0]:
        return GGMLQuantizationType.F16
    return qtype


def _nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) // block * type_size


def _chunks(spec: TensorSpec, quant: str, seed: int) -> Iterator[np.ndarray[Any, Any]]:
    """``_values(spec, ...)`` as raw arrays in file order, a slab of rows (slowest dimension) at a time: one draw
    stream, so the values are those of one draw of the whole tensor."""
    qtype = _ggml_type(spec, quant)
    shape = tuple(reversed(spec.shape))
    per_row = int(np.prod(shape[1:]))
    if spec.kind not in ("weight", "embedding") or int(np.prod(shape)) <= _CHUNK_ELEMENTS:
        yield _values(spec, quant, seed)[0]
        return
    rng, rows = _rng(seed, spec.name), max(1, _CHUNK_ELEMENTS // per_row)
    for lo in range(0, shape[0], rows):
        n = min(rows, shape[0] - lo)
        data = (rng.standard_normal((n, *shape[1:])) / math.sqrt(spec.shape[0])).astype(np.float32)
        yield data.astype(np.float16) if qtype == GGMLQuantizationType.F16 else quantize(data, qtype)


def _values(spec: TensorSpec, quant: str, seed: int) -> tuple[np.ndarray[Any, Any], GGMLQuantizationType | None]:
    rng = _rng(seed, spec.name)
    shape = tuple(reversed(spec.shape))  # numpy order: slowest dimension first
    ne0 = spec.shape[0]
    if spec.kind == "expert_ids":
        return _expert_ids(rng, shape, spec.bound), None
    if spec.kind == "norm":
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32), None
    if spec.kind in ("bias", "small"):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32), None
    if spec.kind == "positive":
        return (1.0 + 3.0 * rng.random(shape)).astype(np.float32), None
    if spec.kind == "negative":
        return -(1.0 + 3.0 * rng.random(shape)).astype(np.float32), None
    data = (rng.standard_normal(shape) / math.sqrt(ne0)).astype(np.float32)
    if spec.kind == "router" or len(spec.shape) < 2:
        return data, None
    qtype = QUANT_TYPES[quant]
    block = GGML_QUANT_SIZES[qtype][0]
    if qtype == GGMLQuantizationType.F16 or ne0 % block:
        # Rows that do not fill whole blocks stay F16, as llama-quantize falls back for them.
        return data.astype(np.float16), None
    return quantize(data, qtype), qtype
