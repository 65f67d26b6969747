"""Model shape files: a hand-written ``ModelShape`` (TOML or JSON) for models whose GGUF we do not have.

Weights are listed as tensors (name, GGML-order shape, role) per layer *kind*; a quantization profile maps each
role to a GGML type (``Q4_K``, ``MXFP4``...) or to a format named under ``[bits]`` (bits per weight, e.g. FP8 with
block scales), so one file gives the weight bytes of every published quantization. Layout::

    [model]    name, arch, hidden_size, hop_shape, context_length, default_quant, notes, sources
    [bits]     FORMAT = bits per weight, for formats that are not GGML types
    [quant.NAME]  role = "GGML type or [bits] format"
    [head] / [tail] / [shared]   tensors = [{ name, shape, role }]
    [kinds.KIND]   attention, tensors, kv = [{ elements, tokens_per_row, window }], state_elements
    [[layout]]     kind = "KIND", count = N      or   kinds = ["A", "B"], repeat = N
    [mtp]          kind = "KIND", count = N      (placed with the tail)
    [[groups]]     start, end, hard, reason [, size, carry_bytes]
                   (size: consecutive groups of `size` layers in [start, end); carry_bytes: what a frame must add
                   per position if the group is cut anyway)

See deploy/models/*.toml for worked examples with their sources.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from artifacts.model_shape import KVTerm, LayerGroup, LayerShape, ModelShape
from schemas.errors import BadRequestError


def load_shape_file(path: Path, quant: str | None = None) -> ModelShape:
    try:
        raw = path.read_bytes()
        doc: dict[str, Any] = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw.decode())
    except (OSError, ValueError) as exc:
        raise BadRequestError(f"{path} is not a readable model shape file: {exc}") from exc
    try:
        return _build(doc, quant, str(path))
    except (KeyError, TypeError, ValueError) as exc:
        raise BadRequestError(f"{path}: malformed model shape file: {exc!r}") from exc


def quant_profiles(path: Path) -> list[str]:
    return list(tomllib.loads(path.read_text()).get("quant", {}))


class _Pricer:
    """Bytes of a tensor under one quantization profile."""

    def __init__(self, doc: dict[str, Any], quant: str) -> None:
        profiles: dict[str, dict[str, str]] = doc.get("quant", {})
        if quant not in profiles:
            raise BadRequestError(f"unknown quantization {quant!r}; this file has: {', '.join(profiles) or 'none'}")
        self.profile = profiles[quant]
        self.bits: dict[str, float] = {k: float(v) for k, v in doc.get("bits", {}).items()}

    def tensor_bytes(self, tensor: dict[str, Any]) -> int:
        n = math.prod(int(d) for d in tensor["shape"])
        fmt = self.profile.get(tensor["role"])
        if fmt is None:
            raise BadRequestError(f"quantization profile has no type for role {tensor['role']!r}")
        if fmt in self.bits:
            return math.ceil(n * self.bits[fmt] / 8)
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
        return math.ceil(n / block) * type_size

    def sum(self, tensors: list[dict[str, Any]]) -> int:
        return sum(self.tensor_bytes(t) for t in tensors)


def _layer(index: int, kind_name: str, kinds: dict[str, Any], pricer: _Pricer) -> LayerShape:
    kind = kinds[kind_name]
    kv = tuple(KVTerm(int(t["elements"]), int(t.get("tokens_per_row", 1)),
                      int(t["window"]) if t.get("window") else None) for t in kind.get("kv", []))
    return LayerShape(index, str(kind.get("attention", kind_name)), pricer.sum(kind.get("tensors", [])), kv,
                      int(kind.get("state_elements", 0)))


def _kind_sequence(layout: list[dict[str, Any]]) -> list[str]:
    sequence: list[str] = []
    for entry in layout:
        if "kind" in entry:
            sequence += [str(entry["kind"])] * int(entry.get("count", 1))
        else:
            sequence += [str(k) for k in entry["kinds"]] * int(entry.get("repeat", 1))
    return sequence


def _groups(entries: list[dict[str, Any]]) -> tuple[LayerGroup, ...]:
    groups: list[LayerGroup] = []
    for g in entries:
        start, end, size = int(g["start"]), int(g["end"]), int(g.get("size", 0))
        spans = [(s, min(s + size, end)) for s in range(start, end, size)] if size else [(start, end)]
        groups += [LayerGroup(s, e, bool(g.get("hard", True)), str(g["reason"]), int(g.get("carry_bytes", 0)))
                   for s, e in spans]
    return tuple(groups)


def _build(doc: dict[str, Any], quant: str | None, source: str) -> ModelShape:
    model = doc["model"]
    quant = quant or str(model.get("default_quant") or next(iter(doc.get("quant", {})), ""))
    pricer = _Pricer(doc, quant)
    kinds: dict[str, Any] = doc["kinds"]
    layers = tuple(_layer(i, k, kinds, pricer) for i, k in enumerate(_kind_sequence(doc["layout"])))
    mtp_doc = doc.get("mtp")
    mtp = tuple(_layer(len(layers) + i, str(mtp_doc["kind"]), kinds, pricer)
                for i in range(int(mtp_doc.get("count", 1)))) if mtp_doc else ()
    n_layers = int(model.get("n_layers", len(layers)))
    if n_layers != len(layers):
        raise ValueError(f"layout gives {len(layers)} layers, model.n_layers says {n_layers}")
    return ModelShape(
        name=str(model["name"]), arch=str(model.get("arch", "")), hidden_size=int(model["hidden_size"]),
        hop_shape=tuple(int(d) for d in model.get("hop_shape", [model["hidden_size"]])),
        context_length=int(model["context_length"]), layers=layers,
        head_bytes=pricer.sum(doc.get("head", {}).get("tensors", [])),
        tail_bytes=pricer.sum(doc.get("tail", {}).get("tensors", [])),
        shared_bytes=pricer.sum(doc.get("shared", {}).get("tensors", [])),
        tail_needs_embedding=bool(doc.get("tail", {}).get("needs_embedding", False)), mtp_layers=mtp,
        groups=_groups(doc.get("groups", [])), source=f"{source} ({quant})",
        notes=tuple(str(n) for n in model.get("notes", [])))
