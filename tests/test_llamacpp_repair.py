"""Issue #18 on the performance path: real llama.cpp node processes serving shards of the bundled Gemma 3 270M, a
real tracker, gateway and nats-server, the official client. A SIGKILLed hop (a spare serving the same layers is
running) is replaced mid-stream and the greedy text is identical, token for token, to a run without the fault;
telemetry shows ``repairing``; every node frees the session at the end. The replacement imports the lost hop's
snapshot chain, the hop before it replays its journal, and llama.cpp recomputes exactly what it computed before
(docs/reliability.md says why the bytes come out the same)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from actors.tracker import Tracker
from gateway.app import Gateway
from schemas.settings import Settings
from tests.support.swarm import NodeProcess, Swarms, make_settings, wait_model
from tests.support.waiting import eventually

pytest.importorskip("llama_cpp")

pytestmark = pytest.mark.slow
MODEL = "gemma"
PROMPT = ("Here is a short story about a lighthouse keeper who finds a message in a bottle. " * 3).strip()


@pytest.fixture
def settings(nats_server: Any, tmp_path: Path) -> Settings:
    # Reuse off: the fault-free run and the run with the fault both start cold.
    return make_settings(nats_server.url, tmp_path / "home", token_timeout_s=10.0, first_token_timeout_s=30.0,
                         hop_timeout_s=10.0, snapshot_every=16, repair_timeout_s=30.0, prefix_cache_mb=0)


def node_args(gemma_path: Path, layers: str) -> list[str]:
    return ["--backend", "llamacpp", "--model", str(gemma_path), "--model-id", MODEL, "--layers", layers,
            "--threads", "1", "--ctx", "1024", "--max-sessions", "2"]


async def start(settings: Settings, swarms: Swarms, gemma_path: Path,
                layout: list[tuple[str, str]]) -> tuple[dict[str, NodeProcess], Gateway]:
    nodes = {name: await swarms.node_process(settings, name, node_args(gemma_path, layers))
             for name, layers in layout}
    tracker = await swarms.actor(Tracker(settings))
    gateway = await swarms.actor(Gateway(settings, port=0))
    await wait_model(tracker, MODEL, timeout=120, n_nodes=len(layout))
    return nodes, gateway


async def stream(gateway: Gateway, *, max_tokens: int, kill: dict[str, NodeProcess] | None = None, hop: int = 0,
                 after_tokens: int = 0, in_prefill: int = 0,
                 frequency_penalty: float = 0.0) -> tuple[str, list[dict[str, Any]], str]:
    """The greedy text, every telemetry snapshot, and the node killed (SIGKILL) at hop ``hop`` of the route."""
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    chunks = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0, stream=True,
        frequency_penalty=frequency_penalty,
        extra_body={"ignore_eos": True, "stream_options": {"include_telemetry": True}})
    text, snaps, seen, killed = "", [], 0, ""
    async for chunk in chunks:
        snap = (chunk.model_extra or {}).get("swarmroute")
        if snap:
            snaps.append(snap)
        if chunk.choices and chunk.choices[0].text:
            text += chunk.choices[0].text
            seen += 1
        due = (snap is not None and snap.get("phase") == "prefill" and snap["prefill"]["done"] >= in_prefill) \
            if in_prefill else seen >= after_tokens > 0
        if kill and not killed and due:
            killed = snaps[0]["route"][hop]["node_id"]
            kill[killed].kill()
    return text, snaps, killed


async def freed(nodes: dict[str, NodeProcess], dead: str) -> None:
    async def none_held() -> bool:
        async with httpx.AsyncClient(timeout=2) as http:
            held = [int((await http.get(f"{n.endpoint}/health")).json()["sessions"])
                    for name, n in nodes.items() if name != dead]
        return not any(held)

    await eventually(none_held, timeout=20, what="every surviving node freeing the session")


def assert_repaired(snaps: list[dict[str, Any]], dead: str, hop: int, source: str) -> None:
    phases = [s["phase"] for s in snaps]
    assert "repairing" in phases and phases[-1] == "complete", phases
    repair = snaps[-1]["repair"]
    assert repair["lost_node"] == dead and repair["source"] == source, repair
    assert snaps[-1]["route"][hop]["node_id"] == repair["replacement"][0] != dead


@pytest.mark.parametrize(("layout", "hop"), [
    ([("head", "0:6"), ("middle", "6:12"), ("tail", "12:18"), ("spare", "6:12")], 1),
    ([("head", "0:9"), ("tail", "9:18"), ("spare", "9:18")], 1),
], ids=["3-node-middle", "2-node-tail"])
async def test_a_killed_hop_mid_decode_is_replaced_and_the_text_is_unchanged(
        settings: Settings, swarms: Swarms, gemma_path: Path, layout: list[tuple[str, str]], hop: int) -> None:
    nodes, gateway = await start(settings, swarms, gemma_path, layout)
    expected, _, _ = await stream(gateway, max_tokens=48)
    text, snaps, dead = await stream(gateway, max_tokens=48, kill=nodes, hop=hop, after_tokens=24)
    assert dead and text == expected
    assert_repaired(snaps, dead, hop, "snapshot")
    assert snaps[-1]["repair"]["snapshot_positions"] > 0
    await freed(nodes, dead)


async def test_a_hop_killed_in_prefill_is_rebuilt_from_the_journal(settings: Settings, swarms: Swarms,
                                                                 gemma_path: Path) -> None:
    settings = settings.model_copy(update={"prefill_chunk": 16})  # many chunks: the kill lands inside prefill
    nodes, gateway = await start(settings, swarms, gemma_path,
                                 [("head", "0:6"), ("middle", "6:12"), ("tail", "12:18"), ("spare", "6:12")])
    expected, _, _ = await stream(gateway, max_tokens=16)
    text, snaps, dead = await stream(gateway, max_tokens=16, kill=nodes, hop=1, in_prefill=32)
    assert dead and text == expected
    assert_repaired(snaps, dead, 1, "journal")
    await freed(nodes, dead)


async def test_a_replaced_tail_samples_only_the_missing_token_so_penalties_go_on_unchanged(
        settings: Settings, swarms: Swarms, gemma_path: Path) -> None:
    # The journal replays the positions the client has tokens for already: the replacement tail computes them
    # without sampling, or its penalty window would count those tokens twice and the text after the repair change.
    nodes, gateway = await start(settings, swarms, gemma_path, [("head", "0:9"), ("tail", "9:18"), ("spare", "9:18")])
    expected, _, _ = await stream(gateway, max_tokens=48, frequency_penalty=1.5)
    text, snaps, dead = await stream(gateway, max_tokens=48, kill=nodes, hop=1, after_tokens=24,
                                     frequency_penalty=1.5)
    assert dead and text == expected
    assert_repaired(snaps, dead, 1, "snapshot")
    assert snaps[-1]["repair"]["replayed_positions"] > 1
    await freed(nodes, dead)
