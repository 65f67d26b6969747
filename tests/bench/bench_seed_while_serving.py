"""Does a node that serves a model slow down while a joining peer downloads the model from it? (issue #27 item 1)

Run all benchmarks with ``bash tests/bench/run``; this one alone from the repository root:
``python -m tests.bench.bench_seed_while_serving [--tokens 128] [--rounds 6] [--upload-limit BYTES/S]``.

A real ``swarmroute up --nodes 1 --threads 1`` serves the bundled Gemma 3 270M Q4_K_M from the local file; its node
seeds the file (``actors/provisioning/holder.py``: libtorrent at niceness 10, uploads within
``SWARMROUTE_SEED_UPLOAD_LIMIT``). Each round measures the node's decode rate twice, in alternating order: idle, and
while ``tests/support/leecher.py`` downloads the whole model from it over and over (loopback; a fresh download each
time, so the node uploads for the whole measurement). The leecher runs at niceness 19: on a fleet it is another
machine; on this one it may only take the CPU nothing else wants, so what is measured is what seeding costs the
node, not what the download costs the machine. Decode rate = (chunks - 1) / (last chunk - first chunk) of a streamed
greedy completion (official ``openai`` client, ``ignore_eos``); the upload rate is the leecher's bytes over the
same window. Figures are medians over rounds; the ratio is the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.bench.bench_gguf_route import stream
from tests.support.leecher import Leecher
from tests.support.up import Up, free_port

MODEL = "gemma-3-270m"


_loop = asyncio.new_event_loop()
"""One loop for every request (the client's connections are closed on the loop that opened them)."""


def measure(url: str, prompt: str, tokens: int) -> float:
    _, rate, _, _ = _loop.run_until_complete(stream(url, MODEL, prompt, tokens))
    return rate


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--upload-limit", type=int, default=None,
                   help="bytes/s the node seeds at most (default: the setting's default)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-seed-") as tmp:
        home = Path(tmp) / "home"
        env = {"SWARMROUTE_HOME": str(home), "SWARMROUTE_GATEWAY_PORT": str(free_port())}
        if args.upload_limit is not None:
            env["SWARMROUTE_SEED_UPLOAD_LIMIT"] = str(args.upload_limit)
        up = Up("--nodes", "1", "--threads", "1", "--log-level", "info", env=env)
        try:
            return run(args, up, home, Path(tmp))
        finally:
            with contextlib.suppress(Exception):
                up.close()


def run(args: argparse.Namespace, up: Up, home: Path, tmp: Path) -> int:
    if not up.banner.wait(900) or up.proc.poll() is not None:
        print(up.output, file=sys.stderr)
        return 1
    deadline = time.monotonic() + 120
    while not (seeds := re.search(r"seeds model (\w+) from (\S+) \(upload limit ([^)]*)\)", up.output)) or \
            "seeds every piece" not in up.output:
        if time.monotonic() > deadline:
            print(f"the node did not start seeding:\n{up.output}", file=sys.stderr)
            return 1
        time.sleep(0.5)
    model_prefix, peer, limit = seeds.group(1), seeds.group(2), seeds.group(3)
    manifest = next((home / "store").glob(f"{model_prefix}*/manifest.json"))
    url = up.gateway_url() + "/v1"
    measure(url, "Warm up.", 8)
    idle: list[float] = []
    seeding: list[float] = []
    upload: list[float] = []
    for i in range(args.rounds):
        order = ("idle", "seeding") if i % 2 == 0 else ("seeding", "idle")
        for what in order:
            prompt = f"Round {i} {what}. The capital of France is"
            if what == "idle":
                idle.append(measure(url, prompt, args.tokens))
                continue
            leecher = Leecher(manifest, peer, tmp / "leecher")
            try:
                leecher.wait_downloading()
                before, started = leecher.received, time.monotonic()
                seeding.append(measure(url, prompt, args.tokens))
                time.sleep(1.1)  # its next progress line covers the end of the window
                upload.append((leecher.received - before) / (time.monotonic() - started) / 1e6)
            finally:
                leecher.stop()
        print(f"round {i + 1}: idle {idle[-1]:.1f} tok/s, seeding {seeding[-1]:.1f} tok/s "
              f"({seeding[-1] / idle[-1]:.3f}), upload {upload[-1]:.1f} MB/s", file=sys.stderr, flush=True)
    ratios = [s / i for s, i in zip(seeding, idle, strict=True)]
    print(f"\nseeding while serving: one node, 1 thread, {args.tokens} tokens, {args.rounds} rounds, "
          f"upload limit {limit}, {os.cpu_count()} cores")
    print(f"| node | decode tok/s (median) | upload MB/s (median) |\n|---|---|---|\n"
          f"| idle | {statistics.median(idle):.1f} | 0 |\n"
          f"| seeding | {statistics.median(seeding):.1f} | {statistics.median(upload):.1f} |")
    print(f"seeding / idle: {statistics.median(ratios):.3f} (median of per-round ratios; min {min(ratios):.3f}, "
          f"max {max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
