"""Sessions that survive a lost node (issue #18), on the stub backend with real node processes, a real tracker,
gateway and nats-server, and the official client: a SIGKILLed hop is replaced and the stream goes on with the very
tokens an undisturbed run gives (the stub's arithmetic is exact, so any KV rebuilt wrongly shows in the text)."""

from __future__ import annotations

import time

import openai
import pytest

from actors.tracker import Tracker
from gateway.app import Gateway
from schemas.settings import Settings
from tests.support.swarm import NodeProcess, Swarms, make_settings, wait_model

MODEL = "stub-model"


def stub_args(layers: str, delay: float) -> list[str]:
    return ["--backend", "stub", "--model", MODEL, "--layers", layers, "--n-layers", "8", "--stub-delay", str(delay)]


@pytest.fixture
def repair_settings(nats_server: object, tmp_path: object) -> Settings:
    return make_settings(nats_server.url, tmp_path / "home", token_timeout_s=3.0,  # type: ignore[attr-defined,operator]
                         first_token_timeout_s=5.0, hop_timeout_s=2.0, prefill_chunk=4, snapshot_every=8,
                         repair_timeout_s=15.0)


async def _stream(base_url: str, *, prompt: str, max_tokens: int, kill: dict[str, NodeProcess] | None = None,
                  hop: int = 0, after_tokens: int = 0, in_prefill: int = 0,
                  seed: int | None = None) -> tuple[str, list[dict]]:
    """The streamed text and every telemetry snapshot; the node at hop ``hop`` of the session's route (one of
    ``kill``) is SIGKILLed after ``after_tokens`` tokens (or, with ``in_prefill``, once that many prompt positions
    went through)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True, temperature=0 if seed is None else 1.0,
        seed=seed, extra_body={"ignore_eos": True, "stream_options": {"include_telemetry": True}})
    text, snaps, seen, killed = "", [], 0, False
    async for chunk in stream:
        snap = (chunk.model_extra or {}).get("swarmroute")
        if snap:
            snaps.append(snap)
        if chunk.choices and chunk.choices[0].text:
            text += chunk.choices[0].text
            seen += 1
        due = (in_prefill and snap and snap.get("phase") == "prefill" and snap["prefill"]["done"] >= in_prefill) \
            or (not in_prefill and after_tokens and seen >= after_tokens)
        if kill is not None and not killed and due:
            kill[snaps[0]["route"][hop]["node_id"]].kill()
            killed = True
    assert kill is None or killed
    return text, snaps


async def _three_hops(settings: Settings, swarms: Swarms, delay: float = 0.005) -> dict[str, NodeProcess]:
    nodes = {name: await swarms.node_process(settings, name, stub_args(layers, delay))
             for name, layers in [("head", "0:3"), ("middle", "3:6"), ("tail", "6:8")]}
    return nodes


@pytest.mark.parametrize("victim", ["middle", "tail"])
async def test_a_killed_hop_is_replaced_and_the_stream_goes_on_unchanged(repair_settings: Settings, swarms: Swarms,
                                                                         victim: str) -> None:
    nodes = await _three_hops(repair_settings, swarms)
    tracker = await swarms.actor(Tracker(repair_settings))
    gateway = await swarms.actor(Gateway(repair_settings, port=0))
    await wait_model(tracker, MODEL, n_nodes=3)
    prompt = "the quick brown fox jumps over the lazy dog"
    expected, _ = await _stream(gateway.url + "/v1", prompt=prompt, max_tokens=60)
    hop = 1 if victim == "middle" else 2
    nodes["spare"] = await swarms.node_process(repair_settings, "spare", stub_args(["3:6", "6:8"][hop - 1], 0.005))
    await wait_model(tracker, MODEL, n_nodes=4)
    started = time.monotonic()
    text, snaps = await _stream(gateway.url + "/v1", prompt=prompt, max_tokens=60, kill=nodes, hop=hop,
                                after_tokens=20)
    assert text == expected
    phases = [s["phase"] for s in snaps]
    assert "repairing" in phases and phases[-1] == "complete", phases
    repair = snaps[-1]["repair"]
    lost = snaps[0]["route"][hop]["node_id"]
    other = ({victim, "spare"} - {lost}).pop()
    assert repair["lost_node"] == lost and repair["replacement"] == [other], repair
    assert repair["source"] == "snapshot" and repair["snapshot_positions"] > 0, repair
    assert [h["node_id"] for h in snaps[-1]["route"]][hop] == other
    assert time.monotonic() - started < 30
