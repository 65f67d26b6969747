"""Collect a synthetic model's metadata and tensor table, then write it as a GGUF with seeded random weights.

Shapes are given in GGML order (``ne0`` first), exactly as llama.cpp's ``create_tensor`` calls list them, so an
architecture's table can be checked line by line against ``src/models/<arch>.cpp``. Each tensor's values come from a
generator seeded by (seed, tensor name): adding or reordering tensors never changes the others.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import quantize

from artifacts.synthetic.vocab import Vocabulary, build_vocabulary, write_vocabulary

TensorKind = Literal["weight", "embedding", "norm", "bias", "router", "positive", "small"]
"""How values are drawn: ``weight`` ~ N(0, 1/ne0) and quantized; ``embedding`` likewise; ``norm`` ~ 1 + N(0, 0.1);
``bias``/``small`` ~ N(0, 0.1); ``router`` a matrix kept in F32 (llama-quantize never quantizes expert routers);
``positive`` in [1, 4) (rope frequency factors)."""

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

    def tensor(self, name: str, *shape: int, kind: TensorKind = "weight") -> None:
        self.tensors.append(TensorSpec(name, tuple(shape), kind))

    def block(self, il: int, stem: str, *shape: int, kind: TensorKind = "weight") -> None:
        """``blk.<il>.<stem>`` (``stem`` ends in .weight or .bias)."""
        self.tensor(f"blk.{il}.{stem}", *shape, kind=kind)

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
        self._fill(writer, quant, seed)
        writer.close()
        tmp.replace(path)
        return path

    def _fill(self, writer: GGUFWriter, quant: str, seed: int) -> None:
        writer.add_name(self.name)
        writer.add_file_type(int(_FILE_TYPES[quant]))
        for key, value, vtype, sub in self.metadata:
            writer.add_key_value(key, value, vtype, sub)
        write_vocabulary(writer, self.vocab)
        for spec in self.tensors:
            data, raw = _values(spec, quant, seed)
            writer.add_tensor(spec.name, data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _values(spec: TensorSpec, quant: str, seed: int) -> tuple[np.ndarray[Any, Any], GGMLQuantizationType | None]:
    rng = _rng(seed, spec.name)
    shape = tuple(reversed(spec.shape))  # numpy order: slowest dimension first
    ne0 = spec.shape[0]
    if spec.kind == "norm":
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32), None
    if spec.kind in ("bias", "small"):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32), None
    if spec.kind == "positive":
        return (1.0 + 3.0 * rng.random(shape)).astype(np.float32), None
    data = (rng.standard_normal(shape) / math.sqrt(ne0)).astype(np.float32)
    if spec.kind == "router" or len(spec.shape) < 2:
        return data, None
    qtype = QUANT_TYPES[quant]
    block = GGML_QUANT_SIZES[qtype][0]
    if qtype == GGMLQuantizationType.F16 or ne0 % block:
        # Rows that do not fill whole blocks stay F16, as llama-quantize falls back for them.
        return data.astype(np.float16), None
    return quantize(data, qtype), qtype
