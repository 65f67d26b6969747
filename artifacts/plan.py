"""``swarmroute plan``: how a model's layers would split across a set of nodes, and what each node must hold.

Reads a GGUF header, a Model Artifact manifest (JSON) or a model shape file (TOML/JSON, see
``artifacts.shape_file``), and node memory sizes; prints per-node layer ranges, weight and cache bytes, bytes per
decode hop, and warnings for boundaries that should not be cut. ``register`` adds the sub-command to the CLI;
``python -m artifacts.plan`` runs it alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType

from artifacts.gguf_shape import shape_from_gguf, shape_from_manifest
from artifacts.layer_split import Plan, PlanSettings, gib, parse_nodes, parse_tokens, split
from artifacts.model_shape import ModelShape
from artifacts.shape_file import load_shape_file
from schemas.errors import BadRequestError, SwarmrouteError
from schemas.frame import WireDType
from schemas.manifest import MANIFEST_FORMAT, ModelManifest

KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_0", "q4_0")
"""Cache types llama.cpp accepts for ``--cache-type-k/v``."""


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


def settings_from_args(args: argparse.Namespace) -> PlanSettings:
    if not 0 <= args.reserve < 1:
        raise BadRequestError("--reserve is a fraction in [0, 1)")
    if args.sessions < 1:
        raise BadRequestError("--sessions must be at least 1")
    return PlanSettings(context=parse_tokens(args.context), sessions=args.sessions,
                        kv_itemsize=kv_itemsize(args.kv_type), reserve=args.reserve,
                        wire_dtype=WireDType.parse(args.wire_dtype), balance=args.strategy == "balance",
                        split_groups=args.split_groups)


def plan_from_args(args: argparse.Namespace) -> Plan:
    specs = list(args.node or []) + list(args.nodes or [])
    nodes = parse_nodes(specs)
    return split(load_shape(Path(args.model), args.quant), nodes, settings_from_args(args))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="GGUF file, Model Artifact manifest (.json) or model shape file (.toml/.json)")
    p.add_argument("--node", action="append", metavar="SIZE", help="one node's memory, in route order (24GB, 80GiB)")
    p.add_argument("--nodes", action="append", metavar="NxSIZE", help="several equal nodes, e.g. 4x24GB")
    p.add_argument("--context", default="128K", help="tokens of context per session to size caches for (128K)")
    p.add_argument("--sessions", type=int, default=1, help="concurrent sessions each node holds caches for (1)")
    p.add_argument("--kv-type", default="f16", choices=KV_TYPES, help="KV cache element type (f16)")
    p.add_argument("--wire-dtype", default="f32", choices=("f32", "f16"), help="activation frame dtype (f32)")
    p.add_argument("--quant", help="quantization profile of a shape file (default: the file's default_quant)")
    p.add_argument("--reserve", type=float, default=0.10,
                   help="fraction of node memory kept free for compute buffers and the runtime (0.10)")
    p.add_argument("--strategy", choices=("balance", "fewest"), default="balance",
                   help="spread memory use over all nodes, or fill nodes in order and use as few as possible")
    p.add_argument("--split-groups", action="store_true",
                   help="when nothing else fits, cut groups whose shared state can travel in the frame (top-k "
                        "indices, token ids) and count those bytes in the hop")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``plan`` to a CLI; the handler is stored as ``func`` and returns the exit code."""
    p = subparsers.add_parser("plan", help="split a model's layers across nodes by memory",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        plan = plan_from_args(args)
    except SwarmrouteError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    print(json.dumps(plan_to_dict(plan), indent=1) if args.json else render(plan))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m artifacts.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


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


if __name__ == "__main__":
    raise SystemExit(main())
