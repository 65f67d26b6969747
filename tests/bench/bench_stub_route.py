"""What one more hop costs a decode step, and how many bytes cross a hop per token, on stub routes over loopback.

Run all benchmarks with ``bash tests/bench/run``; this one alone from the repository root:
``python -m tests.bench.bench_stub_route [--tokens 64] [--rounds 5] [--no-processes]``.

The stub backend (hidden state shaped like Gemma 3 270M's, 640 floats; 6 layers, so its compute stays small next
to the hops) costs the same total compute however its layers are split, so the difference between a k-node and a
1-node route is the route's own overhead: per added hop = (T_k - T_1) / (k - 1), where T_k is the median time per
decoded token. T_k is measured twice:

* ``gateway``  the interval between streamed chunks at an official openai client (everything a user sees);
* ``bus``      the interval between the head's token events on NATS (the ring alone, without gateway and SSE).

The telemetry's own ``hop_overhead_ms`` (step wall time minus compute on every hop, per ring link: k links for k
nodes, the tail -> head token return included) is printed beside it. Configurations are interleaved round by round;
figures are medians over all rounds, and ``best`` is the fastest round's median (on a machine shared with other jobs,
the round least disturbed by them).

Two placements: every actor in this process (one event loop: the per-hop figure includes both ends of every link),
and, unless ``--no-processes``, nodes as ``swarmroute node`` child processes (each with its own event loop; tracker
and gateway stay here).

Wire bytes per decode hop come from a TCP proxy (tests.support.proxy.CountingProxy) in front of every node: the
activation frame (fixed header + dims + hop stamps + payload), the HTTP request carrying it, and the token that
returns to the head once per step.
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
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import openai

from actors.backends.stub import StubBackend, StubConfig
from actors.tracker import Tracker
from bus import codec
from bus import frame as frames
from bus.server import EmbeddedNats, NatsServerConfig
from bus.subjects import Subjects
from gateway.app import Gateway
from schemas.frame import MAGIC, FrameKind
from schemas.session import TokenEvent
from schemas.settings import Settings
from swarmroute.fleet_members import split_layers
from tests.support.proxy import CountingProxy
from tests.support.swarm import Swarm, Swarms, make_settings, start_swarm, wait_model

MODEL = "stub-bench"
N_LAYERS = 6  # few layers: the stub's compute is noise here, the hops are the subject
HIDDEN = (640,)
PROMPT = "Benchmark the route: " * 4
TARGET_MS = 0.5
PEER_MS = 4.9  # mesh-llm, per stage boundary (docs: /work/shared/notes/peers.md)
ROUTES = (1, 2, 3)


def split(k: int) -> list[tuple[int, int]]:
    """The layers of a ``k``-node route, split as ``swarmroute up`` splits them."""
    return split_layers(N_LAYERS, k)


@dataclass
class Samples:
    gateway_ms: list[float] = field(default_factory=list)
    bus_ms: list[float] = field(default_factory=list)
    hop_overhead_ms: list[float] = field(default_factory=list)
    round_bus_ms: list[float] = field(default_factory=list)
    """Median of each round's bus intervals."""

    def median(self, name: str) -> float | None:
        values: list[float] = getattr(self, name)
        return statistics.median(values) if values else None

    def best(self) -> float | None:
        return min(self.round_bus_ms) if self.round_bus_ms else None


