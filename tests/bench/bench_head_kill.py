"""Head loss (issue #31) against what a client retry costs, on the bundled Gemma 3 270M Q4_K_M, in one run.

``python -m tests.bench.bench_head_kill [--rounds 2] [--contexts 2048] [--kill-after 16] [--timeline] [--solo]``
(``--help`` lists every option; the defaults take ~5 minutes on a 2-core machine).

``--solo``: a 1-node route instead (every node serves all 18 layers, so the head is its own tail and its sampler,
stop rules and KV die with it; the replacement imports the chain its twin standby holds, recomputes the rest from
the client's tokens and replays its sampler over them).

Real processes on this machine: a nats-server, an in-process tracker and two in-process gateways, and ``swarmroute
node --backend llamacpp --threads 1 --ctx 4096`` processes: ``tail`` (layers 9:18) and two nodes serving 0:9, one of
which the tracker makes the head while the other stands by (it holds the head's snapshots and can take its layers
over). Prefix reuse is off. The ``repair`` gateway runs the defaults (repair on, snapshots every ``--snapshot-every``
positions); the ``alpha`` gateway has repair off (a client's retry is all there is).

Every round, per context (``--contexts``): a greedy streamed completion through ``repair``, 32 tokens long, whose
prompt is the context minus 32 tokens. Once the client has ``--kill-after`` tokens, the route's head (hop 0 of the
first telemetry snapshot) is SIGKILLed. *Gap* = kill -> the token that ends the stall the client sees; *found* = kill
-> the ``repairing`` telemetry (the gateway found the head gone), *taken over* = kill -> the replacement head's
telemetry saying the repair is done. *Re-prefill* (the reference, a client retry) = through ``alpha``, on the healthy
route left once the tracker dropped the dead node, a fresh request whose prompt is the prompt + the output the client
had at the kill: time to its first token. Ratio = re-prefill / gap. Then a fresh spare 0:9 starts. The text of the
faulted stream is checked against an unfaulted run of the same request (``same text``).

Timings are never asserted. The machine is shared and noisy: the load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

from gateway.app import Gateway
from tests.bench import bench_repair
from tests.bench.bench_repair import HEAD, MODEL, TAIL, Streamed, _model_path

DECODED = 32


@dataclasses.dataclass
class HeadKill:
    context: int
    prompt: int
    gap_ms: float
    found_ms: float
    taken_over_ms: float
    reprefill_ms: float
    retry_prompt: int
    repair: dict[str, Any] | None
    outcome: str
    same_text: bool


class Bench(bench_repair.Bench):
    """bench_repair's swarm with the roles swapped: the tail stays, each round kills the head and a spare of the
    head's layers takes over."""

    KEPT = ("tail", TAIL)
    REPLACED = ("a", HEAD)

    async def stream(self, gateway: Gateway, prompt: list[int], max_tokens: int, *, kill_after: int = 0) -> Streamed:
        client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        run = Streamed(started=time.perf_counter())
        chunks = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "stream_options": {"include_telemetry": True}})
        async for chunk in chunks:
            now = time.perf_counter()
            snap = (chunk.model_extra or {}).get("swarmroute")
            if snap:
                run.snaps.append(snap)
                run.snap_times.append(now)
            if chunk.choices and chunk.choices[0].text:
                run.arrivals.append(now)
                run.pieces.append(chunk.choices[0].text)
            if kill_after and not run.killed and len(run.pieces) >= kill_after:
                run.killed, run.seen_at_kill = run.snaps[0]["route"][0]["node_id"], len(run.pieces)
                run.killed_at = time.perf_counter()
                self.nodes[run.killed].kill()
                self.dead.add(run.killed)
        return run

    async def kill_head(self, context: int) -> HeadKill:
        prompt = self.prompt(context - DECODED)
        expected = await self.stream(self.repair_gw, prompt, DECODED)
        run = await self.stream(self.repair_gw, prompt, DECODED, kill_after=self.args.kill_after)
        last = run.snaps[-1] if run.snaps else {}
        if self.args.timeline:
            k = run.killed_at
            for t, snap in zip(run.snap_times, run.snaps, strict=True):
                if t > k:
                    print(f"  kill +{(t - k) * 1e3:7.1f} ms telemetry {snap['phase']}, "
                          f"{snap['generated_tokens']} tokens, repair {snap.get('repair')}", file=sys.stderr)
            print("  kill + ms, tokens: " + " ".join(f"{(t - k) * 1e3:.0f}" for t in run.arrivals if t > k),
                  file=sys.stderr)
        outcome = str(last.get("phase"))
        if outcome == "failed":
            outcome += f": {last.get('failure')}"
        await self._until(lambda live: run.killed not in live, f"the tracker dropping {run.killed}")
        output = "".join(run.pieces[:run.seen_at_kill])
        retry = prompt + self.vocab.tokenize(output.encode(), add_bos=False, special=False)
        ref = await self.stream(self.alpha_gw, retry, 1)
        return HeadKill(context=context, prompt=len(prompt), gap_ms=run.gap_ms(),
                        found_ms=run.after_kill_ms("repairing"), taken_over_ms=run.after_kill_ms("", done=True),
                        reprefill_ms=ref.ttft_ms, retry_prompt=len(retry), repair=last.get("repair"),
                        outcome=outcome, same_text="".join(run.pieces) == "".join(expected.pieces))


