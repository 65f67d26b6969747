"""What the gateway's test modules share (tests/test_gateway.py, tests/test_gateway_errors.py): the stub model they
serve, an official client, a fresh namespace per swarm, and a prompt's token count as the head counts it."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai

from actors.backends.stub import StubBackend
from bus.server import EmbeddedNats
from schemas.session import Prompt
from schemas.settings import Settings
from tests.support.swarm import Swarm, make_settings, start_swarm, stub

MODEL = "stub-model"
MESSAGES = [{"role": "user", "content": "Tell me about the fox."}]
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}

_namespaces = itertools.count()


def stubs(delay_s: float = 0.0, **kw: Any) -> list[StubBackend]:
    """A two-node split of the stub model (``kw``: other ``StubConfig`` fields)."""
    return [stub(a, b, delay_s=delay_s, **kw) for a, b in ((0, 3), (3, 8))]


def client(swarm: Swarm, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=swarm.base_url, api_key=api_key, max_retries=0)


def fresh_settings(server: EmbeddedNats, tmp: Path, **overrides: Any) -> Settings:
    """Settings in a namespace of their own: swarms sharing one NATS server never see each other."""
    return make_settings(server.url, tmp / "home", namespace=f"gw{next(_namespaces)}", **overrides)


def prompt_tokens(swarm: Swarm, **prompt: Any) -> int:
    return len(swarm.nodes[0].backend.tokenize(Prompt(**prompt)))


@contextlib.asynccontextmanager
async def stub_swarm(server: EmbeddedNats, tmp: Path, **stub_kw: Any) -> AsyncIterator[Swarm]:
    """The two-node stub swarm in a namespace of its own (a module's fixture: one swarm serves its tests)."""
    swarm = await start_swarm(fresh_settings(server, tmp), stubs(**stub_kw), model_id=MODEL)
    try:
        yield swarm
    finally:
        await swarm.stop()
