"""The real-width DeepSeek V4 (issue #25) on this machine: a 2-node route against the whole model in one process.

Run from the repository root: ``python -m tests.bench.bench_deepseek4 [--tokens 8] [--threads 2] [--model PATH]``.
The model is ``artifacts.synthetic.matrix.REAL_V4`` (V4-Flash's widths: hidden 4096, 64 heads x 512, 4
hyper-connection streams, 129,280 tokens; 5 layers, 4 experts; Q8_0), written once (~2.4 GB) to
``--model`` or ``$SWARMROUTE_HOME/bench/real-width-deepseek4-Q8_0.gguf``; the route cuts it after its 3 hash-routed
layers, ``[0, 3)`` + ``[3, 5)``.

Printed: decode tok/s of the whole GGUF in this process (llama.cpp, ``--threads``) and of the route (two ``swarmroute
node`` processes with ``--threads`` each, tracker and gateway, streamed through the official client) and their ratio;
bytes per decode hop (frame body received by the tail, from its Prometheus counter) against hc_mult x n_embd x 4 +
header; each node's resident memory (VmRSS of its process) against the planner's prediction for its range
(``artifacts.layer_split.range_costs``: weights with the head/tail extras plus the KV of its context). The machine
is shared: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import openai

from actors.backend import StepInput
from actors.backends import load_backend
from artifacts.gguf_shape import shape_from_gguf
from artifacts.layer_split import PlanSettings, hop_bytes, range_costs
from artifacts.synthetic.matrix import REAL_V4, synthetic_model
from schemas.frame import WireDType
from schemas.session import Prompt, SamplingParams
from schemas.settings import Settings
from tests.bench.route_procs import MODEL_ID, ProcessRoute, delta, scrape

PROMPT = "The lighthouse keeper returned to the island every spring, and the fishermen came from the north."
CUTS = ((0, 3), (3, REAL_V4.n_layers))
CTX = 512


def model_path(arg: str | None) -> Path:
    path = Path(arg) if arg else Settings().home / "bench" / "real-width-deepseek4-Q8_0.gguf"
    if not path.exists():
        builder, quant = synthetic_model("deepseek4", width="real")
        started = time.perf_counter()
        builder.write(path, quant=quant, seed=16)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - started:.0f} s")
    return path


def in_process(path: Path, threads: int, n: int) -> tuple[float, list[int], int]:
    """(decode tok/s, greedy tokens, prompt tokens) of the whole GGUF in this process."""
    b = load_backend("llamacpp", model_path=path, n_ctx=CTX, max_sessions=1, threads=threads)
    try:
        tokens = b.tokenize(Prompt(text=PROMPT))
        b.open_session("w", prompt_tokens=tokens, sampling=SamplingParams(temperature=0.0))
        out = b.step([StepInput("w", 0, tokens=tokens, sample=True)])
        picks = [out[0].token]
        started = time.perf_counter()
        while len(picks) < n:
            assert picks[-1] is not None
            out = b.step([StepInput("w", len(tokens) + len(picks) - 1, tokens=[picks[-1]], sample=True)])
            picks.append(out[0].token)
        rate = (n - 1) / (time.perf_counter() - started)
        return rate, [int(p) for p in picks if p is not None], len(tokens)
    finally:
        b.close()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def routed(path: Path, threads: int, n: int, home: Path) -> tuple[float, float, list[int]]:
    """(decode tok/s, frame bytes the tail received, RSS of each node) through the route."""
    # Seconds per step at this width on shared cores: the default 10 s hop timeout would call a busy node dead.
    env = {"SWARMROUTE_HOP_TIMEOUT_S": "900", "SWARMROUTE_TOKEN_TIMEOUT_S": "900",
           "SWARMROUTE_FIRST_TOKEN_TIMEOUT_S": "1800", "SWARMROUTE_PREFILL_CHUNK": "512"}
    route = ProcessRoute(path, [threads, threads], home, max_sessions=1, ctx=CTX, layers=CUTS, env=env)
    try:
        client = openai.OpenAI(base_url=route.url, api_key="unused", max_retries=0, timeout=1800)
        before = scrape(route.node_urls[1])
        stamps: list[float] = []
        stream = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=n, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text is not None:
                stamps.append(time.perf_counter())
        after = scrape(route.node_urls[1])
        frames = delta(before, after, "swarmroute_node_frame_bytes_received_total")
        rss = [rss_bytes(p.pid) for p in route.procs[1:1 + len(CUTS)]]
        rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
        return rate, frames, rss
    finally:
        route.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", help="the real-width GGUF (written there if missing)")
    args = p.parse_args(argv)
    path = model_path(args.model)
    load = [os.getloadavg()[0]]
    whole_rate, _, n_prompt = in_process(path, args.threads, args.tokens)
    load.append(os.getloadavg()[0])
    with tempfile.TemporaryDirectory() as home:
        route_rate, frame_bytes, rss = routed(path, args.threads, args.tokens, Path(home))
    load.append(os.getloadavg()[0])
    shape = shape_from_gguf(path)
    settings = PlanSettings(context=CTX)
    cost = range_costs(shape, settings)
    wire = WireDType.F32
    payload = REAL_V4.hc_mult * REAL_V4.n_embd * wire.itemsize
    positions = n_prompt + args.tokens - 1
    print(f"real-width deepseek4 {path.name}: prompt {n_prompt} tokens, {args.tokens} decoded, "
          f"{args.threads} thread(s) per process")
    print(f"{'config':<24} {'decode tok/s':>12} {'x whole':>8}")
    print(f"{'whole, in process':<24} {whole_rate:>12.3f} {1.0:>8.2f}")
    print(f"{'route [0,3)+[3,5)':<24} {route_rate:>12.3f} {route_rate / whole_rate:>8.2f}")
    print(f"hop: {frame_bytes:,.0f} frame bytes received by the tail for {positions} positions in "
          f"{args.tokens} frames; payload per position {payload:,} B (hc_mult {REAL_V4.hc_mult} x n_embd "
          f"{REAL_V4.n_embd} x {wire.itemsize} B); planner's decode hop {hop_bytes(shape.hop_shape, wire, 0):,} B")
    for (a, b), used in zip(CUTS, rss, strict=True):
        predicted = cost(a, b)
        print(f"node [{a}, {b}): resident {used / 2**30:.2f} GiB, planner {predicted / 2**30:.2f} GiB "
              f"(x{used / predicted:.2f})")
    print(f"load average (1 min): {', '.join(f'{x:.1f}' for x in load)} on {os.cpu_count()} cores "
          "(the machine is shared: compare ratios within this run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
