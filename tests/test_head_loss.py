"""Issue #31: a session survives the loss of its head. Real llama.cpp node processes serving shards of the bundled
Gemma 3 270M, a real tracker, gateway and nats-server, the official client. The head is SIGKILLed (a spare serving
its layers is running): the gateway finds it gone, a tracker names the spare, the gateway opens the session there
with what only the head held (the request, the tokens the client has, the telemetry seq) and the head's snapshot
chain; the spare re-binds the tail, which still holds its KV and its sampler, and the client's stream goes on with no
token duplicated or missing. Greedy and seeded sampled streams equal the unfaulted run's text; a head killed in
prefill is rebuilt from the tokens; every node frees the session at the end."""

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
LAYOUT = [("head", "0:9"), ("tail", "9:18"), ("spare", "0:9")]
HEADS = {"head", "spare"}
"""Either may be routed to as the head: the other is its replacement."""
SOLO = [("one", "0:18"), ("other", "0:18")]
"""Two nodes serving every layer: a route of one node (head and tail), the other its replacement."""
THREE = [("head", "0:6"), ("middle", "6:12"), ("tail", "12:18"), ("spare", "0:6")]


@pytest.fixture
def settings(nats_server: Any, tmp_path: Path) -> Settings:
    # Reuse off: the fault-free run and the run with the fault both start cold.
    return make_settings(nats_server.url, tmp_path / "home", token_timeout_s=10.0, first_token_timeout_s=30.0,
                         hop_timeout_s=10.0, snapshot_every=16, repair_timeout_s=30.0, prefix_cache_mb=0)


def node_args(gemma_path: Path, layers: str) -> list[str]:
    return ["--backend", "llamacpp", "--model", str(gemma_path), "--model-id", MODEL, "--layers", layers,
            "--threads", "1", "--ctx", "1024", "--max-sessions", "2"]


async def start(settings: Settings, swarms: Swarms, gemma_path: Path,
                layout: list[tuple[str, str]] = LAYOUT) -> tuple[dict[str, NodeProcess], Gateway]:
    nodes = {name: await swarms.node_process(settings, name, node_args(gemma_path, layers))
             for name, layers in layout}
    tracker = await swarms.actor(Tracker(settings))
    gateway = await swarms.actor(Gateway(settings, port=0))
    await wait_model(tracker, MODEL, timeout=120, n_nodes=len(layout))
    return nodes, gateway


async def stream(gateway: Gateway, *, max_tokens: int, kill: dict[str, NodeProcess] | None = None, hop: int = 0,
                 after_tokens: int = 0, in_prefill: int = 0,
                 sampling: dict[str, Any] | None = None) -> tuple[str, list[dict[str, Any]], str, list[int]]:
    """The text, every telemetry snapshot, the node killed (SIGKILL: hop ``hop`` of the route, the head by default)
    and how many chunks carried text."""
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    chunks = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=max_tokens, stream=True, **(sampling or {"temperature": 0}),
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
    return text, snaps, killed, [seen]


async def freed(nodes: dict[str, NodeProcess], dead: str) -> None:
    async def none_held() -> bool:
        async with httpx.AsyncClient(timeout=2) as http:
            held = [int((await http.get(f"{n.endpoint}/health")).json()["sessions"])
                    for name, n in nodes.items() if name != dead]
        return not any(held)

    await eventually(none_held, timeout=20, what="every surviving node freeing the session")


def assert_taken_over(snaps: list[dict[str, Any]], dead: str, source: str, heads: set[str] = HEADS) -> None:
    phases = [s["phase"] for s in snaps]
    assert "repairing" in phases and phases[-1] == "complete", phases
    repair = snaps[-1]["repair"]
    assert repair["lost_node"] == dead and repair["source"] == source, repair
    assert snaps[-1]["route"][0]["node_id"] == repair["replacement"][0] in heads - {dead}
    seqs = [s["seq"] for s in snaps]
    assert seqs == sorted(seqs), seqs  # the replacement's telemetry goes on after the lost head's


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7, "top_p": 0.95}],
                         ids=["greedy", "seeded"])
async def test_a_head_killed_mid_decode_is_replaced_and_the_stream_is_unchanged(
        settings: Settings, swarms: Swarms, gemma_path: Path, sampling: dict[str, Any]) -> None:
    nodes, gateway = await start(settings, swarms, gemma_path)
    expected, _, _, counts = await stream(gateway, max_tokens=48, sampling=sampling)
    text, snaps, dead, after = await stream(gateway, max_tokens=48, kill=nodes, after_tokens=24, sampling=sampling)
    assert dead in HEADS and after == counts == [48]
    assert text == expected
    assert_taken_over(snaps, dead, "snapshot")
    assert snaps[-1]["repair"]["snapshot_positions"] > 0
    await freed(nodes, dead)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.5, "seed": 7}], ids=["greedy", "seeded"])
