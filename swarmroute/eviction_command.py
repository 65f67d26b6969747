"""``swarmroute evictions``: the nodes the trackers evicted for computing wrong (issue #28), and clearing one.

    swarmroute evictions list [--json]
    swarmroute evictions clear NODE_ID

A node found wrong by a spot check (and a referee) is never routed to again until its operator has fixed it (its
build, its hardware, its weights) and clears it here; the trackers route to it from its next heartbeat on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable

from bus.connection import connected
from bus.subjects import Subjects
from schemas.settings import Settings
from schemas.spot_check import Eviction


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
             common: Callable[[argparse.ArgumentParser], None],
             settings: Callable[[argparse.Namespace], Settings]) -> argparse.ArgumentParser:
    p = subparsers.add_parser("evictions", help="list evicted nodes, or clear one (issue #28)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="evictions_action", required=True)
    listing = actions.add_parser("list", help="every evicted node, with the evidence")
    common(listing)
    listing.add_argument("--json", action="store_true", help="print the evictions as JSON")
    clear = actions.add_parser("clear", help="let the trackers route to a node again")
    common(clear)
    clear.add_argument("node_id", help="the evicted node's id")
    p.set_defaults(func=lambda args: asyncio.run(run(args, settings(args))))
    return p


async def run(args: argparse.Namespace, settings: Settings) -> int:
    from actors.tracker.evictions import Evictions, open_evictions

    subjects = Subjects(settings.namespace)
    async with connected(settings, name="evictions") as nc:
        evictions = Evictions(nc, subjects, await open_evictions(nc, subjects,
                                                                 replicas=settings.registry_replicas))
        if args.evictions_action == "clear":
            cleared = await evictions.clear(args.node_id)
            if cleared is None:
                print(f"node {args.node_id} is not evicted", file=sys.stderr)
                return 1
            print(f"cleared node {args.node_id} (evicted {_ago(cleared.evicted_at)}: {cleared.reason})")
            await nc.flush()
            return 0
        found = await evictions.listing()
    if args.json:
        print(json.dumps([e.model_dump(mode="json") for e in found], indent=2))
    else:
        print(_table(found))
    return 0


def _table(found: list[Eviction]) -> str:
    if not found:
        return "no node is evicted"
    lines = [f"{'node':<20} {'layers':<10} {'evicted':<10} {'rule':<6} {'median rel err':>14} {'top-k':>6}  why"]
    for e in sorted(found, key=lambda e: e.evicted_at):
        v = e.checker
        lines.append(f"{e.node_id:<20} {str(e.layers):<10} {_ago(e.evicted_at):<10} {v.rule if v else '':<6} "
                     f"{(f'{v.median_rel_err:.3g}' if v else ''):>14} {(f'{v.median_top_k:.2f}' if v else ''):>6}  "
                     f"{e.reason}")
    return "\n".join(lines)


def _ago(at: float) -> str:
    seconds = max(0.0, time.time() - at)
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago" if seconds < 7200 else \
        f"{seconds / 3600:.0f}h ago"
