"""What ``swarmroute up``'s session count costs (issue #30): start-up time, the node's memory and one stream's decode
speed with ``--max-sessions`` 4, 32, 64 and 253 (llama.cpp's cap, what memory alone would give the bundled model).

``python -m tests.bench.bench_up_sessions [--counts 4,32,64,253] [--tokens 128] [--nodes 1] [--threads 1]``. Each
count starts its own ``up`` (one after the other, the same home, so only the first pays the model's assembly: a
warm-up ``up`` runs first), waits for its banner, reads the node's resident memory (``VmRSS``) and decodes one
greedy stream of ``--tokens`` tokens through the official client (tok/s from its first to its last token, after a
short warm-up stream), then stops it. The machine is shared: its load average is printed; nothing asserts a timing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import openai

from tests.support.up import Up, free_port


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _decode_tps(url: str, tokens: int) -> float:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    client.completions.create(model="gemma-3-270m", prompt="Hello", max_tokens=8, temperature=0)
    stream = client.completions.create(model="gemma-3-270m", prompt="Once upon a time", max_tokens=tokens,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    stamps = [time.perf_counter() for chunk in stream if chunk.choices and chunk.choices[0].text]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def measure(home: Path, count: int, args: argparse.Namespace) -> tuple[float, list[float], float]:
    up = Up("--nodes", str(args.nodes), "--threads", str(args.threads), "--max-sessions", str(count),
            env={"SWARMROUTE_HOME": str(home), "SWARMROUTE_GATEWAY_PORT": str(free_port())})
    began = time.perf_counter()
    try:
        if not up.banner.wait(900) or up.proc.poll() is not None:
            raise RuntimeError(f"up --max-sessions {count} did not start:\n{up.output[-2000:]}")
        started = time.perf_counter() - began
        rss = [_rss_mib(up.child("node", f"node-{i + 1}")) for i in range(args.nodes)]
        return started, rss, _decode_tps(up.gateway_url(), args.tokens)
    finally:
        up.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="4,32,64,253")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="bench-up-sessions-") as tmp:
        home = Path(tmp) / "home"
        measure(home, 4, args)  # warm-up: the home's one-off work (model, shards, native callback)
        rows = []
        for count in (int(c) for c in args.counts.split(",")):
            started, rss, tps = measure(home, count, args)
            rows.append((count, started, rss, tps))
            print(f"--max-sessions {count}: up in {started:.1f} s, node RSS {', '.join(f'{r:.0f}' for r in rss)} "
                  f"MiB, one stream {tps:.1f} tok/s", file=sys.stderr, flush=True)
        load.append(os.getloadavg()[0])
    print(f"up --nodes {args.nodes} --threads {args.threads}, one greedy stream of {args.tokens} tokens; load average "
          f"{load[0]:.1f} at the start, {load[-1]:.1f} at the end")
    print(f"{'sessions':>8} {'start-up':>9} {'node RSS (MiB)':>15} {'decode tok/s':>13}")
    for count, started, rss, tps in rows:
        print(f"{count:>8} {started:>8.1f}s {'/'.join(f'{r:.0f}' for r in rss):>15} {tps:>13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