async def test_the_one_node_of_a_route_killed_mid_decode_is_replaced_and_the_stream_is_unchanged(
        settings: Settings, swarms: Swarms, gemma_path: Path, sampling: dict[str, Any]) -> None:
    """Head and tail on one node: its KV, sampler and stop rules die with it. The replacement recomputes the
    prompt and the client's tokens in the lost node's shapes, replays its sampler's draws over them and samples
    the next token itself."""
    nodes, gateway = await start(settings, swarms, gemma_path, SOLO)
    expected, unfaulted, _, counts = await stream(gateway, max_tokens=48, sampling=sampling)
    assert len(unfaulted[0]["route"]) == 1, unfaulted[0]["route"]
    text, snaps, dead, after = await stream(gateway, max_tokens=48, kill=nodes, after_tokens=24, sampling=sampling)
    assert after == counts == [48]
    assert text == expected
    assert_taken_over(snaps, dead, "snapshot", heads=set(nodes))
    assert snaps[-1]["repair"]["snapshot_positions"] > 0
    await freed(nodes, dead)


async def test_the_one_node_of_a_route_killed_in_prefill_is_rebuilt_from_the_tokens(
        settings: Settings, swarms: Swarms, gemma_path: Path) -> None:
    """No token yet: the replacement prefills the prompt and samples the first token itself."""
    settings = settings.model_copy(update={"prefill_chunk": 16})
    nodes, gateway = await start(settings, swarms, gemma_path, SOLO)
    expected, _, _, _ = await stream(gateway, max_tokens=16)
    text, snaps, dead, _ = await stream(gateway, max_tokens=16, kill=nodes, in_prefill=32)
    assert text == expected
    assert_taken_over(snaps, dead, "journal", heads=set(nodes))
    await freed(nodes, dead)


async def test_the_head_of_a_three_node_route_killed_mid_decode_is_replaced_and_the_stream_is_unchanged(
        settings: Settings, swarms: Swarms, gemma_path: Path) -> None:
    """The middle hop and the tail are re-bound to the replacement, each cut back to where the least of them
    ends; the seeded stream goes on as the unfaulted one."""
    sampling = {"temperature": 1.0, "seed": 3}
    nodes, gateway = await start(settings, swarms, gemma_path, THREE)
    expected, unfaulted, _, _ = await stream(gateway, max_tokens=40, sampling=sampling)
    assert len(unfaulted[0]["route"]) == 3, unfaulted[0]["route"]
    text, snaps, dead, after = await stream(gateway, max_tokens=40, kill=nodes, after_tokens=20, sampling=sampling)
    assert dead in HEADS and after == [40] and text == expected
    assert_taken_over(snaps, dead, "snapshot")
    assert [h["node_id"] for h in snaps[-1]["route"][1:]] == ["middle", "tail"]
    await freed(nodes, dead)


async def test_a_head_killed_in_prefill_is_rebuilt_from_the_tokens(settings: Settings, swarms: Swarms,
                                                                   gemma_path: Path) -> None:
    settings = settings.model_copy(update={"prefill_chunk": 16})  # many chunks: the kill lands inside prefill
    nodes, gateway = await start(settings, swarms, gemma_path)
    expected, _, _, _ = await stream(gateway, max_tokens=16)
    text, snaps, dead, _ = await stream(gateway, max_tokens=16, kill=nodes, in_prefill=32)
    assert dead in HEADS and text == expected
    assert_taken_over(snaps, dead, "journal")
    await freed(nodes, dead)


async def test_a_replaced_tail_of_a_seeded_session_goes_on_with_the_unfaulted_draws(
        settings: Settings, swarms: Swarms, gemma_path: Path) -> None:
    """Every repair, not only a head's: a replacement tail rebuilds its sampler from the seed and the tokens the
    head has, and its random state with it, so a sampled stream goes on as the unfaulted one (it used to start
    over from the seed and draw another stream)."""
    sampling = {"temperature": 1.0, "seed": 11}
    nodes, gateway = await start(settings, swarms, gemma_path,
                                 [("head", "0:9"), ("tail", "9:18"), ("spare", "9:18")])
    expected, _, _, _ = await stream(gateway, max_tokens=48, sampling=sampling)
    text, snaps, dead, _ = await stream(gateway, max_tokens=48, kill=nodes, hop=1, after_tokens=24,
                                        sampling=sampling)
    assert dead in {"tail", "spare"} and text == expected
    assert "repairing" in [s["phase"] for s in snaps] and snaps[-1]["repair"]["lost_node"] == dead
    await freed(nodes, dead)


async def test_a_session_of_sampled_choices_that_loses_its_head_fails_saying_why(
        settings: Settings, swarms: Swarms, gemma_path: Path) -> None:
    """n > 1 sampled choices fork on the route, and their head is not replaced: the stream ends at once with a
    failure that names the lost head and says why it was not repaired (the tail used to publish its own bare
    failure first), never a hang; every surviving node frees the session."""
    nodes, gateway = await start(settings, swarms, gemma_path)
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=48, n=2, temperature=1.0, seed=5, stream=True,
        extra_body={"ignore_eos": True, "stream_options": {"include_telemetry": True}})
    seen, dead = 0, ""
    with pytest.raises(openai.APIError) as failure:
        async for chunk in chunks:
            snap = (chunk.model_extra or {}).get("swarmroute")
            if not dead and snap:
                dead = snap["route"][0]["node_id"]
            seen += sum(1 for c in chunk.choices if c.text)
            if seen >= 12 and dead in nodes and nodes[dead].proc.poll() is None:
                nodes[dead].kill()
    message = failure.value.message
    assert f"node {dead} failed" in message and "2 sampled choices is not repaired" in message, message
    await freed(nodes, dead)