class SoloBench(Bench):
    """A 1-node route (issue #31): every node serves every layer, so the route's one node is head and tail."""

    KEPT = ("k", "0:18")
    REPLACED = ("a", "0:18")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--contexts", default="2048", help="context lengths of the head-kill completions")
    parser.add_argument("--kill-after", type=int, default=16, help="tokens the client has when the head dies")
    parser.add_argument("--snapshot-every", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=4096, help="context per session of every node")
    parser.add_argument("--timeline", action="store_true",
                        help="print (stderr) every telemetry snapshot and token after each kill")
    parser.add_argument("--solo", action="store_true", help="a 1-node route (nodes serving all layers)")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-head-kill-", dir=os.environ.get("TMPDIR"),
                                     ignore_cleanup_errors=True) as tmp:
        kills = asyncio.run(_run(args, contexts, Path(tmp)))
    _report(args, contexts, kills, load_start)
    return 0


async def _run(args: argparse.Namespace, contexts: list[int], work: Path) -> list[HeadKill]:
    bench = (SoloBench if args.solo else Bench)(args, _model_path(), work)
    kills: list[HeadKill] = []
    async with bench.swarms:
        await bench.start()
        await bench.stream(bench.repair_gw, bench.prompt(64), 8)  # warm up: every node's first steps are slow
        await bench.stream(bench.alpha_gw, bench.prompt(64), 8)
        for r in range(args.rounds):
            for context in contexts if r % 2 == 0 else contexts[::-1]:
                kills.append(await bench.kill_head(context))
                await bench.spare()
                k = kills[-1]
                print(f"round {r + 1}: context {context}: {k.outcome}, gap {k.gap_ms:.0f} ms, re-prefill "
                      f"{k.reprefill_ms:.0f} ms, same text {k.same_text}", file=sys.stderr, flush=True)
    return kills


def _report(args: argparse.Namespace, contexts: list[int], kills: list[HeadKill],
            load_start: tuple[float, float, float]) -> None:
    load_end = os.getloadavg()
    layout = "1-node route 0:18 (+ two more nodes 0:18)" if args.solo else \
        f"2-node route {HEAD} + {TAIL} (+ a spare {HEAD})"
    print(f"\nHead loss, Gemma 3 270M Q4_K_M, {layout}, --threads 1 per node, "
          f"{args.rounds} round(s), snapshot every {args.snapshot_every}; load average {load_start[0]:.1f} at the "
          f"start, {load_end[0]:.1f} at the end (1 min; 2 cores)")
    print(f"kill the head after {args.kill_after} of {DECODED} tokens; medians over rounds")
    print(f"{'context':>7} {'prompt':>6} {'retry':>5} {'found ms':>8} {'taken over':>10} {'gap ms':>7} "
          f"{'repair ms':>9} {'re-prefill ms':>13} {'ratio':>6}  same text; KV source (last round); ratio per round")
    for c in contexts:
        runs = [k for k in kills if k.context == c]
        ok = [k for k in runs if k.outcome == "complete"]
        if not ok:
            print(f"{c:>7} {runs[0].prompt:>6}   takeover failed every round: {runs[-1].outcome}")
            continue
        gap = statistics.median(k.gap_ms for k in ok)
        dur = statistics.median(float(k.repair["duration_ms"]) for k in ok if k.repair)
        ref = statistics.median(k.reprefill_ms for k in runs)
        last = ok[-1].repair or {}
        failed = f"; {len(runs) - len(ok)} of {len(runs)} FAILED: {runs[-1].outcome}" if len(ok) < len(runs) else ""
        print(f"{c:>7} {ok[0].prompt:>6} {ok[0].retry_prompt:>5} {statistics.median(k.found_ms for k in ok):>8.0f} "
              f"{statistics.median(k.taken_over_ms for k in ok):>10.0f} {gap:>7.0f} {dur:>9.0f} {ref:>13.0f} "
              f"{ref / gap:>5.1f}x  {sum(k.same_text for k in ok)}/{len(ok)}; {last.get('source')}: "
              f"{last.get('snapshot_positions')} imported, {last.get('replayed_positions')} recomputed; "
              f"{', '.join(f'{k.reprefill_ms / k.gap_ms:.1f}x' for k in ok)}{failed}")
    print("note: every node shares this machine's 2 cores with the client, gateways and tracker, and other users.")
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