class BusClock:
    """Arrival time of every token event on NATS, per session (a plain subscriber, like any monitoring tool)."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    async def on_msg(self, msg: Any) -> None:
        now = time.perf_counter()
        with contextlib.suppress(codec.DecodeError):
            event = codec.decode(msg.data, TokenEvent)
            self.times.setdefault(event.session_id, []).append(now)


def intervals_ms(times: list[float]) -> list[float]:
    return [(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)]


async def one_generation(base_url: str, tokens: int, clock: BusClock, out: Samples) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0)
    stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    arrivals: list[float] = []
    sid = ""
    overhead: float | None = None
    async for chunk in stream:
        sid = chunk.id.removeprefix("cmpl-")
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter())
        telemetry = (chunk.model_extra or {}).get("swarmroute")
        if telemetry and telemetry.get("hop_overhead_ms") is not None:
            overhead = float(telemetry["hop_overhead_ms"])
    # The first token comes out of prefill: only decode steps count.
    out.gateway_ms.extend(intervals_ms(arrivals)[1:])
    bus = intervals_ms(clock.times.pop(sid, []))[1:]
    out.bus_ms.extend(bus)
    if bus:
        out.round_bus_ms.append(statistics.median(bus))
    if overhead is not None:
        out.hop_overhead_ms.append(overhead)


# ---- placements ----------------------------------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def in_process(settings: Settings, k: int) -> AsyncIterator[str]:
    backends = [StubBackend(StubConfig(model=MODEL, n_layers=N_LAYERS, layer_start=a, layer_end=b,
                                       hidden_shape=HIDDEN)) for a, b in split(k)]
    swarm = await start_swarm(settings, backends, model_id=MODEL)
    try:
        yield swarm.base_url
    finally:
        await swarm.stop()


@contextlib.asynccontextmanager
async def as_processes(settings: Settings, k: int) -> AsyncIterator[str]:
    hidden = "x".join(map(str, HIDDEN))
    specs = [(f"p{k}-{i}", ["--backend", "stub", "--model", MODEL, "--model-id", MODEL, "--layers", f"{a}:{b}",
                            "--n-layers", str(N_LAYERS), "--hidden-shape", hidden])
             for i, (a, b) in enumerate(split(k))]
    async with Swarms() as swarms:  # stops the gateway, the tracker, then the nodes
        await asyncio.gather(*(swarms.node_process(settings, nid, args) for nid, args in specs))
        tracker = await swarms.actor(Tracker(settings))
        gateway = await swarms.actor(Gateway(settings, port=0))
        await wait_model(tracker, MODEL, timeout=60, n_nodes=k)
        yield gateway.url + "/v1"


async def measure(server: EmbeddedNats, home: Path, placement: str, tokens: int, rounds: int) -> dict[int, Samples]:
    results = {k: Samples() for k in ROUTES}
    opened: dict[int, tuple[contextlib.AbstractAsyncContextManager[str], str, BusClock]] = {}
    nc = await nats.connect(server.url)
    try:
        for k in ROUTES:  # every route in its own namespace, all up at once so rounds can interleave
            settings = make_settings(server.url, home / f"{placement}{k}", namespace=f"bench-{placement}-{k}")
            cm: contextlib.AbstractAsyncContextManager[str] = (
                in_process(settings, k) if placement == "in-process" else as_processes(settings, k))
            url = await cm.__aenter__()
            clock = BusClock()
            await nc.subscribe(Subjects(settings.namespace).tokens("*"), cb=clock.on_msg)
            opened[k] = (cm, url, clock)
            await one_generation(url, tokens, clock, Samples())  # warm-up: connections, caches
        for _ in range(rounds):
            for k in ROUTES:
                _, url, clock = opened[k]
                await one_generation(url, tokens, clock, results[k])
    finally:
        for cm, _, _ in opened.values():
            await cm.__aexit__(None, None, None)
        await nc.drain()
    return results


# ---- wire bytes ----------------------------------------------------------------------------------------------------

@dataclass
class Request:
    line: str
    total: int
    body: bytes


def requests_of(data: bytes) -> list[Request]:
    """Split a recorded client->server byte stream into HTTP requests (Content-Length framing)."""
    out: list[Request] = []
    i = 0
    while (end := data.find(b"\r\n\r\n", i)) >= 0:
        head = data[i:end].decode("latin-1")
        length = 0
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        out.append(Request(head.split("\r\n", 1)[0], end + 4 + length - i, data[end + 4:end + 4 + length]))
        i = end + 4 + length
    return out


@dataclass
class WireBytes:
    frame: int
    payload: int
    request: int
    token_return: int
    decode_frames: int


async def wire_bytes(server: EmbeddedNats, home: Path, tokens: int) -> WireBytes:
    settings = make_settings(server.url, home / "wire", namespace="bench-wire")
    backends = [StubBackend(StubConfig(model=MODEL, n_layers=N_LAYERS, layer_start=a, layer_end=b,
                                       hidden_shape=HIDDEN)) for a, b in split(2)]
    swarm: Swarm = await start_swarm(settings, backends, model_id=MODEL)
    proxies = [await CountingProxy.start(n.server.port) for n in swarm.nodes]
    try:
        for node, proxy in zip(swarm.nodes, proxies, strict=True):
            await swarm.route_through(node, proxy.url, timeout=5)
        await one_generation(swarm.base_url, tokens, BusClock(), Samples())
        into_tail = requests_of(bytes(proxies[1].upstream))
        into_head = requests_of(bytes(proxies[0].upstream))
        decode = [r for r in into_tail if r.body[:4] == MAGIC
                  and frames.decode(r.body)[0].kind is FrameKind.DECODE]
        returns = [r for r in into_head if r.line.startswith("POST") and r.line.split()[1].endswith("/tokens")]
        if not decode or not returns:
            raise RuntimeError("no decode frames or token returns crossed the proxies")
        header = frames.decode(decode[0].body)[0]
        return WireBytes(frame=int(statistics.median(len(r.body) for r in decode)), payload=header.payload_bytes,
                         request=int(statistics.median(r.total for r in decode)),
                         token_return=int(statistics.median(r.total for r in returns)), decode_frames=len(decode))
    finally:
        for proxy in proxies:
            await proxy.stop()
        await swarm.stop()


# ---- report --------------------------------------------------------------------------------------------------------

def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def per_hop(results: dict[int, Samples], name: str) -> dict[int, float | None]:
    def t_of(k: int) -> float | None:
        return results[k].best() if name == "best" else results[k].median(name)

    base = t_of(1)
    out: dict[int, float | None] = {}
    for k in ROUTES[1:]:
        t = t_of(k)
        out[k] = None if base is None or t is None else (t - base) / (k - 1)
    return out


def report(placement: str, results: dict[int, Samples], tokens: int, rounds: int) -> None:
    print(f"\n{placement}: {rounds} rounds x {tokens} tokens per route, medians, ms")
    hop_gw, hop_bus, hop_best = per_hop(results, "gateway_ms"), per_hop(results, "bus_ms"), per_hop(results, "best")
    header = (f"{'route':<9}{'T gateway':>11}{'T bus':>9}{'T best':>9}{'per hop gw':>12}{'per hop bus':>13}"
              f"{'per hop best':>14}{'telemetry/link':>16}{'vs T_1 (bus)':>14}")
    print(header)
    print("-" * len(header))
    base_bus = results[1].median("bus_ms")
    for k in ROUTES:
        r = results[k]
        t_bus = r.median("bus_ms")
        ratio = t_bus / base_bus if t_bus is not None and base_bus else None
        print(f"{k} node{'s' if k > 1 else ' '}  {fmt(r.median('gateway_ms')):>11}{fmt(r.median('bus_ms')):>9}"
              f"{fmt(r.best()):>9}{fmt(hop_gw.get(k)):>12}{fmt(hop_bus.get(k)):>13}{fmt(hop_best.get(k)):>14}"
              f"{fmt(r.median('hop_overhead_ms')):>16}{fmt(ratio, 2) + 'x':>14}")


def verdict(name: str, value: float | None) -> None:
    if value is None:
        print(f"{name:<48} -")
        return
    print(f"{name:<48} {value:7.3f} ms   target <= {TARGET_MS} ms: {value / TARGET_MS:5.2f}x of target   "
          f"peer {PEER_MS} ms: {value / PEER_MS:5.2f}x of peer ({PEER_MS / value if value > 0 else float('inf'):.1f}x "
          f"less)")


async def run(tokens: int, rounds: int, processes: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-stub-route-") as tmp:
        server = EmbeddedNats(NatsServerConfig(store_dir=Path(tmp) / "nats"))
        server.start()
        try:
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            print(f"stub route on loopback: hidden {HIDDEN} f32, {N_LAYERS} layers split evenly over 1, 2, 3 nodes; "
                  f"{os.cpu_count()} CPUs, load average {load} (a loaded machine inflates every figure)")
            placements = ["in-process"] + (["processes"] if processes else [])
            summary: dict[str, tuple[dict[int, float | None], dict[int, float | None], dict[int, float | None],
                                     float | None]] = {}
            for placement in placements:
                results = await measure(server, Path(tmp), placement, tokens, rounds)
                report(placement, results, tokens, rounds)
                summary[placement] = (per_hop(results, "gateway_ms"), per_hop(results, "bus_ms"),
                                      per_hop(results, "best"), results[ROUTES[-1]].median("hop_overhead_ms"))
            wire = await wire_bytes(server, Path(tmp), tokens)
        finally:
            server.stop()
    print("\nper-hop overhead of a decode step (per added hop = (T_3 - T_1) / 2; telemetry = per ring link, 3 nodes)")
    for placement, (gw, bus, best, tele) in summary.items():
        verdict(f"{placement}: per added hop, through the gateway", gw.get(3))
        verdict(f"{placement}: per added hop, on the bus", bus.get(3))
        verdict(f"{placement}: per added hop, bus, best round", best.get(3))
        verdict(f"{placement}: telemetry hop_overhead_ms", tele)
    print(f"\nwire bytes per decode hop (2-node route, f32, {wire.decode_frames} decode frames): "
          f"frame {wire.frame} B = payload {wire.payload} B + header {wire.frame - wire.payload} B; "
          f"HTTP request {wire.request} B; token return to the head {wire.token_return} B per step")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens per generation")
    parser.add_argument("--rounds", type=int, default=5, help="generations per route (interleaved)")
    parser.add_argument("--no-processes", action="store_true", help="skip the node-processes placement")
    args = parser.parse_args(argv)
    asyncio.run(run(args.tokens, args.rounds, not args.no_processes))


if __name__ == "__main__":
    main(sys.argv[1:])
