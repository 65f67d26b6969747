"""What ``swarmroute plan`` shows: how a model's layers would split across a set of nodes, and what each node must
hold.

Reads a GGUF header, a Model Artifact manifest (JSON) or a model shape file (TOML/JSON, see
``artifacts.shape_file``); ``render`` and ``plan_to_dict`` present a ``Plan`` (per-node layer ranges, weight and
cache bytes, bytes per decode hop, warnings for boundaries that should not be cut). The command line is
``swarmroute.plan_command``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType

from artifacts.gguf_shape import shape_from_gguf, shape_from_manifest
from artifacts.layer_split import Plan, gib
from artifacts.model_shape import ModelShape
from artifacts.shape_file import load_shape_file
from schemas.errors import BadRequestError
from schemas.manifest import MANIFEST_FORMAT, ModelManifest


def kv_itemsize(name: str) -> float:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name.upper()]]
    return size / block


def load_shape(path: Path, quant: str | None = None) -> ModelShape:
    """GGUF (by magic), manifest JSON (by its ``format``) or shape file."""
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise BadRequestError(f"cannot read {path}: {exc}") from exc
    if len(magic) == 4 and int.from_bytes(magic, "little") == GGUF_MAGIC:
        return shape_from_gguf(path)
    if path.suffix == ".json":
        doc = json.loads(path.read_text())
        if isinstance(doc, dict) and doc.get("format") == MANIFEST_FORMAT:
            return shape_from_manifest(ModelManifest.model_validate(doc), source=str(path))
    return load_shape_file(path, quant)


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    s, shape = plan.settings, plan.shape
    return {
        "model": shape.name, "arch": shape.arch, "source": shape.source, "n_layers": shape.n_layers,
        "hop_shape": list(shape.hop_shape), "context": s.context, "sessions": s.sessions,
        "kv_itemsize": s.kv_itemsize, "wire_dtype": s.wire_dtype.label, "reserve": s.reserve,
        "nodes": [{"label": a.node.label, "memory_bytes": a.node.memory_bytes, "layers": [a.start, a.end],
                   "roles": list(a.roles), "weight_bytes": a.weight_bytes, "kv_bytes_per_token": a.kv_bytes_per_token,
                   "kv_bytes": a.kv_bytes, "total_bytes": a.total_bytes, "usable_bytes": a.usable_bytes}
                  for a in plan.assignments],
        "unused_nodes": [n.label for n in plan.unused], "hop_bytes": list(plan.hop_bytes),
        "warnings": list(plan.warnings), "notes": list(plan.notes),
    }


def render(plan: Plan) -> str:
    s, shape = plan.settings, plan.shape
    lines = [f"{shape.name} ({shape.arch}) from {shape.source}",
             f"{shape.n_layers} layers, hop shape {'x'.join(map(str, shape.hop_shape))}, context {s.context} tokens "
             f"x {s.sessions} session(s), KV {s.kv_itemsize:g} B/value, wire {s.wire_dtype.label}, "
             f"reserve {s.reserve:.0%}", ""]
    header = f"{'node':>4}  {'memory':>9}  {'layers':>10}  {'roles':<13}  {'weights GiB':>11}  {'KV B/token':>10}  " \
             f"{'KV@ctx GiB':>10}  {'total GiB':>9}  {'use':>5}"
    lines += [header, "-" * len(header)]
    for i, a in enumerate(plan.assignments):
        lines.append(f"{i:>4}  {a.node.label:>9}  {f'[{a.start}, {a.end})':>10}  {','.join(a.roles) or '-':<13}  "
                     f"{gib(a.weight_bytes):>11}  {a.kv_bytes_per_token:>10,.0f}  {gib(a.kv_bytes):>10}  "
                     f"{gib(a.total_bytes):>9}  {a.utilization:>5.0%}")
    total_w = sum(a.weight_bytes for a in plan.assignments)
    total_kv = sum(a.kv_bytes for a in plan.assignments)
    per_token = sum(a.kv_bytes_per_token for a in plan.assignments)
    lines.append(f"{'all':>4}  {'':>9}  {'':>10}  {'':<13}  {gib(total_w):>11}  {per_token:>10,.0f}  "
                 f"{gib(total_kv):>10}  {gib(total_w + total_kv):>9}")
    if plan.unused:
        lines.append(f"unused nodes: {', '.join(n.label for n in plan.unused)}")
    if plan.hop_bytes:
        hops = ", ".join(f"{i}->{i + 1}: {b:,}" for i, b in enumerate(plan.hop_bytes))
        lines.append(f"decode hop bytes (one position, header included): {hops}; "
                     f"{sum(plan.hop_bytes):,} B per token across the route")
    lines += [f"warning: {w}" for w in plan.warnings] + [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
