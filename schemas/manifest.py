"""The Model Artifact manifest: everything a node needs to fetch, verify and shard one GGUF without a registry.

Identity is content-derived: ``model_id`` is the sha256 of the whole GGUF file, and ``manifest_id`` is the sha256 of
this manifest's canonical JSON (with ``manifest_id`` itself blanked), so two nodes that hold the same bytes agree on
both without asking anyone. The torrent is described by its v1 info dictionary fields (file name, piece size, piece
SHA-1s), from which every node rebuilds the same info-hash.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import Field, model_validator

from schemas.base import WireModel

MANIFEST_FORMAT: Literal["swarmroute.model-artifact"] = "swarmroute.model-artifact"


class KVEntry(WireModel):
    """One GGUF metadata key/value; ``type``/``sub_type`` are gguf ``GGUFValueType`` names (``UINT32``, ``ARRAY``)."""

    key: str
    type: str
    sub_type: str | None = Field(default=None, description="element type when type is ARRAY")
    value: Any


class TensorEntry(WireModel):
    """A tensor's place in the file: ``offset`` is absolute (from byte 0), ``shape`` is in GGML order (ne0 first)."""

    name: str
    ggml_type: str = Field(description="GGMLQuantizationType name, e.g. Q4_K")
    shape: list[int]
    offset: int = Field(ge=0)
    size: int = Field(ge=0)
    sha256: str

    @property
    def end(self) -> int:
        return self.offset + self.size


class TorrentFile(WireModel):
    """One file of a multi-file torrent (a split GGUF set): ``path`` inside the torrent's directory."""

    path: str
    length: int = Field(ge=0)


class TorrentLayout(WireModel):
    """The BitTorrent v1 view of the model: a one-file torrent named ``file_name``, or for a split GGUF set a
    multi-file torrent whose directory is ``file_name`` and whose ``files`` are the parts in order (pieces then
    span the concatenation of the parts)."""

    file_name: str
    piece_size: int = Field(gt=0)
    piece_sha1: list[str] = Field(description="hex SHA-1 of every piece, in order")
    info_hash: str = Field(description="hex SHA-1 of the bencoded info dictionary (private=1)")
    files: list[TorrentFile] = Field(default_factory=list, description="multi-file torrents only: the parts")

    @property
    def n_pieces(self) -> int:
        return len(self.piece_sha1)


class TensorGroups(WireModel):
    """Which tensors belong to what: ``layers[i]`` are block ``i``'s tensors; the rest is split by role."""

    layers: list[list[str]]
    embedding: list[str] = Field(default_factory=list, description="token lookup side: token_embd, position_embd...")
    output: list[str] = Field(default_factory=list, description="after the last layer: output_norm, output (lm_head)")
    shared: list[str] = Field(default_factory=list, description="used by every layer, e.g. rope_freqs: every shard")


class PartEntry(WireModel):
    """One file of a split GGUF set, at ``offset`` in the concatenation of the parts."""

    name: str
    offset: int = Field(ge=0)
    size: int = Field(gt=0)
    header_size: int = Field(gt=0)
    header_sha256: str
    sha256: str

    @property
    def end(self) -> int:
        return self.offset + self.size


class ModelManifest(WireModel):
    """A Model Artifact: one GGUF file described down to each tensor's bytes and each torrent piece."""

    format: Literal["swarmroute.model-artifact"] = MANIFEST_FORMAT
    model_id: str = Field(description="sha256 of the whole file: the content-derived identity")
    manifest_id: str = Field(default="", description="sha256 of this manifest's canonical JSON, manifest_id blanked")
    name: str = Field(default="", description="general.name, for humans")
    architecture: str
    n_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    n_vocab: int = Field(default=0, ge=0)
    file_type: str = Field(default="", description="dominant quantization, e.g. Q4_K_M (from general.file_type)")
    file_size: int = Field(gt=0)
    file_sha256: str
    header_size: int = Field(gt=0, description="bytes before the first tensor's data: metadata + tensor infos")
    header_sha256: str = Field(description="sha256 of bytes [0, header_size): the tokenizer lives here")
    alignment: int = Field(default=32, gt=0)
    tied_output: bool = Field(description="no output.weight: the lm_head is token_embd")
    metadata: list[KVEntry] = Field(description="every metadata key except tokenizer.* (read those from the header)")
    tensors: list[TensorEntry]
    groups: TensorGroups
    torrent: TorrentLayout
    parts: list[PartEntry] = Field(default_factory=list, description="split GGUF sets only: the files, in order; "
                                   "tensor offsets and file_size/file_sha256 then refer to their concatenation")

    @model_validator(mode="after")
    def _consistent(self) -> ModelManifest:
        if len(self.groups.layers) != self.n_layers:
            raise ValueError(f"groups.layers has {len(self.groups.layers)} entries for {self.n_layers} layers")
        names = {t.name for t in self.tensors}
        grouped = [n for g in self.groups.layers for n in g] + self.groups.embedding + self.groups.output
        grouped += self.groups.shared
        unknown = set(grouped) - names
        if unknown:
            raise ValueError(f"groups name tensors not in the manifest: {sorted(unknown)[:5]}")
        if len(grouped) != len(names) or set(grouped) != names:
            raise ValueError("every tensor must belong to exactly one group")
        return self

    def tensor(self, name: str) -> TensorEntry:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def metadata_value(self, key: str, default: Any = None) -> Any:
        for kv in self.metadata:
            if kv.key == key:
                return kv.value
        return default

    def _exclude(self) -> dict[str, Any] | None:
        # Fields added for split sets are left out when empty, so a single-file manifest keeps the id (and the
        # JSON) it had before they existed.
        exclude: dict[str, Any] = {}
        if not self.parts:
            exclude["parts"] = True
        if not self.torrent.files:
            exclude["torrent"] = {"files"}
        return exclude or None

    def compute_id(self) -> str:
        """sha256 of the canonical JSON with ``manifest_id`` blank: what ``manifest_id`` must equal."""
        body = self.model_dump(mode="json", exclude=self._exclude())
        body["manifest_id"] = ""
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(canonical.encode()).hexdigest()

    def with_id(self) -> ModelManifest:
        return self.model_copy(update={"manifest_id": self.compute_id()})

    def to_json(self) -> str:
        return self.model_dump_json(indent=1, exclude=self._exclude())
