"""``swarmroute plan MODEL --nodes 4x24GB``: how a model's layers would split across nodes (``artifacts.plan``)."""

from __future__ import annotations

import argparse
import json
import sys
from itertools import chain
from pathlib import Path

from artifacts.layer_split import KV_TYPES, PlanSettings, split
from schemas.errors import SwarmrouteError
from schemas.frame import WireDType
from swarmroute import argtypes


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``plan`` to a CLI; the handler is stored as ``func`` and returns the exit code."""
    p = subparsers.add_parser("plan", help="split a model's layers across nodes by memory",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="GGUF file, Model Artifact manifest (.json) or model shape file (.toml/.json)")
    p.add_argument("--node", action="append", metavar="SIZE", type=argtypes.node_size,
                   help="one node's memory, in route order (24GB, 80GiB)")
    p.add_argument("--nodes", action="append", metavar="NxSIZE", type=argtypes.node_count_sizes,
                   help="several equal nodes, e.g. 4x24GB")
    p.add_argument("--context", default=argtypes.tokens("128K"), type=argtypes.tokens,
                   help="tokens of context per session to size caches for (128K)")
    p.add_argument("--sessions", type=argtypes.positive, default=1,
                   help="concurrent sessions each node holds caches for (1)")
    p.add_argument("--kv-type", default="f16", choices=KV_TYPES, help="KV cache element type (f16)")
    p.add_argument("--wire-dtype", default="f32", choices=("f32", "f16"), help="activation frame dtype (f32)")
    p.add_argument("--quant", help="quantization profile of a shape file (default: the file's default_quant)")
    p.add_argument("--reserve", type=argtypes.fraction, default=0.10,
                   help="fraction of node memory kept free for compute buffers and the runtime (0.10)")
    p.add_argument("--strategy", choices=("balance", "fewest"), default="balance",
                   help="spread memory use over all nodes, or fill nodes in order and use as few as possible")
    p.add_argument("--split-groups", action="store_true",
                   help="when nothing else fits, cut groups whose shared state can travel in the frame (top-k "
                        "indices, token ids) and count those bytes in the hop")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from artifacts.plan import kv_itemsize, load_shape, plan_to_dict, render  # gguf: the gguf extra

    nodes = list(chain.from_iterable([*(args.node or []), *(args.nodes or [])]))
    if not nodes:
        print("swarmroute plan: give at least one node (--node 24GB or --nodes 4x24GB)", file=sys.stderr)
        return 2
    settings = PlanSettings(context=args.context, sessions=args.sessions, kv_itemsize=kv_itemsize(args.kv_type),
                            reserve=args.reserve, wire_dtype=WireDType.parse(args.wire_dtype),
                            balance=args.strategy == "balance", split_groups=args.split_groups)
    try:
        plan = split(load_shape(Path(args.model), args.quant), nodes, settings)
    except SwarmrouteError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    print(json.dumps(plan_to_dict(plan), indent=1) if args.json else render(plan))
    return 0
