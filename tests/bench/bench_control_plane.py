"""The control plane at scale, simulated on this machine (issue #28 item 4).

Run all benchmarks with ``bash tests/bench/run``; this one alone from the repository root:
``python -m tests.bench.bench_control_plane [--nodes 250,1000,2000,4000] [--trackers 1,2] [--seconds 10]
[--churn 10] [--routes 100]``.

Each step (``tests/bench/control_plane.py``): a fresh nats-server, real ``swarmroute tracker`` processes, a
simulated fleet of ``--nodes`` lightweight nodes (heartbeats only, every 2 s, registry TTL 6 s) split over 4 layer
ranges of one 32-layer model, ``--churn`` joins or leaves per second and ``--routes`` route requests per second
(open loop) for ``--seconds``. The table shows, per step, the route latency the requesters saw, how many requests
got a route, routes naming a node gone longer than the TTL, the registry's put rate, NATS's message and byte
rates and CPU, each tracker's CPU, this process's CPU (the fleet and the requesters: near 100 % the step measures
the load generator, not the control plane) and how long a newly covered model took to route.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

from tests.bench.control_plane import HEADER, Load, run_step


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="250,1000,2000,4000")
    p.add_argument("--trackers", default="1,2")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--churn", type=float, default=10.0)
    p.add_argument("--routes", type=float, default=100.0)
    args = p.parse_args()
    print(f"control plane: {args.routes:g} route requests/s, {args.churn:g} joins or leaves/s, "
          f"{args.seconds:g} s per step, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print(HEADER, flush=True)
    for nodes in (int(n) for n in args.nodes.split(",")):
        for trackers in (int(t) for t in args.trackers.split(",")):
            load = Load(nodes=nodes, churn_per_s=args.churn, routes_per_s=args.routes, trackers=trackers,
                        seconds=args.seconds)
            with tempfile.TemporaryDirectory(prefix="bench-cp-") as tmp:
                result = asyncio.run(run_step(load, Path(tmp)))
            print(result.row(), flush=True)
            if result.outcomes.get("route", 0) < result.sent:
                print(f"  not routed: { {k: v for k, v in result.outcomes.items() if k != 'route'} }", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
