"""A real llama.cpp route over mutually authenticated TLS (issue #29): the bundled Gemma 3 270M on two nodes
([0, 12) + [12, 18)), every data-plane connection (gateway -> head, head -> tail, tail -> head) through a relay that
records every byte. The route gives llama-cpp-python's exact greedy text, and the capture holds neither the prompt's
text, nor its token ids as a frame encodes them (``<I`` each, in a row), nor the generated text or its token ids,
nor the session token."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from bus.identity import load_or_create  # noqa: E402
from bus.server import EmbeddedNats  # noqa: E402
from tests.support.llama_reference import greedy_completion, id_triples  # noqa: E402
from tests.support.relay import RecordingRelay  # noqa: E402
from tests.support.swarm import gemma_route  # noqa: E402
from tests.test_tls import SECRET  # noqa: E402

pytestmark = [pytest.mark.slow]

PROMPT = "The capital of France is"
N = 16


def _reference(gemma_path: Path) -> tuple[str, list[int], list[int]]:
    return greedy_completion(gemma_path, PROMPT, N, threads=2, n_ctx=1024)


async def test_a_two_node_llama_route_over_tls_is_exact_and_opaque_on_the_wire(nats_server: EmbeddedNats,
                                                                               gemma_path: Path,
                                                                               tmp_path: Path) -> None:
    expected, prompt_ids, text_ids = await asyncio.to_thread(_reference, gemma_path)
    gateway = load_or_create(tmp_path / "home" / "identity", "gateway")
    async with gemma_route(nats_server.url, gemma_path, tmp_path, namespace="tls-gemma", max_sessions=2,
                           tls="on", swarm_secret=SECRET, tls_trusted_certs=gateway.cert_file) as swarm:
        relays = []
        for node in swarm.nodes:
            relay = await RecordingRelay.start(("127.0.0.1", node.server.port))
            relays.append(relay)
            await swarm.route_through(node, f"https://{node.keys.fingerprint}@127.0.0.1:{relay.port}")
        try:
            client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0, timeout=300)
            stream = await client.completions.create(model="gemma", prompt=PROMPT, max_tokens=N, temperature=0,
                                                     stream=True)
            text, token = "", ""
            async for chunk in stream:
                text += chunk.choices[0].text if chunk.choices else ""
                for session in swarm.nodes[1].sessions.values():
                    token = token or session.session_token or ""
        finally:
            for relay in relays:
                await relay.stop()
    assert text == expected
    assert token, "the tail never held the session while it streamed"
    head, tail = (bytes(r.captured) for r in relays)
    assert all(r.connections > 0 for r in relays)
    assert len(tail) > N * 640 * 4  # every decode step's activations crossed head -> tail
    for seen in (head, tail):
        assert PROMPT.encode() not in seen and b"capital" not in seen
        assert expected.strip().encode()[:12] not in seen
        assert token.encode() not in seen
        assert not [p for p in id_triples(prompt_ids) + id_triples(text_ids) if p in seen]
