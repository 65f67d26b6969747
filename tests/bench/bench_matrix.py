"""The architecture matrix: how long building its tiny models and running them takes, against CI's budget.

Run all benchmarks with ``bash tests/bench/run``; this one alone from the repository root:
``python -m tests.bench.bench_matrix [--no-routes] [--cases llama,gemma3]``.

* ``build``   writing every case's GGUF (F16 and Q8_0 where the case has both) with ``artifacts.synthetic``;
* ``whole``   loading the whole GGUF in llama.cpp and the greedy reference run (prompt + decode steps);
* ``chains``  cutting and loading the shards of every split and running them (the backend chains of the test);
* ``routes``  every split of every case again as a route through real nodes, tracker, gateway and nats-server
              (what ``tests/test_arch_matrix.py`` runs).

Every time is wall time on this machine (shared: compare ratios from one run). Printed beside each case: the chain
time per split relative to the whole model's run (what cutting, loading several contexts and handing hidden states
on costs), and at the end the whole matrix against the 180 s the issue allows in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from artifacts.synthetic.matrix import MATRIX, MatrixCase
from bus.server import EmbeddedNats, NatsServerConfig
from tests.support.arch_matrix import RouteHarness, build, greedy, open_backend, open_chain, prompt_tokens

BUDGET_S = 180.0


def run_case(c: MatrixCase, quant: str, root: Path) -> tuple[float, float, int]:
    """(whole-model seconds, seconds for every chain of the case, number of chains)."""
    path = build(c, quant, root)
    began = time.perf_counter()
    whole = open_backend(path, root / f"{c.name}-{quant}.shards")
    try:
        tokens = prompt_tokens(whole)
        greedy([whole], tokens)
    finally:
        whole.close()
    whole_s = time.perf_counter() - began
    began = time.perf_counter()
    for bounds in c.splits.values():
        hops = open_chain(path, root / f"{c.name}-{quant}.shards", bounds)
        try:
            greedy(hops, tokens)
        finally:
            for h in hops:
                h.close()
    return whole_s, time.perf_counter() - began, len(c.splits)


async def run_routes(cases: list[MatrixCase], root: Path) -> dict[tuple[str, str], float]:
    server = EmbeddedNats(NatsServerConfig(store_dir=root / "nats"))
    server.start()
    harness = await RouteHarness.start(server, root / "home")
    out: dict[tuple[str, str], float] = {}
    try:
        for c in cases:
            for quant in c.quants:
                path = build(c, quant, root)
                began = time.perf_counter()
                for split in c.splits:
                    hops = open_chain(path, root / f"{c.name}-{quant}.shards", c.splits[split])
                    tokens = prompt_tokens(hops[0])
                    try:
                        await harness.route(hops, tokens)
                    finally:
                        for h in hops:
                            h.close()
                out[(c.name, quant)] = time.perf_counter() - began
    finally:
        await harness.stop()
        server.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", help="comma-separated case names (default: every case with splits)")
    parser.add_argument("--no-routes", action="store_true", help="skip the routes through real nodes")
    args = parser.parse_args()
    wanted = set(args.cases.split(",")) if args.cases else None
    cases = [c for c in MATRIX if c.splits and (wanted is None or c.name in wanted)]
    root = Path(tempfile.mkdtemp(prefix="bench-matrix-"))
    try:
        began = time.perf_counter()
        build_s: dict[tuple[str, str], float] = {}
        for c in MATRIX if wanted is None else cases:
            for quant in c.quants:
                t = time.perf_counter()
                build(c, quant, root)
                build_s[(c.name, quant)] = time.perf_counter() - t
        total_build = time.perf_counter() - began
        print(f"{'case':<22} {'quant':<5} {'build ms':>9} {'whole s':>8} {'chains s':>9} {'per chain/whole':>16}")
        run_total = 0.0
        for c in cases:
            for quant in c.quants:
                whole_s, chains_s, n = run_case(c, quant, root)
                run_total += whole_s + chains_s
                print(f"{c.name:<22} {quant:<5} {build_s[(c.name, quant)] * 1e3:>9.0f} {whole_s:>8.2f} "
                      f"{chains_s:>9.2f} {chains_s / n / whole_s:>16.2f}")
        route_total = 0.0
        if not args.no_routes:
            routes = asyncio.run(run_routes(cases, root))
            route_total = sum(routes.values())
            print()
            print(f"{'routes (every split)':<28} {'s':>6}")
            for (name, quant), seconds in routes.items():
                print(f"{name + ' ' + quant:<28} {seconds:>6.2f}")
        total = total_build + run_total + route_total
        print()
        print(f"build {total_build:.1f} s, backend runs {run_total:.1f} s, routes {route_total:.1f} s: "
              f"total {total:.1f} s = {total / BUDGET_S:.2f} of the {BUDGET_S:.0f} s CI budget")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
