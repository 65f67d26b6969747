"""Prefixes across routes (issue #26): a ~2,048-token prompt that another route prefilled, pulled from that route's
nodes hop by hop, against computing it, TTFT in one run.

Run all benchmarks with ``bash tests/bench/run``; this one alone from the repository root:
``python -m tests.bench.bench_prefix_pull [--rounds 3] [--tokens 2048]``.

Everything is the bundled Gemma 3 270M Q4_K_M on this machine, through the OpenAI chat endpoint (the official
``openai`` client, streaming; the clock stops at the first chunk with content). Three 2-node llama.cpp routes of
real ``swarmroute node`` processes (layers 0:9 and 9:18, ``--threads 1`` each, token-exact prefix reuse), one
in-process tracker and gateway:

* ``A``        prefills the round's prompt first (a cold run: its TTFT is printed too) and keeps its KV;
* ``pull``     route B (``prefix_pull = auto``): the same prompt, sent while A counts as full, lands here; the
               tracker names A's nodes as each hop's prefix source and every hop pulls its layers' KV from A's node
               (its policy decides; telemetry says how many positions were reused, i.e. pulled);
* ``compute``  route C (``prefix_pull = never``): the same prompt, routed the same way (sources named), computed.

Which route a request lands on is chosen by showing the tracker the other routes' nodes as full (their
advertisements' session counts at their maximum): that is what a busy route looks like to it, without another
request's compute in the timings. Each round uses a prompt of its own (different from its first sentence), so no
round reuses another's; the order of ``pull`` and ``compute`` alternates. Printed: median TTFTs, the pull/compute
ratio, positions reused, whether the texts equal A's cold run, and the load average: the machine is shared, so
compare only the ratios of one run. Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import openai

from actors.tracker import Tracker
from bus.server import EmbeddedNats, NatsServerConfig
from gateway.app import Gateway
from schemas.node import NodeAdvertisement
from tests.bench.bench_reuse import Counter, Reply, _model_path, chat, conversation
from tests.support.swarm import Swarms, make_settings, wait_model

MODEL = "gemma"
ROUTES = {"A": "auto", "pull": "auto", "compute": "never"}
LAYERS = ("0:9", "9:18")


def _only(tracker: Tracker, allowed: Callable[[], str]) -> None:
    """Have the tracker see every node but those of route ``allowed()`` as full."""
    registry = tracker.registry
    assert registry is not None
    live = registry.live

    def shown() -> list[NodeAdvertisement]:
        out = []
        for advert in live():
            if not advert.node_id.startswith(allowed() + "-"):
                full = advert.capacity.model_copy(update={"active_sessions": advert.capacity.max_sessions})
                advert = advert.model_copy(update={"capacity": full})
            out.append(advert)
        return out

    registry.live = shown  # type: ignore[method-assign]


async def run(args: argparse.Namespace) -> int:
    model = _model_path()
    count = Counter(model)
    ctx = max(4096, (args.tokens + 512 + 255) // 256 * 256)
    load = [os.getloadavg()[0]]
    results: dict[str, list[Reply]] = {k: [] for k in ROUTES}
    equal = {"pull": 0, "compute": 0}
    with tempfile.TemporaryDirectory(prefix="bench-pull-") as tmp:
        work = Path(tmp)
        with EmbeddedNats(NatsServerConfig(store_dir=work / "nats")) as nats:
            async with Swarms() as swarms:
                base = dict(namespace="pull", token_timeout_s=120.0, first_token_timeout_s=240.0, hop_timeout_s=120.0,
                            prefix_reuse="token")
                for name, mode in ROUTES.items():
                    settings = make_settings(nats.url, work / name, prefix_pull=mode, **base)
                    for i, hop in enumerate(LAYERS):
                        await swarms.node_process(settings, f"{name}-{i}", [
                            "--backend", "llamacpp", "--model", str(model), "--model-id", MODEL, "--layers", hop,
                            "--threads", "1", "--ctx", str(ctx), "--max-sessions", "2"])
                settings = make_settings(nats.url, work / "gateway", **base)
                tracker = await swarms.actor(Tracker(settings))
                gateway = await swarms.actor(Gateway(settings, port=0))
                await wait_model(tracker, MODEL, timeout=300, n_nodes=2 * len(ROUTES))
                phase = ["A"]
                _only(tracker, lambda: phase[0])
                client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0,
                                            timeout=900)
                swarms.on_teardown(client.close)
                for name in ROUTES:  # warm-up: first requests pay one-off costs
                    phase[0] = name
                    await chat(client, [{"role": "user", "content": f"Say hello to {name}."}], 4)
                for r in range(args.rounds):
                    messages = conversation(2000 + r, args.tokens, count)
                    phase[0] = "A"
                    cold = await chat(client, messages, args.reply)
                    results["A"].append(cold)
                    await asyncio.sleep(2 * settings.heartbeat_s)  # A's heartbeat names what it kept
                    for name in (("pull", "compute") if r % 2 == 0 else ("compute", "pull")):
                        phase[0] = name
                        reply = await chat(client, messages, args.reply)
                        results[name].append(reply)
                        equal[name] += reply.text == cold.text
                    load.append(os.getloadavg()[0])
                    print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                        f"{k} {v[-1].ttft * 1e3:.0f} ms ({v[-1].reused} reused)" for k, v in results.items()),
                        file=sys.stderr, flush=True)
    report(results, equal, args, load)
    return 0


def report(results: dict[str, list[Reply]], equal: dict[str, int], args: argparse.Namespace,
           load: list[float]) -> None:
    ttft = {k: statistics.median(r.ttft for r in v) * 1e3 for k, v in results.items()}
    print(f"\nTTFT of a ~{args.tokens}-token prompt another route prefilled, Gemma 3 270M Q4_K_M, 2-node llama.cpp "
          f"routes (--threads 1 per node), medians of {args.rounds} rounds")
    print(f"{'configuration':<34} {'TTFT ms':>8} {'prompt':>7} {'reused':>7}  text = A's cold run")
    labels = {"A": "route A, cold (prefills it first)", "pull": "route B, pulls from A",
              "compute": "route C, computes (prefix_pull never)"}
    for key, label in labels.items():
        prompt = statistics.median(r.prompt for r in results[key])
        reused = statistics.median(r.reused for r in results[key])
        same = "" if key == "A" else f"{equal[key]}/{args.rounds}"
        print(f"{label:<34} {ttft[key]:>8.0f} {prompt:>7.0f} {reused:>7.0f}  {same}")
    print(f"\npull / compute TTFT: {ttft['pull'] / ttft['compute']:.2f}x ({ttft['compute'] / ttft['pull']:.1f}x "
          f"faster to pull); per round: " + ", ".join(
              f"{p.ttft / c.ttft:.2f}x" for p, c in zip(results["pull"], results["compute"], strict=True)))
    print(f"load average (1 min) at the start, after each round: {', '.join(f'{x:.2f}' for x in load)} on "
          f"{os.cpu_count()} cores (the machine is shared: compare ratios within this run)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens (system prompt and user message)")
    parser.add_argument("--reply", type=int, default=4, help="tokens generated per request")
    return asyncio.run(run(args=parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
